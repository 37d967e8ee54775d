"""The control plane: framing, the ZMQ server and client, links to peers and the peer table.

Its log lines go to the ``app.transfer.control`` logger."""
