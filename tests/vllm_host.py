"""One vLLM engine with RarecacheConnector on a "host" of its own, for tests/test_vllm_hosts.py.

Run as `python -m tests.vllm_host --model DIR --store URL [--map PEER=FILE] --results FILE`,
inside a network namespace where one is available. It shares nothing with its peer engine but
the store's address: it reads one JSON command per line on stdin and appends one JSON result per
line to --results (vLLM's own logs go to stdout/stderr):

    {"op": "run", "name": ..., "prompt": [ids], "salt": str|null, "params": {...}|null}
        -> {"name", "tokens", "cached", "info"}   greedy NEW tokens; info = kv_transfer_params["rarecache"]
    {"op": "wait_rows", "name": ..., "scope": str, "tokens": [ids]}
        -> {"name", "found"}                      until this engine's rows of `tokens` are in the store
    {"op": "exit"}
"""

from __future__ import annotations

import argparse
import json
import sys
import time

NEW = 8


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--map", action="append", default=[])
    p.add_argument("--results", required=True)
    p.add_argument("--block-size", type=int, default=32)
    args = p.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from rarecache.adapters.vllm.server.engines import engine_environment
    from rarecache.adapters.vllm.rowstore.interface import model_identity
    from rarecache.adapters.vllm.rowstore.store_open import open_store

    engine_environment()
    maps = dict(m.split("=", 1) for m in args.map)
    extra = {"store": args.store, "rho": 1.0, "selector": "rank", "maps": maps}
    ktc = KVTransferConfig(kv_connector="RarecacheConnector",
                           kv_connector_module_path="rarecache.adapters.vllm.connector.connector", kv_role="kv_both",
                           kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              kv_cache_memory_bytes=64 << 20, max_num_seqs=4, seed=0, kv_transfer_config=ktc,
              block_size=args.block_size, max_model_len=512)
    me = model_identity(args.model)

    def emit(result: dict) -> None:
        with open(args.results, "a") as f:
            f.write(json.dumps(result) + "\n")

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "run":
            sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                                extra_args={"kv_transfer_params": {"rarecache": cmd["params"]}}
                                if cmd.get("params") is not None else None)
            prompt = {"prompt_token_ids": cmd["prompt"], **({"cache_salt": cmd["salt"]} if cmd.get("salt") else {})}
            (out,) = llm.generate([prompt], sp, use_tqdm=False)
            emit({"name": cmd["name"], "tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                  "info": (out.kv_transfer_params or {}).get("rarecache", {})})
        elif cmd["op"] == "wait_rows":  # the rows are filed an engine step after the answer
            store, deadline, found = open_store(args.store), time.monotonic() + 120, False
            while not found and time.monotonic() < deadline:
                llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)
                hit = store.lookup(me, cmd["scope"], cmd["tokens"])
                found = hit is not None and hit.length >= len(cmd["tokens"])
            emit({"name": cmd["name"], "found": found})
    return 0


if __name__ == "__main__":
    sys.exit(main())
