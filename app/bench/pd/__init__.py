"""``kv-sidecar bench pd``: kv-sidecar and vLLM's MooncakeConnector side by side, trial by trial."""
