"""Inspection calls into a running vLLM worker, for tests and diagnostics.

Start the engine with `worker_extension_cls="rarecache.adapters.vllm.connector.debug.WorkerExtension"`
and call `llm.collective_rpc("rarecache_...", args=(...))`. Results are plain values, and
tensors go through safetensors files at paths the caller names: no pickle crosses the
process boundary (vLLM would otherwise need VLLM_ALLOW_INSECURE_SERIALIZATION).
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ....engine.runner import Runner, pad_batch
from .weights import runner_over, shared_tensors


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / (1 << 20)


class WorkerExtension:
    def rarecache_dump_blocks(self, block_ids: list[int], path: str) -> str:
        """Save the raw paged blocks `block_ids` of every layer ("layer.{i}": (nb, Hkv, bs, 2D)) to `path`
        (`path` + ".rank{r}" under tensor parallelism: each rank holds its own heads)."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        if get_tensor_model_parallel_world_size() > 1:
            path = f"{path}.rank{get_tensor_model_parallel_rank()}"
        kv = get_kv_transfer_group()._kv
        idx = torch.tensor(block_ids, dtype=torch.long)
        save_file({f"layer.{i}": t[idx].cpu().clone() for i, t in kv.items()}, path)
        return path

    def rarecache_check_weights(self, token_ids: list[int], path: str) -> dict:
        """Build our Runner over this worker's vLLM model and report whether it shares vLLM's tensors;
        save its logits at every position of `token_ids`, and those of a separately loaded Runner
        (a second copy, for the comparison only), to `path`."""
        model = self.model_runner.model
        model_dir = Path(self.model_runner.vllm_config.model_config.model)
        before = _rss_mib()
        t = time.perf_counter()
        view = runner_over(model, model_dir)
        build_s = time.perf_counter() - t
        after = _rss_mib()
        vllm_ptrs = {p.data_ptr() for p in [*model.parameters(), *model.buffers()]}
        used = shared_tensors(view)
        embed = model.model.embed_tokens.weight
        tokens, positions = pad_batch([token_ids])
        with torch.inference_mode():
            t = time.perf_counter()
            ours = view.forward(tokens, positions, view.new_cache(1, len(token_ids)), logits_at="all").logits[0]
            view_s = time.perf_counter() - t
            copy = Runner.load(model_dir, dtype=embed.dtype)
            ref = copy.forward(tokens, positions, copy.new_cache(1, len(token_ids)), logits_at="all").logits[0]
        save_file({"view": ours.contiguous(), "copy": ref.contiguous()}, path)
        dense = [type(m).__name__ for m in view.model.modules()
                 if getattr(m, "weight", None) is not None and m.weight.numel() == 0]
        return {
            "shared": all(p.data_ptr() in vllm_ptrs for p in used),
            "tensors_read": len(used),
            "bytes_read": int(sum(p.numel() * p.element_size() for p in used)),
            "embed_shared": view.model.model.embed_tokens.weight.data_ptr() == embed.data_ptr(),
            "modules_without_dense_weight": len(dense),
            "rss_mib_before": round(before, 1), "rss_mib_after": round(after, 1),
            "build_s": round(build_s, 4), "forward_s": round(view_s, 4),
        }
