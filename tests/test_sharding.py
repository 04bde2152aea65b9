"""Tensor-parallel sharding of KV rows (rarecache/adapters/vllm/connector/sharding.py), on tiny tensors.

Which heads a rank holds (checked against a hand-written table and, where vllm imports,
against vLLM's own QKVParallelLinear and ModelConfig.get_num_kv_heads), a rank's columns,
and that rows split per rank join back exactly for every TP size and head count of the grid,
replicated heads included, while bad pieces are refused with a clear RarecacheError.
No engine runs; only the vLLM test imports vllm.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from rarecache.adapters.vllm.connector.sharding import (HeadRange, Piece, join_rows, kv_head_range, rank_columns,
                                                        split_rows)
from rarecache.errors import RarecacheError

TPS = (1, 2, 4, 8)
HEADS = (1, 2, 3, 4, 6, 8, 16)
GRID = [(h, tp) for h in HEADS for tp in TPS]
VALID = [(h, tp) for h, tp in GRID if h % tp == 0 or tp % h == 0]  # one divides the other
INVALID = [(h, tp) for h, tp in GRID if (h, tp) not in VALID]  # (3, 2), (3, 4), (6, 4), (3, 8), (6, 8)
D = 3  # head_dim
LEAD = (2, 5)  # e.g. (layers, positions)

KNOWN = {  # (kv heads, tp) -> (start, stop) per rank, by hand from vLLM's rule
    (8, 1): [(0, 8)],
    (8, 2): [(0, 4), (4, 8)],
    (16, 8): [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12), (12, 14), (14, 16)],
    (4, 4): [(0, 1), (1, 2), (2, 3), (3, 4)],
    (2, 4): [(0, 1), (0, 1), (1, 2), (1, 2)],  # neighbouring ranks share a head
    (2, 8): [(0, 1)] * 4 + [(1, 2)] * 4,
    (1, 8): [(0, 1)] * 8,
    (3, 1): [(0, 3)],
}


def full_rows(heads: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*LEAD, heads * D, generator=g).to(dtype)  # (2, 5, Hkv·D)


def primaries(pieces: list[Piece]) -> list[Piece]:
    """The first rank of each replica group: what a capture would file."""
    return [p for rank, p in enumerate(pieces) if rank % p.heads.replicas == 0]


# -- which heads a rank holds ------------------------------------------------------------


@pytest.mark.parametrize("heads,tp", sorted(KNOWN))
def test_head_ranges_known(heads, tp):
    got = [kv_head_range(heads, tp, r) for r in range(tp)]
    assert [(h.start, h.stop) for h in got] == KNOWN[heads, tp]
    assert all(h.replicas == max(1, tp // heads) for h in got)


@pytest.mark.parametrize("heads,tp", VALID)
def test_head_ranges_partition(heads, tp):
    """Every rank holds max(1, H // tp) heads, contiguous, and each head is held by max(1, tp // H) ranks."""
    held = [0] * heads
    for rank in range(tp):
        r = kv_head_range(heads, tp, rank)
        assert r.count == max(1, heads // tp) and r.columns(D) == slice(r.start * D, r.stop * D)
        for h in range(r.start, r.stop):
            held[h] += 1
    assert held == [max(1, tp // heads)] * heads


@pytest.mark.parametrize("heads,tp", INVALID)
def test_head_ranges_refuse_what_vllm_refuses(heads, tp):
    with pytest.raises(RarecacheError, match=rf"{heads} KV heads do not .* tensor_parallel_size {tp}.*divide"):
        kv_head_range(heads, tp, 0)


@pytest.mark.parametrize("args,match", [
    ((0, 1, 0), "num_kv_heads must be a positive integer"),
    ((-2, 1, 0), "num_kv_heads must be a positive integer"),
    ((True, 1, 0), "num_kv_heads must be a positive integer"),
    ((2.0, 1, 0), "num_kv_heads must be a positive integer"),
    ((2, 0, 0), "tensor_parallel_size must be a positive integer"),
    ((2, "2", 0), "tensor_parallel_size must be a positive integer"),
    ((2, 2, 2), r"rank 2 is not in \[0, 2\)"),
    ((2, 2, -1), r"rank -1 is not in \[0, 2\)"),
    ((2, 2, "0"), r"rank '0' is not in \[0, 2\)"),
])
def test_head_range_bad_arguments(args, match):
    with pytest.raises(RarecacheError, match=match):
        kv_head_range(*args)


# -- a rank's columns; split and join ------------------------------------------------------


@pytest.mark.parametrize("heads,tp", VALID)
def test_rank_columns_cover_the_rows(heads, tp):
    x = full_rows(heads)
    cols = {}
    for rank in range(tp):
        r = kv_head_range(heads, tp, rank)
        c = rank_columns(x, heads, D, tp, rank)
        assert c.shape == (*LEAD, r.count * D) and c.data_ptr() == x[..., r.start * D:].data_ptr()  # a view
        assert torch.equal(c.reshape(*LEAD, r.count, D), x.reshape(*LEAD, heads, D)[..., r.start:r.stop, :])
        if r.start in cols:  # a replica holds the same columns
            assert torch.equal(cols[r.start], c)
        cols[r.start] = c
    assert torch.equal(torch.cat([cols[s] for s in sorted(cols)], dim=-1), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,tp", VALID)
def test_join_split_roundtrip(heads, tp, dtype):
    x = full_rows(heads, dtype, seed=heads * 10 + tp)
    pieces = split_rows(x, heads, D, tp)
    assert len(pieces) == tp
    assert [p.heads for p in pieces] == [kv_head_range(heads, tp, r) for r in range(tp)]
    for chosen in (pieces, primaries(pieces), random.Random(tp).sample(pieces, tp)):  # all, deduplicated, shuffled
        y = join_rows(chosen, heads, D)
        assert y.dtype == dtype and torch.equal(y, x)


def test_join_mixes_tp_sizes():
    """An entry's pieces need not come from one TP size: join only needs each head once."""
    x = full_rows(8)
    tp2, tp4, tp8 = (split_rows(x, 8, D, tp) for tp in (2, 4, 8))
    assert torch.equal(join_rows([tp2[0], tp4[2], tp8[6], tp8[7]], 8, D), x)
    assert torch.equal(join_rows([tp4[3], tp2[0], tp4[2]], 8, D), x)


def test_join_pieces_from_stored_metadata():
    """A reader rebuilds Pieces from (start, stop) it read and the tensors; replicas is not trusted."""
    x = full_rows(4)
    pieces = [Piece(HeadRange(p.heads.start, p.heads.stop, replicas=99), p.rows.contiguous())
              for p in split_rows(x, 4, D, 2)]
    assert torch.equal(join_rows(pieces, 4, D), x)


def test_rank_columns_bad_rows():
    with pytest.raises(RarecacheError, match=r"rows \(2, 5, 10\) are not \(\.\.\., 4·3\)"):
        rank_columns(torch.zeros(2, 5, 10), 4, D, 2, 0)
    with pytest.raises(RarecacheError, match="are not"):
        rank_columns([[0.0] * 12], 4, D, 2, 0)
    with pytest.raises(RarecacheError, match="head_dim must be a positive integer"):
        rank_columns(torch.zeros(12), 4, 0, 2, 0)
    with pytest.raises(RarecacheError, match="6 KV heads do not split over tensor_parallel_size 4"):
        split_rows(torch.zeros(6 * D), 6, D, 4)


X4 = full_rows(4)
P = split_rows(X4, 4, D, 4)  # one head each


def piece(start: int, stop: int, rows=None) -> Piece:
    return Piece(HeadRange(start, stop), X4[..., start * D:stop * D] if rows is None else rows)


@pytest.mark.parametrize("pieces,match", [
    ([], "non-empty list of Pieces"),
    (P[0], "non-empty list of Pieces"),
    (X4, "non-empty list of Pieces"),
    ("pieces", "non-empty list of Pieces"),
    ([P[0], X4], "piece 1 is not a Piece"),
    ([Piece((0, 4), X4)], "piece 0 is not a Piece"),
    ([Piece(HeadRange(0, 4), X4.numpy())], "piece 0 is not a Piece"),
    ([P[0], P[1], P[3]], r"KV heads \[2, 3\) are covered by no piece \(of 4\)"),
    ([P[0], P[1], P[2]], r"KV heads \[3, 4\) are covered by no piece \(of 4\)"),
    ([P[1], P[2], P[3]], r"KV heads \[0, 1\) are covered by no piece"),
    ([piece(0, 2), piece(1, 3), piece(3, 4)], r"KV heads \[1, 2\) are claimed by overlapping pieces"),
    ([piece(0, 2), piece(0, 3), piece(3, 4)], r"\[0, 2\) and \[0, 3\): overlapping ranges"),
    ([piece(0, 4), piece(3, 4)], r"KV heads \[3, 4\) are claimed by overlapping pieces"),
    ([piece(0, 4), piece(1, 2)], r"KV heads \[1, 2\) are claimed by overlapping pieces"),
    ([Piece(HeadRange(0, 5), X4)], r"claims KV heads \[0, 5\), not a range inside \[0, 4\)"),
    ([Piece(HeadRange(-1, 3), X4)], r"claims KV heads \[-1, 3\)"),
    ([Piece(HeadRange(2, 2), X4[..., :0])], r"claims KV heads \[2, 2\)"),
    ([Piece(HeadRange(True, 4), X4)], r"claims KV heads \[True, 4\)"),
    ([Piece(HeadRange(0, 4.0), X4)], r"claims KV heads \[0, 4.0\)"),
    ([piece(0, 2), piece(2, 4, X4[..., :3 * D])],
     r"piece 1 \(KV heads \[2, 4\)\) has rows \(2, 5, 9\), not \(\.\.\., 2·3\)"),
    ([piece(0, 2), piece(2, 4, torch.tensor(1.0))], r"piece 1 \(KV heads \[2, 4\)\) has rows \(\)"),
    ([piece(0, 2), piece(2, 4, X4[:1, :, 2 * D:])], "leading shape, dtype and device must agree"),
    ([piece(0, 2), piece(2, 4, X4[..., 2 * D:].double())], r"torch.float64 .* torch.float32 .* must agree"),
    ([piece(0, 2), piece(0, 2, X4[..., :2 * D] + 1), piece(2, 4)],
     r"two pieces hold KV heads \[0, 2\) with different rows"),
])
def test_join_refuses_bad_pieces(pieces, match):
    with pytest.raises(RarecacheError, match=match):
        join_rows(pieces, 4, D)


def test_join_bad_config():
    with pytest.raises(RarecacheError, match="num_kv_heads must be a positive integer"):
        join_rows(P, 0, D)
    with pytest.raises(RarecacheError, match="head_dim must be a positive integer"):
        join_rows(P, 4, -3)


# -- against vLLM itself ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_linear():
    """vLLM's linear-layer module and its parameter module, with the TP rank and size made settable."""
    linear = pytest.importorskip("vllm.model_executor.layers.linear",
                                 reason="vLLM is not installed (pip install 'rarecache[vllm]'; see docs/VLLM.md)")
    from vllm.model_executor import parameter

    return linear, parameter


def vllm_held(linear, parameter, monkeypatch, heads: int, tp: int, rank: int):
    """The KV heads vLLM's own QKVParallelLinear loads on `rank` of `tp`: built with the TP group
    faked, then given a k_proj / v_proj whose row i holds i; returns (k heads, v heads) per rank."""
    for module in (linear, parameter):
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: tp)
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
    hidden, q_heads = 4, 16  # 16 query heads: divisible by every tp here, as vLLM requires
    layer = linear.QKVParallelLinear(hidden, D, q_heads, heads, bias=False, params_dtype=torch.float32)
    checkpoint = torch.arange(heads * D, dtype=torch.float32)[:, None].repeat(1, hidden)  # (Hkv·D, hidden)
    out = []
    for i, side in enumerate(("k", "v")):
        layer.weight_loader(layer.weight, checkpoint + 1000 * i, side)
        lo = (layer.num_heads + i * layer.num_kv_heads) * D
        got = layer.weight.data[lo:lo + layer.num_kv_heads * D, 0] - 1000 * i  # (h·D,): checkpoint rows
        assert torch.equal(got, torch.arange(int(got[0]), int(got[0]) + len(got), dtype=torch.float32))
        out.append((int(got[0]) // D, int(got[0]) // D + layer.num_kv_heads, layer.num_kv_head_replicas))
    return out


@pytest.mark.parametrize("heads,tp", GRID)
def test_head_ranges_match_vllm(vllm_linear, monkeypatch, heads, tp):
    linear, parameter = vllm_linear
    from vllm.config import ModelConfig

    counted = ModelConfig.get_num_kv_heads(  # vLLM's per-rank count, on a stand-in for its config
        SimpleNamespace(use_mla=False, model_arch_config=SimpleNamespace(total_num_kv_heads=heads)),
        SimpleNamespace(tensor_parallel_size=tp))
    if (heads, tp) in INVALID:  # vLLM refuses to build the layer (its `divide` asserts); so do we
        with pytest.raises(AssertionError, match="is not divisible by"):
            vllm_held(linear, parameter, monkeypatch, heads, tp, 0)
        with pytest.raises(RarecacheError):
            kv_head_range(heads, tp, 0)
        return
    for rank in range(tp):
        ours = kv_head_range(heads, tp, rank)
        k, v = vllm_held(linear, parameter, monkeypatch, heads, tp, rank)
        assert k == v == (ours.start, ours.stop, ours.replicas), f"rank {rank}"
        assert ours.count == counted
