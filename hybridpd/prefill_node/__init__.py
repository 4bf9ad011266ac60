"""The producer role of a kv_both node (see role.py)."""
