"""``kv-sidecar bench``: raw ceiling, layer-wise goodput, overlap, descriptors, planning cost and
scale, in one run."""
