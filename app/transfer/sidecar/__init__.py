"""The sidecar process core, which wires every other room together (``process.Sidecar``)."""
