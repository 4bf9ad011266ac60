"""The proxy in front of the nodes: each request goes to a prefill node, then to a decode node."""
