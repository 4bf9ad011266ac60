"""Moving KV between nodes: kv_transfer_params, canonical caches, NIXL transport, gRPC side channel."""
