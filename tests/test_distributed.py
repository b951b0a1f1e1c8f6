"""moekit.distributed: tensor parallel (TP) and expert parallel (EP) MoE on gloo, 2 and 3 CPU
processes, reference and torch backends, every scheme.

One torch.multiprocessing spawn per world size runs every case of that size in ONE process group;
the workers only run the distributed functions and save their outputs. The checks run here, in
the pytest process, against single-process computations (same seeds, same inputs).

What is checked, and where the tolerances come from (u = 2^-8, the unit roundoff of bf16):

1. EXACT (torch.equal) against the computation the distributed layer defines:
   TP: round(sum_r float32(fused_moe(x, shard_r))), summed in r order. The all-reduce adds the
       bf16 partials in float32, which is exact (so order-free: gloo's order cannot show) unless
       the partials of an element span more than ~15 binades.
   EP: for every destination rank d ONE fused_moe call (top-1) on the pairs routed to d's experts,
       taken in global (token, j) order, which is the order d receives them (source ranks in rank
       order, each in its own token order); then a float32 sum over j in j order. Same calls on
       the same inputs give the same bits, whatever the dynamic scales.
2. Against the SINGLE-PROCESS layer fused_moe(x, weights, ...) on the same backend:
   a. Where distribution changes no quantization (every scheme on the torch backend, which does
      not quantize activations; on the reference backend bf16, fp8-tensor-static and, under TP,
      fp8-block128, whose 1x128 groups never straddle shards; under EP every scheme but
      fp8-tensor-dynamic, all per-row) the results differ only by roundings to bf16:
        TP: each rank's partial p_r is rounded (error <= u |p_r| elementwise); on the torch
            backend also each (pair, shard) GEMM output q_jr (bf16 GEMM output), against the
            single process's own rounded pair outputs (whose norms are <= sum_r ||q_jr||);
        EP: each weighted pair output t_j is rounded once more (<= u |t_j|);
        both: each result's final rounding (<= u |out|, twice).
      So ||dist - single|| <= u (2 ||single|| + sum_i c_i ||t_i||) to first order, with t_i the
      rounded pieces (c = 1 for partials and EP pairs, 2 for the torch backend's q_jr); the test
      allows twice that (slack for float32 GEMM-order noise, ~2^-24 * H relative).
      With float32 activations, top-2 and the reference backend the EP result must equal the
      single-process one bitwise: each pair's expert output is the same (an expert's rows are the
      same rows, in the same order, on the destination as in the single process, and reference
      gathers them into a tensor of their own), nothing is rounded to bf16, and a + b = b + a in
      float32. (With top-k > 2 the order of the k-term sum could show. The torch backend's
      per-expert GEMM reads the rows in place, at another offset on the destination, and a
      float32 GEMM's last bits can depend on that alignment: seen with H = 65.)
   b. Where distribution changes a dynamic scale (reference backend: fp8-channel-token and
      fp8-tensor-dynamic under TP: the intermediate's scale is taken over the shard's columns;
      fp8-tensor-dynamic under EP: x's and the intermediate's scales over the rows a rank
      received), each scale is the amax of a subset of the single-process values, so <= the
      single-process scale: every element is quantized at least as finely, but not to the same
      value. Both are compared with the exact float64 layer (dequantized weights, nothing
      quantized): rel_l2(dist, exact) <= 1.25 rel_l2(single, exact) + 4u. 1.25 is a statistical
      margin (FP8 errors average over N terms and many outputs); a wrong shard gives ~1.
The mutation tests at the end feed the checks deliberately wrong results: the checks must fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import random_routing, random_weights, random_x, rel_l2

import moekit
import moekit.distributed as md

REPO = Path(__file__).resolve().parents[1]
U = 2.0**-8  # unit roundoff of bf16
SCHEMES = ("bf16", "fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token", "fp8-block128")
BACKENDS = ("reference", "torch")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mode: str  # "tp" or "ep"
    world: int
    scheme: str
    backend: str = "reference"
    E: int = 5  # odd: 3 + 2 experts over 2 ranks, 2 + 2 + 1 over 3
    H: int = 128
    N: int = 256  # TP over 3 ranks uses 384: fp8-block128 needs N / world a multiple of 128
    K: int = 2
    M: int | tuple[int, ...] = 8  # TP: the batch (every rank); EP: tokens of each rank
    dtype: torch.dtype = torch.bfloat16
    pool: tuple[int, ...] | None = None  # route only to these experts
    on_input: bool = False  # apply_router_weight_on_input (top-1)
    seed: int = 0

    @property
    def total_tokens(self) -> int:
        return self.M if self.mode == "tp" else sum(self.M)


def _cases(world: int) -> list[Case]:
    if world == 2:
        cases = [Case(f"tp2-{s}-{b}", "tp", 2, s, b) for s in SCHEMES for b in BACKENDS]
        cases += [
            Case("tp2-m1", "tp", 2, "fp8-channel-token", M=1, seed=1),
            Case("tp2-m0", "tp", 2, "bf16", "torch", M=0),
            Case("tp2-on-input", "tp", 2, "fp8-block128", K=1, M=4, on_input=True, seed=2),
        ]
        cases += [Case(f"ep2-{s}-{b}", "ep", 2, s, b, M=(6, 3)) for s in SCHEMES for b in BACKENDS]
        cases += [
            Case("ep2-rank1-no-tokens", "ep", 2, "fp8-channel-token", M=(7, 0), seed=3),
            Case("ep2-rank1-experts-idle", "ep", 2, "fp8-block128", M=(3, 4), pool=(0, 1, 2), seed=4),
            Case("ep2-m1", "ep", 2, "fp8-tensor-dynamic", M=(1, 1), seed=5),
            Case("ep2-m0", "ep", 2, "bf16", "torch", M=(0, 0)),
            Case("ep2-on-input", "ep", 2, "fp8-tensor-static", "torch", K=1, M=(3, 2), on_input=True, seed=6),
            Case("ep2-f32", "ep", 2, "fp8-channel-token", M=(5, 4), dtype=torch.float32, seed=7),
        ]
        return cases
    assert world == 3
    tp = [("bf16", "reference"), ("fp8-tensor-static", "torch"), ("fp8-tensor-dynamic", "reference"),
          ("fp8-channel-token", "reference"), ("fp8-block128", "reference")]
    ep = [("bf16", "torch"), ("fp8-tensor-static", "reference"), ("fp8-tensor-dynamic", "reference"),
          ("fp8-channel-token", "torch"), ("fp8-block128", "reference")]
    cases = [Case(f"tp3-{s}-{b}", "tp", 3, s, b, N=384, M=6) for s, b in tp]
    cases += [Case(f"ep3-{s}-{b}", "ep", 3, s, b, M=(4, 0, 3)) for s, b in ep]
    cases += [
        Case("ep3-e7-k3", "ep", 3, "fp8-channel-token", "torch", E=7, K=3, M=(2, 3, 1), seed=8),
        Case("ep3-only-rank0-experts", "ep", 3, "fp8-tensor-dynamic", M=(2, 2, 2), pool=(0, 1), seed=9),
    ]
    return cases


ALL_CASES = _cases(2) + _cases(3)


def _inputs(c: Case):
    W = random_weights(c.E, c.H, c.N, c.scheme, seed=c.seed)
    x = random_x(c.total_tokens, c.H, dtype=c.dtype, seed=c.seed)
    tw, ids = random_routing(c.total_tokens, c.E, c.K, seed=c.seed, experts=c.pool)
    return W, x, tw, ids


def _rows(c: Case, rank: int) -> slice:
    start = sum(c.M[:rank])
    return slice(start, start + c.M[rank])


# ------------------------------------------------------------------------ the multi-process run


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # 2-3 processes share the cores; and see _one_thread
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        outs = {}
        for c in _cases(world):  # one process group for every case
            W, x, tw, ids = _inputs(c)
            if c.mode == "tp":
                local = md.shard_weights_tp(W, rank, world)
                outs[c.name] = md.tp_fused_moe(
                    x, local, tw, ids, backend=c.backend, apply_router_weight_on_input=c.on_input
                )
            else:
                local = md.shard_weights_ep(W, rank, world)
                r = _rows(c, rank)
                outs[c.name] = md.ep_fused_moe(
                    x[r], local, tw[r], ids[r], c.E, backend=c.backend,
                    apply_router_weight_on_input=c.on_input,
                )
        # moekit.MoELayer over the same process group runs the same computation
        for mode in ("tp", "ep"):
            c = next(c for c in _cases(world) if c.mode == mode and c.total_tokens and not c.on_input)
            W, x, tw, ids = _inputs(c)
            layer = moekit.MoELayer.sharded(W, mode, backend=c.backend)
            r = slice(None) if mode == "tp" else _rows(c, rank)
            outs[f"layer-{mode}"] = layer(x[r], tw[r], ids[r])
            outs[f"layer-{mode}-case"] = c.name
            # compiled (fullgraph; the collectives run inside moekit's op): bitwise the eager layer
            compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
            outs[f"layer-{mode}-compiled"] = compiled(x[r], tw[r], ids[r])
        # The full weights where a shard belongs: refused before any collective, on every rank.
        c = next(c for c in _cases(world) if c.mode == "ep")
        W, x, tw, ids = _inputs(c)
        try:
            md.ep_fused_moe(x[_rows(c, rank)], W, tw[_rows(c, rank)], ids[_rows(c, rank)], c.E)
            outs["wrong-shard-refused"] = torch.tensor(False)
        except ValueError as e:
            outs["wrong-shard-refused"] = torch.tensor("shard_weights_ep" in str(e))
        outs.update(_refusals(rank, world, c))
        torch.save(outs, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _raised(call) -> str:
    """'TypeName: message' of what call() raised, '' where it returned."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the tests read the type and message
        return f"{type(e).__name__}: {e}"
    return ""


def _refusals(rank: int, world: int, c: Case) -> dict:
    """Bad input on some ranks, each followed by a good call that must still work: no rank is
    left waiting in a collective the others never started (the group would then time out)."""
    W, x, tw, ids = _inputs(c)
    r = _rows(c, rank)
    x, tw, ids = x[r], tw[r], ids[r]
    local = md.shard_weights_ep(W, rank, world)
    good = md.ep_fused_moe(x, local, tw, ids, c.E, backend=c.backend)
    bad_ids = ids.clone()
    if rank == world - 1:  # the last rank alone: an id out of range
        bad_ids[0, 0] = c.E + 2
    outs = {
        "one-rank-bad-ids": _raised(lambda: md.ep_fused_moe(x, local, tw, bad_ids, c.E, backend=c.backend)),
        "after-one-rank-bad-ids": md.ep_fused_moe(x, local, tw, ids, c.E, backend=c.backend),
        "ep-good": good,
        # every rank with the next rank's shard (a global rank mixed up with a group rank, say)
        "ep-next-rank-shard": _raised(lambda: md.ep_fused_moe(
            x, md.shard_weights_ep(W, (rank + 1) % world, world), tw, ids, c.E, backend=c.backend)),
        "tp-next-rank-shard": _raised(lambda: md.tp_fused_moe(  # N divisible by the world size
            x, md.shard_weights_tp(random_weights(c.E, c.H, c.N * world, c.scheme), (rank + 1) % world, world),
            tw, ids, backend=c.backend)),
    }
    # x of another dtype on rank 0 (float32 beside bf16: each valid with bf16 weights): the rows
    # differ in bytes; the dispatch aborted the job in gloo, now every rank raises a ValueError
    odd_x = x.float() if rank == 0 else x
    outs["ep-dtype-mismatch"] = _raised(lambda: md.ep_fused_moe(odd_x, local, tw, ids, c.E, backend=c.backend))
    outs["after-refusals"] = md.ep_fused_moe(x, local, tw, ids, c.E, backend=c.backend)
    outs.update(_nan_scale_on_one_rank(rank, world, c, x, tw, ids))
    return outs


def _nan_scale_on_one_rank(rank: int, world: int, c: Case, x, tw, ids) -> dict:
    """A MoELayer whose loaded state has a NaN weight scale on the last rank only (a corrupt
    checkpoint shard), under EP and TP, then the good state loaded and the next call. The scale
    check was left to the local fused_moe: under EP after the dispatch (the failing rank raised,
    the others waited in the return exchange, or gloo aborted them), under TP before the failing
    rank's all-reduce (its NEXT call's all-reduce then paired with the others': wrong outputs on
    every rank, no error)."""
    outs = {}
    for mode in ("ep", "tp"):
        W = random_weights(c.E, c.H, c.N * world, "fp8-channel-token", seed=13)  # N / world whole for TP
        rows = (x, tw, ids) if mode == "ep" else _inputs(c)[1:]  # TP: the whole (same) batch on every rank
        layer = moekit.MoELayer.sharded(W, mode, backend=c.backend)
        good = {k: v.clone() for k, v in layer.state_dict().items()}
        outs[f"{mode}-nan-scale-expected"] = layer(*rows)
        bad = {k: v.clone() for k, v in good.items()}
        if rank == world - 1:
            bad["w2_scale" if mode == "ep" else "w13_scale"][0, 0] = float("nan")
        layer.load_state_dict(bad)  # the layer checks the values at its next call (pending)
        outs[f"{mode}-one-rank-nan-scale"] = _raised(lambda: layer(*rows))
        outs[f"{mode}-nan-scale-retried"] = _raised(lambda: layer(*rows))  # the same call again, not reloaded
        layer.load_state_dict(good)
        outs[f"{mode}-after-nan-scale"] = layer(*rows)
    return outs


_RUNS: dict[int, object] = {}


def _outputs(world: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's outputs of every case of this world size (one spawn per size, cached)."""
    if world not in _RUNS:
        try:
            with tempfile.TemporaryDirectory() as d:
                mp.spawn(_worker, args=(world, os.path.join(d, "pg"), d), nprocs=world, join=True)
                _RUNS[world] = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]
        except Exception as e:  # noqa: BLE001 - reported by every test of this size
            _RUNS[world] = e
    if isinstance(_RUNS[world], Exception):
        pytest.fail(f"the {world}-process gloo run failed: {_RUNS[world]}")
    return _RUNS[world]


# --------------------------------------------------------------------------------- expectations


def _single(c: Case, W, x, tw, ids):
    return moekit.fused_moe(x, W, tw, ids, c.backend, apply_router_weight_on_input=c.on_input)


def _tp_defined(c: Case, W, x, tw, ids):
    """(round(sum_r float32(partial_r)), [partial_r], [q_jr pieces: torch backend only])."""
    parts, pieces = [], []
    for r in range(c.world):
        shard = md.shard_weights_tp(W, r, c.world)
        parts.append(moekit.fused_moe(x, shard, tw, ids, c.backend, apply_router_weight_on_input=c.on_input))
        if c.backend == "torch" and c.total_tokens:  # every (pair, shard) GEMM output, rounded
            q = moekit.fused_moe(
                x.repeat_interleave(c.K, 0), shard, tw.reshape(-1, 1), ids.reshape(-1, 1), c.backend,
                apply_router_weight_on_input=c.on_input,
            ).view(c.total_tokens, c.K, -1)
            pieces += [q[:, j] for j in range(c.K)]
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return total.to(x.dtype), parts, pieces


def _ep_defined(c: Case, W, x, tw, ids):
    """(the EP layer as defined, [weighted pair outputs t_j]) computed in one process: per
    destination rank, one top-1 fused_moe over its pairs in global order; j-order float32 sum."""
    M, K, E, ws = c.total_tokens, c.K, c.E, c.world
    sizes = [E // ws + (r < E % ws) for r in range(ws)]
    flat_ids, flat_w = ids.reshape(-1).long(), tw.reshape(-1, 1)
    token = torch.arange(M * K) // K
    pair_out = torch.zeros(M * K, c.H, dtype=x.dtype)
    start = 0
    for size in sizes:
        sel = ((flat_ids >= start) & (flat_ids < start + size)).nonzero().squeeze(1)
        local = moekit.MoEWeights(W.scheme, **{
            k: v[start : start + size] if k in ("w13", "w2", "w13_scale", "w2_scale") else v
            for k, v in W.tensors().items()
        })
        if len(sel):
            pair_out[sel] = moekit.fused_moe(
                x[token[sel]], local, flat_w[sel], (flat_ids[sel] - start).int()[:, None], c.backend,
                apply_router_weight_on_input=c.on_input,
            )
        start += size
    pairs = pair_out.view(M, K, c.H)
    out = pairs[:, 0].float()
    for j in range(1, K):
        out = out + pairs[:, j].float()
    return out.to(x.dtype), [pairs[:, j] for j in range(K)]


def _exact(c: Case, W, x, tw, ids) -> torch.Tensor:
    """The layer in float64 on the dequantized weights, nothing quantized or rounded."""
    w13, w2 = (w.double() for w in W.dequantize())
    xd, wd = x.double(), tw.double()
    if c.on_input:
        xd, wd = xd * wd, torch.ones_like(wd)
    h = torch.einsum("mh,enh->men", xd, w13)
    act = torch.nn.functional.silu(h[..., : W.n]) * h[..., W.n :]
    y = torch.einsum("men,ehn->meh", act, w2)
    chosen = y[torch.arange(len(x))[:, None], ids.long()]  # [M, K, H]
    return (chosen * wd[..., None]).sum(dim=1)


def _same_quantization(c: Case) -> bool:
    """Does distribution leave every quantization of this case unchanged? (docstring, 2a/2b)"""
    if c.backend == "torch" or c.scheme in ("bf16", "fp8-tensor-static"):
        return True
    if c.mode == "tp":
        return c.scheme == "fp8-block128"
    return c.scheme != "fp8-tensor-dynamic"


# -------------------------------------------------------------------------------------- checks


def _assert_equal(out, expected, what):
    assert out.shape == expected.shape and out.dtype == expected.dtype, (
        f"{what}: got {tuple(out.shape)} {out.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
    )
    if not torch.equal(out, expected):
        diff = (out.double() - expected.double()).abs()
        raise AssertionError(
            f"{what}: not bitwise equal: {int((diff > 0).sum())} of {diff.numel()} elements differ, "
            f"max |diff| {float(diff.max()):.3g}, rel_l2 {rel_l2(out, expected):.3g}"
        )


def _assert_rounding_close(out, single, pieces, weights, what):
    """2a: ||out - single|| <= 2 u (2 ||single|| + sum_i c_i ||t_i||)."""
    ns = float(single.double().norm())
    bound = 2 * U * (2 * ns + sum(c * float(t.double().norm()) for t, c in zip(pieces, weights)))
    err = float((out.double() - single.double()).norm())
    assert err <= bound, f"{what}: ||dist - single|| = {err:.4g} > bound {bound:.4g} (||single|| = {ns:.4g})"


def _assert_no_worse(out, single, exact, what):
    """2b: the distributed FP8 error is no worse than the single-process one (finer scales)."""
    e_dist, e_single = rel_l2(out, exact), rel_l2(single, exact)
    assert e_dist <= 1.25 * e_single + 4 * U, (
        f"{what}: rel_l2 to the exact layer {e_dist:.4g}, single-process {e_single:.4g}"
    )


def _check_against_single(c: Case, out, single, pieces, weights, inputs):
    if _same_quantization(c):
        _assert_rounding_close(out, single, pieces, weights, f"{c.name} vs single-process")
    else:
        _assert_no_worse(out, single, _exact(c, *inputs), f"{c.name} vs single-process")


@contextlib.contextmanager
def _one_thread():
    """The workers' thread count: float32 GEMMs on the CPU give other last bits with another
    number of threads, and the exact checks compare bits."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@_one_thread()
def _check_tp(c: Case, rank_outs: list[torch.Tensor]) -> None:
    inputs = _inputs(c)
    expected, parts, q = _tp_defined(c, *inputs)
    for r, out in enumerate(rank_outs):  # every rank holds the whole, identical, output
        _assert_equal(out, expected, f"{c.name} rank {r} vs round(sum of partials)")
    if c.total_tokens:
        pieces, weights = parts + q, [1] * len(parts) + [2] * len(q)
        _check_against_single(c, rank_outs[0], _single(c, *inputs), pieces, weights, inputs)


@_one_thread()
def _check_ep(c: Case, rank_outs: list[torch.Tensor]) -> None:
    inputs = _inputs(c)
    expected, pair_pieces = _ep_defined(c, *inputs)
    for r, out in enumerate(rank_outs):
        _assert_equal(out, expected[_rows(c, r)], f"{c.name} rank {r} vs per-destination fused_moe")
    if c.total_tokens:
        out = torch.cat(rank_outs)
        single = _single(c, *inputs)
        if c.dtype == torch.float32 and c.K <= 2 and c.backend == "reference":  # module docstring, 2a
            _assert_equal(out, single, f"{c.name} (float32, top-{c.K}) vs single-process")
        _check_against_single(c, out, single, pair_pieces, [1] * len(pair_pieces), inputs)


@pytest.mark.parametrize("case", [c for c in ALL_CASES if c.mode == "tp"], ids=lambda c: c.name)
def test_tensor_parallel(case):
    outs = _outputs(case.world)
    _check_tp(case, [o[case.name] for o in outs])


@pytest.mark.parametrize("case", [c for c in ALL_CASES if c.mode == "ep"], ids=lambda c: c.name)
def test_expert_parallel(case):
    outs = _outputs(case.world)
    _check_ep(case, [o[case.name] for o in outs])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_moe_layer_runs_the_distributed_layer(world, mode):
    """MoELayer.sharded(weights, mode) computes what tp_fused_moe / ep_fused_moe compute, bitwise
    (the same calls on the same shards), eager and under torch.compile."""
    for rank_out in _outputs(world):
        case = rank_out[f"layer-{mode}-case"]
        assert torch.equal(rank_out[f"layer-{mode}"], rank_out[case])
        assert torch.equal(rank_out[f"layer-{mode}-compiled"], rank_out[case])


@pytest.mark.parametrize("world", [2, 3])
def test_expert_parallel_refuses_unsharded_weights(world):
    assert all(bool(o["wrong-shard-refused"]) for o in _outputs(world))


@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_on_one_rank_raises_on_every_rank(world):
    """EP: each rank has its own tokens, so a bad id is on one rank. That rank raised and the
    others waited in the count exchange until the group's timeout; now every rank raises at
    once (the others naming the failing rank) and the group goes on working."""
    outs = _outputs(world)
    last = world - 1
    assert outs[last]["one-rank-bad-ids"].startswith("ValueError: topk_ids must lie in")
    for rank in range(last):
        assert outs[rank]["one-rank-bad-ids"] == (
            f"RuntimeError: ep_fused_moe: rank(s) [{last}] of the process group refused their inputs "
            "(their own error says why); no rank ran the layer"
        )
    for o in outs:
        assert torch.equal(o["after-one-rank-bad-ids"], o["ep-good"])
        assert torch.equal(o["after-refusals"], o["ep-good"])


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_x_of_different_dtypes_raise_on_every_rank(world):
    """EP: float32 x on rank 0 and bf16 on the others (each valid with bf16 weights) made rows of
    different byte sizes: gloo aborted the job in the dispatch. The rows' layout travels beside
    the counts, and every rank raises the same ValueError naming each rank's dtype."""
    outs = _outputs(world)
    ranks = "; ".join(f"rank {r}: {'torch.float32' if r == 0 else 'torch.bfloat16'}, H = 128" for r in range(world))
    for o in outs:
        assert o["ep-dtype-mismatch"] == (
            f"ValueError: ep_fused_moe: the ranks' x differ in dtype or hidden size ({ranks}); every rank of the "
            "group must pass x of one dtype and size (the dispatched rows are x's bytes); no rank ran the layer"
        )
        assert torch.equal(o["after-refusals"], o["ep-good"])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_a_corrupt_scale_on_one_rank_raises_on_every_rank(world, mode):
    """A NaN weight scale loaded into one rank's layer: that rank raises the scale's ValueError,
    every other rank a RuntimeError naming it, none returns an output; the next call, after the
    good state is loaded, is the layer's output on every rank (EP: the others had hung or been
    aborted; TP: every rank's outputs were wrong, silently)."""
    outs = _outputs(world)
    last = world - 1
    scale = "w2_scale" if mode == "ep" else "w13_scale"
    assert outs[last][f"{mode}-one-rank-nan-scale"].startswith(f"ValueError: MoEWeights.{scale} has 1 value(s) that are NaN")
    what = "inputs" if mode == "ep" else "weights"
    for rank in range(last):
        assert outs[rank][f"{mode}-one-rank-nan-scale"] == (
            f"RuntimeError: {mode}_fused_moe: rank(s) [{last}] of the process group refused their {what} "
            "(their own error says why); no rank ran the layer"
        )
    for o in outs:  # a retry without reloading (the failing rank's check still pending) fails alike
        assert o[f"{mode}-nan-scale-retried"] == o[f"{mode}-one-rank-nan-scale"]
    for o in outs:
        assert torch.equal(o[f"{mode}-after-nan-scale"], o[f"{mode}-nan-scale-expected"])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_another_ranks_shard_is_refused(world, mode):
    """Every rank given the next rank's shard (all wrong, so none waits for another): each raises
    a ValueError naming both ranks. Before the shard tag EP compared only the number of experts
    and TP nothing, and both returned garbage."""
    for rank, o in enumerate(_outputs(world)):
        other = (rank + 1) % world
        assert o[f"{mode}-next-rank-shard"] == (
            f"ValueError: these weights are the shard for {mode} rank {other} of {world}, but this call runs as "
            f"{mode} rank {rank} of {world} of its process group (shard the whole layer's weights with "
            f"moekit.distributed.shard_weights_{mode}(weights, {rank}, {world}), or MoELayer.sharded)"
        )


# --------------------------------------------------------------------- sharding (one process)


def _gate_up(t, lo, hi, half):
    return torch.cat([t[:, lo:hi], t[:, half + lo : half + hi]], dim=1)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_shard_tp_is_the_slice_of_the_dequantized_weights(scheme, world):
    N = 768  # 384 or 256 columns per rank: whole 128-blocks over 2 and 3 ranks
    W = random_weights(3, 160, N, scheme, seed=11)  # H = 160: a partial 128-block of H
    w13, w2 = W.dequantize()
    n = N // world
    for r in range(world):
        s = md.shard_weights_tp(W, r, world)
        assert s.scheme == W.scheme and s.n == n and s.hidden == 160 and s.num_experts == 3
        d13, d2 = s.dequantize()
        assert torch.equal(d13, _gate_up(w13, r * n, (r + 1) * n, N)), "w13: gate rows then up rows"
        assert torch.equal(d2, w2[:, :, r * n : (r + 1) * n])
        if W.scheme.weight in ("tensor", "channel"):  # w2 per tensor / per output row: replicated
            assert torch.equal(s.w2_scale, W.w2_scale)
        for name in ("a13_scale", "a2_scale"):
            assert (getattr(s, name) is None) == (getattr(W, name) is None)
            if getattr(W, name) is not None:
                assert torch.equal(getattr(s, name), getattr(W, name))


def test_shard_tp_refuses_what_cannot_be_split():
    W = random_weights(2, 128, 256, "fp8-block128")
    with pytest.raises(ValueError, match="not a multiple of 128"):
        md.shard_weights_tp(W, 0, 4)  # 256 / 4 = 64 columns: would split 128x128 blocks
    with pytest.raises(ValueError, match="divisible by world_size=3"):
        md.shard_weights_tp(random_weights(2, 64, 256, "bf16"), 0, 3)
    with pytest.raises(ValueError, match="rank"):
        md.shard_weights_tp(W, 2, 2)


def test_expert_partition():
    assert md.expert_partition(5, 2) == [(0, 3), (3, 5)]
    assert md.expert_partition(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert md.expert_partition(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert md.expert_range(7, 2, 3) == (5, 7)
    with pytest.raises(ValueError, match="at least one expert per rank"):
        md.expert_partition(2, 3)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_shard_ep_holds_whole_experts(scheme):
    W = random_weights(5, 128, 256, scheme, seed=12)
    w13, w2 = W.dequantize()
    for r, (lo, hi) in enumerate(md.expert_partition(5, 3)):
        s = md.shard_weights_ep(W, r, 3)
        d13, d2 = s.dequantize()
        assert torch.equal(d13, w13[lo:hi]) and torch.equal(d2, w2[lo:hi])
        if W.a13_scale is not None:
            assert torch.equal(s.a13_scale, W.a13_scale) and torch.equal(s.a2_scale, W.a2_scale)


@pytest.mark.parametrize("mode", ["tp", "ep"])
@pytest.mark.parametrize("scheme", ["bf16", "fp8-tensor-static", "fp8-block128"])
def test_shards_are_copies_in_memory_of_their_own(scheme, mode):
    """The docstrings: 'contiguous copies: the full weights can be freed afterwards'. An EP shard
    was t[start:end].contiguous(), the slice itself (a slice of dim 0 is contiguous already), and
    so was TP's w2 over one rank: each rank kept the whole layer's storage alive, a per-rank
    state_dict saved the whole tensors, and writing the full weights in place changed the shard."""
    W = random_weights(4, 128, 256, scheme, seed=14)
    shard = md.shard_weights_ep if mode == "ep" else md.shard_weights_tp
    full = {t.untyped_storage().data_ptr() for t in W.tensors().values()}
    for world in (1, 2):
        for rank in range(world):
            s = shard(W, rank, world)
            before = {name: t.clone() for name, t in s.tensors().items()}
            for name, t in s.tensors().items():
                assert t.is_contiguous(), name
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), f"{name}: shares a larger storage"
                assert t.untyped_storage().data_ptr() not in full, f"{name}: a view of the full weights"
            for t in W.tensors().values():  # the full weights written in place leave the shard as it was
                t.view(torch.uint8).add_(1)
            assert all(torch.equal(s.tensors()[name].view(torch.uint8), b.view(torch.uint8))
                       for name, b in before.items())
            for t in W.tensors().values():
                t.view(torch.uint8).sub_(1)
            buf = io.BytesIO()  # one rank's state_dict holds its shard, not the whole layer
            torch.save(moekit.MoELayer(s, parallel=mode, num_experts=4 if mode == "ep" else None).state_dict(), buf)
            assert buf.tell() < s.nbytes + 8192


# ------------------------------------------------------------- one process, a one-rank group


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of this process alone: the layer's wiring and the checks before the
    collectives, without spawning."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_parallel_layer_auto_keeps_no_weight_copy(one_rank_group, mode):
    """README: a layer's auto never picks a backend that would copy the weights. Under parallel=
    "tp" / "ep" the layer called tp_fused_moe / ep_fused_moe, which called fused_moe without
    allow_weight_copies=False: on the CPU auto ran `torch`, which keeps a dequantized copy."""
    W = random_weights(4, 128, 128, "fp8-channel-token")
    tw, ids = random_routing(5, 4, 2)
    x = random_x(5, 128)
    layer = moekit.MoELayer.sharded(W, mode)  # backend="auto"
    out = layer(x, tw, ids)
    assert "torch" not in layer.weights.prepared
    if mode == "tp":  # one rank: its partial is the output, computed by the backend auto chose
        assert torch.equal(out, moekit.fused_moe(x, W, tw, ids, allow_weight_copies=False))


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_parallel_calls_are_inference_only_and_say_so(one_rank_group, mode):
    """As fused_moe: with an input that requires grad (here a trainable router's weights), the
    call warns once and builds no autograd graph (ep packed its rows outside no_grad, silently)."""
    W = random_weights(4, 128, 128, "bf16")
    tw, ids = random_routing(5, 4, 2)
    x = random_x(5, 128)
    call = (lambda w: md.tp_fused_moe(x, W, w, ids, backend="torch")) if mode == "tp" else (
        lambda w: md.ep_fused_moe(x, W, w, ids, 4, backend="torch"))
    want = call(tw)
    with pytest.warns(UserWarning, match="inference only") as caught:
        got = call(tw.clone().requires_grad_())
    assert len(caught) == 1 and not got.requires_grad and torch.equal(got, want)


def _record_count_exchanges(monkeypatch) -> list:
    """Patch all_to_all_single into a one-rank exchange (output = input) that records what each
    call sent: the list it returns. Only ep's count exchange may run: [world, (count, word)], the
    word 1 for a failure (ep._rank_word)."""
    sent = []

    def exchange_only(output, input, *args, **kwargs):
        assert input.shape == (1, 2), "the count exchange: [world, (count, failure flag or rows' layout)]"
        output.copy_(input)
        sent.append(input.clone())

    monkeypatch.setattr(dist, "all_to_all_single", exchange_only)
    return sent


def test_expert_parallel_checks_everything_before_the_first_collective(one_rank_group, monkeypatch):
    """ep_fused_moe's own checks skipped x's dtype and the top-k limit (and a named backend that
    cannot run was found only by the local fused_moe): those errors came after the count
    exchange had started, leaving the other ranks waiting in the next collective. Each refusal
    takes part in the count exchange alone, with its failure flag set (so that the other ranks
    raise too: test_bad_input_on_one_rank_raises_on_every_rank), and in no other collective."""
    sent = _record_count_exchanges(monkeypatch)
    W = random_weights(4, 128, 128, "fp8-channel-token")
    tw, ids = random_routing(5, 4, 2)
    x = random_x(5, 128)
    with pytest.raises(ValueError, match="x has dtype torch.float64"):
        md.ep_fused_moe(x.double(), W, tw, ids, 4)
    five = torch.zeros(5, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"top-k must be between 1 and the number of experts \(4\), got 5"):
        md.ep_fused_moe(x, W, torch.rand(5, 5), five, 4)
    with pytest.raises(moekit.BackendUnavailableError, match="cutlass"):  # CPU tensors: on any machine
        md.ep_fused_moe(x, W, tw, ids, 4, backend="cutlass")
    b = moekit.MoEWeights("fp16", *(t.half() for t in random_weights(4, 128, 128, "bf16").tensors().values()))
    with pytest.raises(ValueError, match="x has dtype torch.bfloat16 but the unquantized weights"):
        md.ep_fused_moe(x, b, tw, ids, 4)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\)"):
        md.ep_fused_moe(x, W, tw, ids + 4, 4)
    with pytest.raises(ValueError, match=r"the shard for ep rank 0 of 2, but this call runs as ep rank 0 of 1"):
        md.ep_fused_moe(x, md.shard_weights_ep(W, 0, 2), tw, ids, 4)
    with pytest.raises(ValueError, match=r"rank 0 of 1 owns experts \[0, 4\) of 4, but local_weights holds 2 experts"):
        md.ep_fused_moe(x, random_weights(2, 128, 128, "bf16"), tw, ids, 4)  # untagged: counted
    with pytest.raises(ValueError, match="apply_router_weight_on_input needs top-k = 1, got top-k = 2"):
        md.ep_fused_moe(x, W, tw, ids, 4, apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match="at least one expert per rank"):
        md.ep_fused_moe(x, W, tw, ids, 0)
    # a scale whose value check is pending (a MoELayer's weights after a load): fused_moe's check
    # ran after the dispatch had begun, leaving the other ranks waiting in the return exchange
    bad = dict(W.tensors(), w2_scale=W.w2_scale.clone().fill_(float("nan")))
    with moekit.weights.scale_values_checked_later():
        pending = moekit.MoEWeights(W.scheme, **bad)
    assert pending.scale_values_pending
    with pytest.raises(ValueError, match="MoEWeights.w2_scale has .* NaN"):
        md.ep_fused_moe(x, pending, tw, ids, 4)
    assert len(sent) == 10 and all(t.tolist() == [[0, 1]] for t in sent), "every refusal flagged its failure"


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_parallel_calls_check_their_flags_and_x(one_rank_group, monkeypatch, mode):
    """As fused_moe: a flag that is not True or False ("no" was taken as True) and an x that is
    not a tensor are refused, naming them; under ep before the dispatch (the flags were looked
    at only by the local fused_moe, after the other ranks had begun the exchange)."""
    sent = _record_count_exchanges(monkeypatch)
    W = random_weights(4, 128, 128, "bf16")
    tw, ids = random_routing(5, 4, 1)
    x = random_x(5, 128)
    call = (lambda x, **kw: md.tp_fused_moe(x, W, tw, ids, backend="reference", **kw)) if mode == "tp" else (
        lambda x, **kw: md.ep_fused_moe(x, W, tw, ids, 4, backend="reference", **kw))
    for flag in ("apply_router_weight_on_input", "allow_weight_copies"):
        for bad in ("no", None):
            with pytest.raises(ValueError, match=rf"^{flag} must be True or False, got {bad!r}$"):
                call(x, **{flag: bad})
    with pytest.raises(TypeError, match=r"^x must be a torch.Tensor, got NoneType$"):
        call(None)
    if mode == "ep":  # each refusal took part in the count exchange alone, flagging its failure
        assert len(sent) == 5 and all(t.tolist() == [[0, 1]] for t in sent)


# ---------------------------------------------------------------- the checks can fail (mutations)


def test_checks_reject_a_wrong_tp_shard():
    """A TP 'implementation' whose shards pair rank r's gate rows with the other rank's up rows."""
    c = Case("mutant-tp", "tp", 2, "fp8-tensor-static")
    W, x, tw, ids = _inputs(c)
    parts = []
    for r in range(2):
        s = md.shard_weights_tp(W, r, 2)
        other = md.shard_weights_tp(W, 1 - r, 2)
        n = s.n
        bad = moekit.MoEWeights(s.scheme, torch.cat([s.w13[:, :n], other.w13[:, n:]], 1), s.w2,
                                s.w13_scale, s.w2_scale, s.a13_scale, s.a2_scale)
        parts.append(moekit.fused_moe(x, bad, tw, ids, "reference").float())
    wrong = (parts[0] + parts[1]).to(x.dtype)
    with pytest.raises(AssertionError, match="not bitwise equal"):
        _check_tp(c, [wrong, wrong])
    with pytest.raises(AssertionError, match="bound"):
        _assert_rounding_close(wrong, _single(c, W, x, tw, ids), parts, [1, 1], "mutant")
    c2 = dataclasses.replace(c, scheme="fp8-channel-token")
    W2, x2, tw2, ids2 = _inputs(c2)
    wrong_weights = moekit.fused_moe(x2, W2, torch.ones_like(tw2), ids2, "reference")  # weights dropped
    with pytest.raises(AssertionError, match="rel_l2"):
        _assert_no_worse(wrong_weights, _single(c2, W2, x2, tw2, ids2), _exact(c2, W2, x2, tw2, ids2), "mutant")


def test_checks_reject_a_wrong_ep_combine():
    """An EP 'implementation' that hands back the single-process result (bf16 rounding once,
    not per pair), then one that swaps two tokens' outputs."""
    c = Case("mutant-ep", "ep", 2, "fp8-channel-token", M=(6, 3))
    W, x, tw, ids = _inputs(c)
    single = _single(c, W, x, tw, ids)
    with pytest.raises(AssertionError, match="not bitwise equal"):
        _check_ep(c, [single[_rows(c, r)] for r in range(2)])
    expected, pieces = _ep_defined(c, W, x, tw, ids)
    swapped = expected.clone()
    swapped[[0, 1]] = expected[[1, 0]]
    with pytest.raises(AssertionError, match="bound"):
        _assert_rounding_close(swapped, single, pieces, [1] * len(pieces), "mutant")


# ---------------------------------------------------------------------------- the bench script


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_distributed", REPO / "scripts" / "bench_distributed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_script_arguments():
    b = _bench_module()
    a = b.parse_args(["--model", "glm-4.5v-fp8", "--tp", "2"])
    assert (a.mode, a.size, a.model) == ("tp", 2, "glm-4.5v-fp8")
    a = b.parse_args(["--ep", "4", "--batch-sizes", "1,8", "--batch-sizes", "64", "--backend", "torch"])
    assert (a.mode, a.size, a.batch_sizes, a.backend) == ("ep", 4, [1, 8, 64], "torch")
    for bad in (["--tp", "2", "--ep", "2"], [], ["--tp", "0"], ["--ep", "2", "--batch-sizes", "0"]):
        with pytest.raises(SystemExit):
            b.parse_args(bad)


def test_bench_script_takes_the_clis_spellings():
    """Batch sizes space- or comma-separated, as `moekit bench` takes them; vLLM's --tp spellings."""
    b = _bench_module()
    assert b.parse_args(["--tp", "2", "--batch-sizes", "1", "8", "--batch-size", "64,8"]).batch_sizes == [1, 8, 64]
    for flag in ("--tp-size", "-tp", "--tensor-parallel-size"):
        assert b.parse_args([flag, "4"]).tp == 4


@pytest.mark.parametrize("argv,expected", [
    (["--model", "nonsense"], "--model: unknown model 'nonsense'"),
    (["--backend", "nonsense"], "--backend: unknown backend 'nonsense'"),
    (["--scheme", "nonsense"], "--scheme: unknown"),
    (["--batch-sizes", "1", "x"], "--batch-sizes: 'x' is not an integer"),
])
def test_bench_script_refuses_bad_names_before_joining_the_group(argv, expected, monkeypatch, capsys):
    """Under torchrun a bad --model or --backend was a traceback from every rank after the process
    group formed; now rank 0 prints one usage error and every rank exits 2 before any collective."""
    b = _bench_module()
    for rank, prints in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            b.parse_args(["--tp", "2", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and (expected in err) == prints and bool(err) == prints


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_bench_script_under_torchrun(mode, tmp_path):
    """The script end to end with 2 gloo processes at the scaled-down CPU shape, with --check."""
    out = tmp_path / "rows.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(REPO / "scripts" / "bench_distributed.py"), "--model", "glm-4.5v-fp8", f"--{mode}", "2",
        "--batch-sizes", "1,5", "--reps", "2", "--warmup", "1", "--check", "--out", str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # gloo, even on a GPU machine
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [1, 5]
    for r in rows:
        assert r["mode"] == mode and r["world_size"] == 2
        assert r["layer_us"] > 0 and 0 <= r["comm_us"] and 0 <= r["comm_share"]
        assert r["check_rel_l2"] < 0.05  # against single-process fused_moe on the full weights
    assert "comm share" in p.stdout


# ----------------------------------------------------------- shard tags and argument checks


def test_shards_are_tagged_and_keep_their_tag():
    W = random_weights(4, 128, 256, "fp8-channel-token")
    tp = md.shard_weights_tp(W, 1, 2)
    ep = md.shard_weights_ep(W, 1, 2)
    assert W.shard is None
    assert tp.shard == moekit.weights.Shard("tp", 1, 2, 256) and ep.shard == moekit.weights.Shard("ep", 1, 2, 4)
    assert tp.to("cpu").shard == tp.shard
    layer = moekit.MoELayer(tp, parallel="tp")
    layer.to("cpu").w13 = layer.w13.clone()  # the layer's weights rebuilt from its buffers
    assert layer.weights.shard == tp.shard
    for shard in (md.shard_weights_tp, md.shard_weights_ep):
        with pytest.raises(ValueError, match="already a shard"):
            shard(tp, 0, 2)


def test_layer_refuses_weights_that_are_not_its_shard(tmp_path):
    W = random_weights(4, 128, 256, "bf16")
    with pytest.raises(ValueError, match=r"parallel='tp' needs this rank's shard .* got whole weights"):
        moekit.MoELayer(W, parallel="tp")  # would have returned world size x the output
    with pytest.raises(ValueError, match=r"parallel='ep' needs .* got a shard for 'tp'"):
        moekit.MoELayer(md.shard_weights_tp(W, 0, 2), parallel="ep", num_experts=4)
    with pytest.raises(ValueError, match=r"one rank's shard .* pass parallel='tp'"):
        moekit.MoELayer(md.shard_weights_tp(W, 0, 2))
    assert moekit.MoELayer(md.shard_weights_tp(W, 0, 1)).weights.n == 256  # one rank's shard is the whole
    with pytest.raises(ValueError, match="process_group is only for parallel='tp' or 'ep'"):
        moekit.MoELayer(W, process_group=object())


def test_counts_must_be_integers():
    np = pytest.importorskip("numpy")
    assert md.expert_partition(np.int64(8), 2) == [(0, 4), (4, 8)]  # NumPy integers are integers
    assert md.expert_range(torch.tensor(5), 1, 2) == (3, 5)
    for bad in (8.0, "8", True):
        with pytest.raises(TypeError, match="num_experts must be an int"):
            md.expert_partition(bad, 2)
    with pytest.raises(TypeError, match="world_size must be an int"):
        md.expert_partition(8, 2.0)
    ep = md.shard_weights_ep(random_weights(4, 128, 128, "bf16"), 0, 2)
    with pytest.raises(TypeError, match="num_experts must be an int, got bool"):
        moekit.MoELayer(ep, parallel="ep", num_experts=True)
    assert moekit.MoELayer(ep, parallel="ep", num_experts=np.int64(4)).num_experts == 4


def test_plan_counts_without_bincount():
    """The pairs per destination, made by a scatter-add (torch.bincount reads min and max on the
    host on CUDA): the same counts as bincount, for every world size and routing here."""
    from moekit.distributed.ep import _plan

    for E, world, seed in ((5, 2, 0), (7, 3, 1), (8, 8, 2), (16, 4, 3)):
        tw, ids = random_routing(37, E, 2, seed=seed)
        counts = _plan(ids, E, world)[3]
        dest = torch.bucketize(ids.reshape(-1).long(), torch.tensor([e for _, e in md.expert_partition(E, world)]),
                               right=True)
        assert torch.equal(counts, torch.bincount(dest, minlength=world))


def test_tp_reduce_dtype_is_checked(one_rank_group):
    W = md.shard_weights_tp(random_weights(4, 128, 128, "bf16"), 0, 1)
    tw, ids = random_routing(5, 4, 2)
    x = random_x(5, 128)
    for bad in (torch.int32, "float32", torch.bool):
        with pytest.raises(TypeError, match="reduce_dtype must be a floating point torch.dtype or None"):
            md.tp_fused_moe(x, W, tw, ids, reduce_dtype=bad)
    assert torch.equal(md.tp_fused_moe(x, W, tw, ids, reduce_dtype=torch.float64), moekit.fused_moe(x, W, tw, ids))


def test_init_from_env_returns_the_group_made_before(one_rank_group, monkeypatch):
    """A group made before (mp.spawn + init_process_group, no torchrun variables): its rank and
    backend; RANK and WORLD_SIZE without LOCAL_RANK no longer raise; another backend does."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    env = md.init_from_env()
    assert (env.rank, env.world_size, env.local_rank, env.backend, env.device) == (0, 1, 0, "gloo", torch.device("cpu"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert md.init_from_env(backend="GLOO").backend == "gloo"  # names are case-insensitive
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert md.init_from_env().local_rank == 3
    with pytest.raises(ValueError, match="init_from_env\\(backend='nccl'\\) but the process group already initialised uses 'gloo'"):
        md.init_from_env(backend="nccl")


@pytest.mark.parametrize("made_with", [None, "cpu:gloo"])
def test_init_from_env_takes_a_group_made_without_a_backend_name(made_with, tmp_path, monkeypatch):
    """`dist.init_process_group()` under torchrun names no backend: dist.get_backend() then says
    'undefined' ('cpu:gloo' or 'cpu:gloo,cuda:nccl' for one made with device:backend pairs).
    Only the exact "nccl" counted as a GPU group, so init_from_env answered the CPU on a GPU host,
    and init_from_env(backend="gloo") raised 'already initialised uses 'undefined''."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    if torch.cuda.is_available():  # there a group made without a name is torch's GPU group
        pytest.skip("checks the CPU side: a group made without a backend name on a GPU host is an nccl group")
    kw = {} if made_with is None else {"backend": made_with}
    dist.init_process_group(init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), **kw)
    try:
        assert dist.get_backend() == (made_with or "undefined")
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        for backend in (None, "gloo"):
            env = md.init_from_env(backend=backend)
            assert (env.backend, env.device) == ("gloo", torch.device("cpu"))
        with pytest.raises(ValueError, match="init_from_env\\(backend='nccl'\\) but the process group already initialised uses 'gloo'"):
            md.init_from_env(backend="nccl")
    finally:
        dist.destroy_process_group()


def test_a_mixed_group_is_a_gpu_group_unless_gloo_is_asked_for(one_rank_group, monkeypatch):
    """A group with nccl for CUDA beside gloo for the CPU (what init_process_group() made on a GPU
    host in some torch versions, or "cpu:gloo,cuda:nccl" by name): the GPU, nccl, unless
    backend="gloo" asks for its CPU side. Checked without a GPU: the configuration and CUDA's
    presence are patched."""
    from moekit.distributed import launch

    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert launch.group_backends() == {"cpu": "gloo", "cuda": "nccl"}
    assert launch.group_device() == torch.device("cuda", 0)
    env = md.init_from_env()
    assert (env.backend, env.device) == ("nccl", torch.device("cuda", 0))
    env = md.init_from_env(backend="gloo")
    assert (env.backend, env.device) == ("gloo", torch.device("cpu"))
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    with pytest.raises(ValueError, match="init_from_env\\(backend='gloo'\\) but the process group already initialised uses 'nccl'"):
        md.init_from_env(backend="gloo")


def test_a_refusing_rank_sends_its_flag_where_its_data_is(one_rank_group, monkeypatch):
    """A rank that fails its checks sends zero counts and its failure flag where the other ranks'
    counts are: on its data's device (the weights'). It took the device from the backend's name,
    the current GPU for "nccl" only, so the CPU for a GPU group made without a name ('undefined')
    while the counts of the others, on their GPUs, went through NCCL: a hang. Here the group says
    nccl and the data is on the CPU: the flag follows the data."""
    sent = _record_count_exchanges(monkeypatch)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    W = random_weights(4, 128, 128, "bf16")
    tw, ids = random_routing(5, 4, 2)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\)"):
        md.ep_fused_moe(random_x(5, 128), W, tw, ids + 4, 4)
    assert len(sent) == 1 and sent[0].device == torch.device("cpu") and sent[0].tolist() == [[0, 1]]


@pytest.mark.parametrize("argv,world,expected", [
    (["--model", "mixtral-8x7b", "--ep", "16"], None, "--ep 16: the model has only 8 experts"),
    (["--tp", "2"], "4", "--tp 2 must equal the number of processes (WORLD_SIZE=4)"),
])
def test_bench_script_refuses_sizes_that_do_not_suit_before_joining(argv, world, expected, monkeypatch, capsys):
    b = _bench_module()
    monkeypatch.setenv("RANK", "0")
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as e:
        b.parse_args(argv)
    assert e.value.code == 2 and expected in capsys.readouterr().err


def test_bench_script_shape_conditions_on_a_gpu_are_value_errors():
    """At the real (GPU) shape: GLM-4.5V's intermediate over 3 ranks, DeepSeek-V3's 2048 over 32
    (64 per rank, not a whole 128-block). parse_args turns them into usage errors before the group
    forms; checked here without a GPU (the device only says which shape)."""
    import argparse

    b = _bench_module()
    cuda = torch.device("cuda")
    glm = argparse.Namespace(model="glm-4.5v-fp8", scheme=None, mode="tp", size=3)
    with pytest.raises(ValueError, match="--tp 3: the intermediate size 1408 is not divisible by 3"):
        b.layer_shape(glm, cuda)
    deepseek = argparse.Namespace(model="deepseek-v3", scheme=None, mode="tp", size=32)
    with pytest.raises(ValueError, match="needs intermediate/tp = 64 to be a multiple of 128"):
        b.layer_shape(deepseek, cuda)
