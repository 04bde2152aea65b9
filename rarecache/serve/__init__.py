"""Serving: a chat service whose models share one prefix-cache store (handoff across models),
and its HTTP front (`rarecache serve`). FastAPI and uvicorn come with the `serve` extra."""
