"""KV cache events on the wire, in vLLM's format: the node's publisher and the proxy's subscriber."""
