"""The --inject_nonfinite drills: the spec, parsed once, and
the faults put into the graph.

(docs/layout.md: the map.)
"""
