"""The KV connector vLLM loads (`connector.RarecacheConnector`): its scheduler and worker halves, the
engine-free handoff core they call (`core.py`), vLLM's paged cache (`paged.py`), our recompute over the
modules vLLM loaded (`weights.py`), tensor parallelism's head ranges (`sharding.py`) and the inspection
calls tests make into a worker (`debug.py`). It files and reads rows through the row store (`rowstore/`)
and knows nothing of the chat server (`server/`). Importing this package imports no vLLM."""
