"""Serving-engine adapters: the handoff core (transfer/) run inside someone else's engine.

Each engine lives in its own subpackage (`adapters.vllm`) and is the only place that
imports that engine; nothing else in rarecache imports an adapter except `commands/serve.py`.
"""
