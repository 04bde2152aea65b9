"""The transfer technique: cross-model KV maps, scoring, selective recompute."""
