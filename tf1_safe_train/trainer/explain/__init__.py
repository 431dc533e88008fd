"""Explaining a skip (forensics): skips.jsonl records, the
replay's verdict, saved states, verdict counts, offline
replay.

(docs/layout.md: the map.)
"""
