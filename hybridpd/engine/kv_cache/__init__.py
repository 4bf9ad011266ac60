"""The hybrid KV cache: specs, per-group block pools, prefix hashing, per-kind managers, coordinator."""
