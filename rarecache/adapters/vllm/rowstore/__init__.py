"""The row store the engines share: its interface and rules (`interface.py`), one entry's format
(`entry.py`), the two backends (`store_dir.py`: a directory; `store_redis.py`: Redis or Valkey) and the
one place that opens one by its name (`store_open.py`). It imports neither the connector nor the server."""
