"""`rarecache serve --engine vllm`: the chat service over two vLLM engines (`serving.py`, the `ChatBackend`
contract), the engines driven from threads of ours (`engines.py`), the start-up and its checks
(`launch.py`, `serve_config.py`), the quality gate one vLLM pass can decide (`vllm_gate.py`) and the
worker's handoff records as the service reads them (`records.py`). The only part of the adapter that
imports `serve/`."""
