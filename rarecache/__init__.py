"""rarecache: cross-model KV-cache handoff."""
