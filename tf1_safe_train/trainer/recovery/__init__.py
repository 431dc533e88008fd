"""--on_persistent_skips=rollback: an older checkpoint
restored in-process, its bookkeeping and target; what a
restart and a rollback keep (state_rules).

(docs/layout.md: the map.)
"""
