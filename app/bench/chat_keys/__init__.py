"""``kv-sidecar bench chat-keys``: how much of a chat's history its chat template keeps as a
prefix."""
