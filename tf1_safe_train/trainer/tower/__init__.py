"""The towers: devices and scopes, the tower unit (a step
leaving towers out), its report line, quarantine.

(docs/layout.md: the map.)
"""
