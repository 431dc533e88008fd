"""The step //:train builds: the towers' loss and gradients,
the criteria, the guarded apply, its bookkeeping and summaries.

(docs/layout.md: the map.)
"""
