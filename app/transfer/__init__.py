"""Moving KV between sidecars, in rooms that import one way (each only from those before it):

``planning`` (TP mapping, descriptors) < ``lanes`` (Mooncake data plane) < ``wire`` (messages,
frame and target signatures) < ``control`` (framing, server, client, peer links and table) <
``requests`` (the send and receive state machines) < ``sidecar`` (the process that wires them).
``tests/test_package_layers.py`` holds them to it.
"""
