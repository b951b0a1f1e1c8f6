"""Tensor parallel MoE: every rank holds every expert, sliced along the intermediate dimension N.

GEMM1 (x @ w13.T) is column parallel: rank r computes the gate and up columns
[r*N/ws, (r+1)*N/ws) of every expert, so SiLU(gate) * up needs no communication. GEMM2
(act @ w2.T) is row parallel: rank r multiplies its columns of the intermediate by the same
columns of w2 and gets a partial [M, H]; an all-reduce (SUM) of the partials is the output.

What is and is not the single-process result (same backend, full weights):
  - x and the routing are identical on every rank, so x is quantized identically everywhere
    (static, per-tensor dynamic, per-token and per-1x128-group scales of x are all the same).
  - The intermediate SiLU(gate) * up is quantized by each rank over ITS columns only:
      fp8-tensor-static   static scale: identical to single-process.
      fp8-block128        1x128 groups: the shard boundaries are group boundaries (N/ws is a
                          multiple of 128), so every group and its scale are identical.
      fp8-channel-token   one scale per token over the shard's N/ws columns instead of all N.
      fp8-tensor-dynamic  one scale over the shard's [M*K, N/ws] block instead of [M*K, N].
    In the last two the shard's scale is <= the full row's (the amax of a subset), so each
    element is quantized at least as finely as single-process, but NOT to the same value:
    TP differs from single-process by the FP8 quantization noise of the intermediate (a few
    percent of its magnitude at worst per element, averaging out in GEMM2). This is how vLLM and
    SGLang run these schemes too; the exact definition TP implements is
        out = round(sum_r round(fused_moe(x, shard_r)))   (see below for the roundings).
  - Every rank's partial is rounded once to x's dtype (fused_moe returns x's dtype), then the
    partials are summed in float32 and the sum rounded once more to x's dtype.

Why the all-reduce runs in float32 (`reduce_dtype`, default torch.float32):
  - Summing in bf16 would round after every addition, in an order set by the collective's
    algorithm (NCCL's ring reduces each chunk starting at a different rank; tree and ring
    differ), so results would depend on world size, message size and NCCL's choice, and pick
    up ws - 1 extra bf16 roundings (2^-9 relative each).
  - In float32 the sum of ws bf16 values (8 significant bits each) is EXACT as long as they span
    fewer than ~24 - 8 - log2(ws) binades, i.e. practically always: an exact sum does not depend
    on the order, so the output is bitwise the same on every rank, for every algorithm and every
    run, with a single final rounding. The cost is twice the bytes of a bf16 all-reduce
    ([M, H] float32); at decode sizes the all-reduce is latency bound and this costs nothing
    measurable, at prefill sizes pass reduce_dtype=None to reduce in x's dtype instead.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..api import fused_moe
from ..spec import BLOCK
from ..weights import MoEWeights, Shard
from .checks import check_rank, check_shard, check_whole, own_copy


def shard_weights_tp(weights: MoEWeights, rank: int, world_size: int) -> MoEWeights:
    """Rank `rank`'s slice of every expert for tensor parallelism over `world_size` ranks.

    Intermediate columns [rank*n, (rank+1)*n), n = N / world_size:
      w13 [E, 2n, H]: gate rows [rank*n, (rank+1)*n) then up rows [N + rank*n, N + (rank+1)*n)
                      (gate-then-up layout kept within the shard);  w2 [E, H, n]: those columns.
    Scales, by scheme:
      per tensor        w13_scale, w2_scale [E] replicated;
      per channel       w13_scale [E, 2n]: sliced like the rows; w2_scale [E, H] (one per
                        output row of H) replicated;
      128x128 blocks    sliced by whole blocks (n must be a multiple of 128: a block is never split);
      a13/a2 (static)   replicated.
    Returned tensors are contiguous copies: the full weights can be freed afterwards. The result
    is tagged (`MoEWeights.shard`) with the rank, the world size and the whole N, which
    tp_fused_moe checks against its process group.
    """
    check_whole(weights)
    rank, world_size = check_rank(rank, world_size)
    N = weights.n
    if N % world_size:
        raise ValueError(
            f"tensor parallel needs the intermediate size N={N} to be divisible by world_size={world_size}"
        )
    n = N // world_size
    s = weights.scheme
    if s.weight == "block" and n % BLOCK:
        raise ValueError(
            f"scheme {s.name} has 128x128 weight blocks, which must not be split: tensor parallel "
            f"over {world_size} ranks gives N/world_size = {N}/{world_size} = {n} columns per rank, "
            f"not a multiple of {BLOCK} (use a world size that keeps {BLOCK}-multiples per rank)"
        )
    lo, hi = rank * n, (rank + 1) * n

    def rows(t: torch.Tensor, lo: int, hi: int, half: int) -> torch.Tensor:
        """Gate rows [lo, hi) and up rows [half + lo, half + hi) of dim 1, gate first."""
        return torch.cat([t[:, lo:hi], t[:, half + lo : half + hi]], dim=1).contiguous()

    w13 = rows(weights.w13, lo, hi, N)
    w2 = own_copy(weights.w2[:, :, lo:hi])
    kw: dict[str, torch.Tensor] = {}
    if s.is_fp8:
        if s.weight == "tensor":
            kw["w13_scale"], kw["w2_scale"] = own_copy(weights.w13_scale), own_copy(weights.w2_scale)
        elif s.weight == "channel":
            kw["w13_scale"] = rows(weights.w13_scale, lo, hi, N)
            kw["w2_scale"] = own_copy(weights.w2_scale)
        elif s.weight == "block":
            b_lo, b_hi, b_half = lo // BLOCK, hi // BLOCK, N // BLOCK
            kw["w13_scale"] = rows(weights.w13_scale, b_lo, b_hi, b_half)  # [E, 2n/128, ceil(H/128)]
            kw["w2_scale"] = own_copy(weights.w2_scale[:, :, b_lo:b_hi])  # [E, ceil(H/128), n/128]
        else:  # a new weight granularity must say how it shards
            raise NotImplementedError(f"shard_weights_tp does not know weight granularity {s.weight!r}")
        for name in ("a13_scale", "a2_scale"):
            if getattr(weights, name) is not None:
                kw[name] = own_copy(getattr(weights, name))
    return MoEWeights(s, w13, w2, **kw, shard=Shard("tp", rank, world_size, N))


def tp_fused_moe(
    x: torch.Tensor,
    local_weights: MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    backend: str | None = "auto",
    *,
    apply_router_weight_on_input: bool = False,
    reduce_dtype: torch.dtype | None = torch.float32,
    allow_weight_copies: bool = True,
) -> torch.Tensor:
    """The MoE layer under tensor parallelism: `fused_moe` on this rank's shard
    (`shard_weights_tp`), then an all-reduce (SUM) of the partial outputs over `group`.

    Every rank must pass the same x [M, H], topk_weights and topk_ids (the whole batch); every
    rank gets the same output [M, H] in x's dtype. `backend` is the single-device backend of the
    local experts. `reduce_dtype`: the dtype of the all-reduce (float32 by default: exact and
    order-independent, see the module docstring), a floating point dtype; None reduces in x's dtype.
    Weights tagged by shard_weights_tp must be this rank's shard (a ValueError otherwise).
    `allow_weight_copies` as for fused_moe (a MoELayer passes False: auto keeps no converted copy).
    Every rank must call this (it is a collective), also with M = 0.

    Failures: inputs that are wrong alike on every rank (x, the routing, the flags: every rank has
    the same) fail alike, before the all-reduce. Where the weights' scale values are still to be
    checked (MoEWeights.scale_values_pending: a MoELayer's first call after its weights were
    loaded), that check and the shard check run first and the ranks exchange a failure flag (one
    all-reduce of [world] int32, in that call only): a corrupt scale or a wrong shard on one rank
    makes every rank raise (that rank its own error, the others a RuntimeError naming it; a retry
    without reloading exchanges and raises again on every rank, the group stays in step). Any
    other error on one rank alone (a wrong shard of weights already checked, a failure inside the
    local fused_moe such as running out of memory) has no such exchange (it would cost every call
    a collective): that rank raises and the others wait in the all-reduce. If the failing rank
    then exits, they wait until the group's timeout, or until torchrun stops them; if it goes on
    to call the layer again, its next all-reduce pairs with theirs and BOTH calls return wrong
    sums, without an error. After an exception from tp_fused_moe on any rank, do not go on with
    the group: exit (or abort it) on every rank.
    """
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise TypeError(f"reduce_dtype must be a floating point torch.dtype or None, got {reduce_dtype!r}")
    if isinstance(local_weights, MoEWeights):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if world > 1 and (local_weights.scale_values_pending or local_weights in _AGREE_AGAIN):
            _check_weights_together(local_weights, rank, world, group)
        else:
            check_shard(local_weights, "tp", rank, world)
    partial = fused_moe(
        x, local_weights, topk_weights, topk_ids, backend,
        apply_router_weight_on_input=apply_router_weight_on_input, allow_weight_copies=allow_weight_copies,
    )
    if dist.get_world_size(group) == 1:
        return partial
    buf = partial if reduce_dtype is None or reduce_dtype == partial.dtype else partial.to(reduce_dtype)
    # M = 0 still all-reduces (an empty tensor): ranks never skip a collective on a local condition.
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return buf.to(x.dtype)


# Weights whose last flag exchange heard of a failure on another rank: their next call exchanges
# again, as the failing rank's does (its check is still pending), so that a retry of the same call
# pairs the same collectives on every rank (and raises on every rank again).
_AGREE_AGAIN: weakref.WeakSet = weakref.WeakSet()


def _check_weights_together(weights: MoEWeights, rank: int, world: int, group) -> None:
    """The shard and the scales' pending value check of this rank, then a failure flag exchanged
    with every rank (tp_fused_moe's docstring: only where the scale check is pending, so once
    after each load): raises this rank's error, or a RuntimeError naming the ranks that failed.
    The flags live on the weights' device, where the rank's data is (a group made without a
    backend name, or with several, takes its tensors on either). Under CUDA-graph capture or while
    torch.compile traces, check_scale_values reads nothing and leaves the check pending, on every
    rank alike: then nothing is exchanged (fused_moe checks them at a later eager call)."""
    failed = None
    try:
        check_shard(weights, "tp", rank, world)
        weights.check_scale_values()
    except Exception as error:  # noqa: BLE001 - re-raised below, once the other ranks know
        failed = error
    if failed is None and weights.scale_values_pending:  # nothing could be read: nothing to tell
        return
    flags = torch.zeros(world, dtype=torch.int32, device=weights.device)
    flags[rank] = int(failed is not None)
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
    failed_ranks = flags.nonzero().flatten().tolist()
    if failed_ranks:
        _AGREE_AGAIN.add(weights)
    else:
        _AGREE_AGAIN.discard(weights)
    if failed is not None:
        raise failed
    if failed_ranks:
        raise RuntimeError(
            f"tp_fused_moe: rank(s) {failed_ranks} of the process group refused their weights (their own error "
            f"says why); no rank ran the layer"
        )
