"""The wire: the messages sidecars and engines exchange, and how frames and targets are signed."""
