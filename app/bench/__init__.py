"""``kv-sidecar bench``: goodput, overlap, descriptors, planning cost and scale, in one run."""
