"""The towers' input by example id: stored batches, examples
excluded at startup, a rollback's data window.

(docs/layout.md: the map.)
"""
