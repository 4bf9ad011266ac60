"""Names both ends of the proxy -> node wire speak (the proxy and the node's HTTP front import them from here)."""

CLUSTER_TOKEN_HEADER = "X-HybridPD-Cluster-Token"
# The request's local prefix hit in tokens (usage.prompt_tokens_details.cached_tokens), known at its first output,
# so also on a stream without usage: the proxy compares it with the hit its cache-aware routing predicted.
CACHED_TOKENS_HEADER = "X-HybridPD-Cached-Tokens"
# A prefill node's route that ends a lease for its holder (server/lease_routes.py).
LEASE_RELEASE_PATH = "/kv_leases/release"
