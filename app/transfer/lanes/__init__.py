"""The data plane: Mooncake transfer engines, one lane per peer, and the pool of lanes."""
