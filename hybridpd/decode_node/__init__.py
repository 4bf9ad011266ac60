"""The consumer role of a kv_both node (see loader.py)."""
