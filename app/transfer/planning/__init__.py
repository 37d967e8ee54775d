"""Planning: which bytes of a prefill rank's KV go where on decode (TP mapping, descriptors).

The lowest room of ``app.transfer``: it imports no other room (the wire protocol names its
``MambaMode``)."""
