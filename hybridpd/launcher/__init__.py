"""Start and stop a local cluster (N prefill + M decode nodes and a proxy) as child processes."""
