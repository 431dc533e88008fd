"""Checkpoints: what a run resumes from, the last good one,
whether one fits the graph, the finite-state check.

(docs/layout.md: the map.)
"""
