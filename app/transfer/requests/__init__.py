"""The request state machines: agents, sends (prefill), receives (decode), registrations, pool
calls, and what a request records of its life (timelines, trace spans)."""
