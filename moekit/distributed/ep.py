"""Expert parallel MoE: every rank holds whole experts [start, end) and its own tokens
(data-parallel attention style); (token, expert) pairs travel to the rank that owns the expert.

One call of `ep_fused_moe`, on every rank of the group:
  1. plan     each (token, j) pair's destination = the owner of expert topk_ids[token, j]; pairs
              are ordered by destination (stable: within a destination, in token-major, j-minor
              order) and counted.
  2. counts   all_to_all_single of the [world] pair counts: each rank learns how many rows it
              will receive from every other rank.
  3. dispatch all_to_all_single of the rows, with those split sizes. A row is one pair packed in
              bytes: [local expert id int32 | routing weight float32 | x row (x's dtype), padded
              to 8 bytes], so ids, weights and activations travel in ONE collective.
  4. experts  fused_moe on the received rows with top-k = 1 (the row's local expert and weight),
              any single-device backend.
  5. return   all_to_all_single of the result rows back to where they came from (the inverse
              split sizes), in x's dtype.
  6. combine  each token's k rows are summed in float32 in j order (0, 1, ..., k-1), never in
              arrival order, and rounded once to x's dtype: deterministic, and the same on any
              world size.

The routing weight is applied REMOTELY, by the destination's fused_moe (in the GEMM2 epilogue of
the fused backends), so the combine is a plain sum. It costs 4 bytes per row on the wire (a row
is 2*H bytes of bf16); in exchange the backends' fused weight epilogue does the multiply, and
`apply_router_weight_on_input` (Llama-4: the weight scales the expert's input) works unchanged.

Host synchronisation: all_to_all_single with uneven splits needs the split sizes on the host, so
step 2 ends with a .tolist() of the received counts (a device-to-host sync per call; the counts
themselves are made without one). That is accepted here: the layer is not CUDA-graph capturable
under expert parallelism (a fixed-capacity dispatch, padding every rank's buffer to a worst case,
would be).

Bad input on one rank: each rank's tokens are its own, so a bad input (an id out of range, a
wrong shape, another rank's shard, a corrupt weight scale loaded on one rank) is usually on one
rank only. Every rank checks its inputs before any collective (fused_moe's checks, its pending
check of the scales' values included) and still takes part in step 2, sending a failure flag
beside its counts: then every rank raises (the failing one its own error, the others a
RuntimeError naming it) instead of some waiting in the dispatch for the group's timeout. The same
integer carries the layout of the rank's rows (x's dtype and H: bf16 on one rank and float32 on
another are both valid, but their rows differ in bytes): where the ranks differ, every rank raises
a ValueError naming each rank's. (Ids on a GPU are checked by a device-side assertion, which stops
that rank's CUDA context instead. A failure inside the local fused_moe, after the dispatch, such
as running out of memory, is not exchanged: the other ranks then wait in step 5.)

What is and is not the single-process result (same backend, full weights):
  - For the schemes whose activation quantization is per row (bf16, fp8-tensor-static,
    fp8-channel-token, fp8-block128) a pair's expert output does not depend on the other rows in
    the batch, so EP computes each pair exactly as `fused_moe(x, weights, w[:, j:j+1], ids[:, j:j+1])`
    would. The only difference from the single-process layer is the combine: single-process
    sums the k float32 pair results and rounds once; EP receives each pair already rounded to x's
    dtype (fused_moe returns x's dtype), then sums in float32 and rounds: k extra roundings of
    2^-8 relative (bf16) each. With float32 activations there is no such rounding, and with
    top-1 or top-2 (a + b = b + a; with k > 2 the order of the sum could show) EP is bitwise the
    single-process layer WHERE the backend gives an expert's rows the same bits in both: the
    destination runs the same rows of each expert in the same order, but at another offset of
    its buffers. The reference backend gathers each expert's rows into a tensor of their own
    (bitwise on the CPU: tested); the torch backend's per-expert GEMM reads them in place, and a
    float32 GEMM's last bits can depend on the rows' memory alignment (on the CPU with H = 65, a
    row of 260 bytes: ~1e-7 relative; with H = 128 bitwise). GPU backends: not tested.
  - fp8-tensor-dynamic computes ONE activation scale per fused_moe call: EP computes it per
    destination rank over the rows it received (x rows and intermediates), single-process over
    the whole batch. The destination's amax is <= the whole batch's, so quantization is at least
    as fine, but not the same: EP differs from single-process by FP8 quantization noise.

Expert placement (`expert_partition`): contiguous ranges; with E = q * world + r, ranks 0..r-1 own
q + 1 experts and the others q (E=5 over 2 ranks: [0, 3), [3, 5); over 3: [0, 2), [2, 4), [4, 5)).
Every rank must own at least one expert (E >= world size).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..api import check_flags, fused_moe, grads_would_be_dropped, validate_inputs
from ..dtypes import FUSED_MOE_DTYPES, check_fused_moe_dtype
from ..select import select_backend
from ..weights import MoEWeights, Shard
from .checks import as_count, check_rank, check_shard, check_whole, own_copy
from .launch import group_device

_META_BYTES = 8  # int32 local expert id + float32 routing weight, at the front of each row


def expert_partition(num_experts: int, world_size: int) -> list[tuple[int, int]]:
    """[(start, end)] of every rank: contiguous, the first num_experts % world_size ranks one more."""
    _, world_size = check_rank(0, world_size)
    num_experts = as_count("num_experts", num_experts)
    if num_experts < world_size:
        raise ValueError(
            f"expert parallel needs at least one expert per rank: num_experts={num_experts!r}, "
            f"world_size={world_size}"
        )
    q, r = divmod(num_experts, world_size)
    bounds = [rank * q + min(rank, r) for rank in range(world_size + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(world_size)]


def expert_range(num_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, end): the experts rank `rank` owns (see expert_partition)."""
    rank, world_size = check_rank(rank, world_size)
    return expert_partition(num_experts, world_size)[rank]


def shard_weights_ep(weights: MoEWeights, rank: int, world_size: int) -> MoEWeights:
    """Rank `rank`'s experts [start, end) of `weights` (all their scales sliced alike; static
    activation scales replicated). Contiguous copies: the full weights can be freed afterwards.
    Tagged (`MoEWeights.shard`) with the rank, the world size and E, which ep_fused_moe checks."""
    check_whole(weights)
    rank, world_size = check_rank(rank, world_size)
    start, end = expert_range(weights.num_experts, rank, world_size)
    kw = {}
    for name, t in weights.tensors().items():
        per_expert = name in ("w13", "w2", "w13_scale", "w2_scale")  # a13/a2 are not per expert
        # clone, not .contiguous(): a slice of dim 0 is contiguous already, and .contiguous() would
        # return that view, keeping the whole layer's storage alive (and saved by state_dict)
        kw[name] = own_copy(t[start:end] if per_expert else t)
    return MoEWeights(weights.scheme, **kw, shard=Shard("ep", rank, world_size, weights.num_experts))


def _check_inputs(x, local_weights, topk_weights, topk_ids, num_experts, rank, world, apply_on_input):
    """Everything fused_moe would refuse on the received rows is refused here, before the first
    collective (the module docstring: how the other ranks learn of it): its validate_inputs
    against the model's num_experts (GPU ids: a device-side assertion, no host sync), the shard,
    top-k = 1 under apply_router_weight_on_input, and the scales' values where their check is
    pending (MoEWeights.check_scale_values: a MoELayer's weights after a load). Returns topk_weights and topk_ids as
    validate_inputs does (float32, int32)."""
    start, end = expert_range(num_experts, rank, world)
    topk_weights, topk_ids = validate_inputs(x, local_weights, topk_weights, topk_ids, num_experts=num_experts)
    check_shard(local_weights, "ep", rank, world)
    if local_weights.shard is not None and local_weights.shard.whole != num_experts:
        raise ValueError(
            f"local_weights are a shard of a layer of {local_weights.shard.whole} experts, but num_experts={num_experts}"
        )
    if local_weights.num_experts != end - start:
        raise ValueError(
            f"rank {rank} of {world} owns experts [{start}, {end}) of {num_experts}, but local_weights "
            f"holds {local_weights.num_experts} experts (use shard_weights_ep)"
        )
    if apply_on_input and topk_ids.shape[1] != 1:
        raise ValueError(f"apply_router_weight_on_input needs top-k = 1, got top-k = {topk_ids.shape[1]}")
    if local_weights.scale_values_pending:  # fused_moe's check (a layer's first call after a load), made here
        local_weights.check_scale_values()  # instead of after the dispatch; no cost once it has run
    return topk_weights, topk_ids


def _byte_view(buf: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """Columns [lo, hi) of a [rows, row_bytes] uint8 buffer seen as `dtype` (no copy)."""
    return buf[:, lo:hi].view(dtype)


def ep_fused_moe(
    x: torch.Tensor,
    local_weights: MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    backend: str | None = "auto",
    *,
    apply_router_weight_on_input: bool = False,
    allow_weight_copies: bool = True,
) -> torch.Tensor:
    """The MoE layer under expert parallelism (see the module docstring for the steps).

    x [M, H]: THIS rank's tokens (M may differ between ranks, and may be 0); topk_weights and
    topk_ids [M, K]: their routing, with GLOBAL expert ids in [0, num_experts). local_weights:
    this rank's experts (`shard_weights_ep(weights, rank, world)`). Returns [M, H] in x's dtype:
    the layer's output for this rank's tokens. `backend`: the single-device backend of the local
    experts. A collective: every rank of `group` must call it, also with M = 0.
    `allow_weight_copies` as for fused_moe (a MoELayer passes False: auto keeps no converted copy).
    """
    if grads_would_be_dropped(x, local_weights, topk_weights):
        with torch.no_grad():  # once: the call below sees grad off
            return ep_fused_moe(x, local_weights, topk_weights, topk_ids, num_experts, group, backend,
                                apply_router_weight_on_input=apply_router_weight_on_input,
                                allow_weight_copies=allow_weight_copies)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    try:
        # the flags too: refused by fused_moe only after the dispatch, they left the other ranks waiting
        apply_router_weight_on_input, allow_weight_copies = check_flags(apply_router_weight_on_input,
                                                                        allow_weight_copies)
        topk_weights, topk_ids = _check_inputs(x, local_weights, topk_weights, topk_ids, num_experts, rank, world,
                                               apply_router_weight_on_input)
        # the local backend, chosen now for the rows this rank sends (a named backend that cannot
        # run, a bad environment variable): an error after the dispatch began would leave the
        # other ranks waiting in it
        select_backend(local_weights.shape(1), local_weights.scheme, x.device, x.dtype, max(topk_ids.numel(), 1),
                       backend, allow_weight_copies=allow_weight_copies)
    except Exception as error:  # noqa: BLE001 - re-raised once the other ranks know (module docstring)
        zeros = torch.zeros(world, dtype=torch.long, device=_flag_device(x, local_weights, group))
        _exchange_counts(zeros, group, failed=error)
        raise
    M, K = topk_ids.shape
    H = x.shape[1]

    # 1. plan, 2. counts (host sync; every rank raises here if one failed its checks, or if the
    # ranks' rows differ in layout)
    flat_ids, dest, order, send_counts, starts = _plan(topk_ids, num_experts, world)
    send_splits, recv_splits = _exchange_counts(send_counts, group, x.dtype, H)

    # 3. dispatch: pack [local id | weight | x row] per pair, in destination order.
    row_bytes, x_bytes = _row_bytes(H, x.dtype)
    send = torch.empty(M * K, row_bytes, dtype=torch.uint8, device=x.device)
    _byte_view(send, 0, 4, torch.int32)[:, 0] = flat_ids[order] - starts[dest[order]]
    _byte_view(send, 4, 8, torch.float32)[:, 0] = topk_weights.reshape(-1).float()[order]
    _byte_view(send, 8, 8 + x_bytes, x.dtype).copy_(x[order // K])
    recv = torch.empty(sum(recv_splits), row_bytes, dtype=torch.uint8, device=x.device)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)

    # 4. experts: top-1 per received row; the destination applies the routing weight.
    y = fused_moe(
        _byte_view(recv, 8, 8 + x_bytes, x.dtype).contiguous(),
        local_weights,
        _byte_view(recv, 4, 8, torch.float32).contiguous(),
        _byte_view(recv, 0, 4, torch.int32).contiguous(),
        backend,
        apply_router_weight_on_input=apply_router_weight_on_input,
        allow_weight_copies=allow_weight_copies,
    )

    # 5. return the results to where the rows came from (the inverse splits).
    back = torch.empty(M * K, H, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(back, y.contiguous(), send_splits, recv_splits, group=group)

    # 6. combine in j order, in float32, one rounding at the end.
    pairs = torch.empty_like(back).index_copy_(0, order, back).view(M, K, H)
    out = pairs[:, 0].to(torch.float32, copy=True)
    for j in range(1, K):
        out += pairs[:, j]
    return out.to(x.dtype)


def _plan(topk_ids: torch.Tensor, num_experts: int, world: int):
    """(flat_ids, dest, order, send_counts, starts): every pair's destination rank, the pairs
    ordered by destination (a stable sort keeps each destination's pairs in token-major, j-minor
    order), the number of pairs for each rank, and each rank's first expert."""
    starts, ends = _bounds(num_experts, world, topk_ids.device)
    flat_ids = topk_ids.reshape(-1).long()
    dest = torch.bucketize(flat_ids, ends, right=True)  # the first range whose end > id
    order = torch.argsort(dest, stable=True)
    # counted by an integer scatter-add (exact in any order); torch.bincount would read the
    # ids' min and max on the host first (two device-to-host syncs on CUDA)
    counts = torch.zeros(world, dtype=torch.long, device=dest.device).scatter_add_(0, dest, torch.ones_like(dest))
    return flat_ids, dest, order, counts, starts


@functools.lru_cache(maxsize=64)
def _bounds(num_experts: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's first expert and end, as tensors on `device` (built once: no copy per call)."""
    partition = expert_partition(num_experts, world)
    return (
        torch.tensor([s for s, _ in partition], device=device),
        torch.tensor([e for _, e in partition], device=device),
    )


def _flag_device(x, local_weights, group) -> torch.device:
    """Where a rank that failed its checks puts its (zero) counts: where the other ranks' counts
    are, the device of their data (their ids, checked to be on the weights' device), so the
    weights' device, else x's. Not the group's backend name: a group made without one reads
    'undefined', one of several backends 'cpu:gloo,cuda:nccl' (launch.group_device: for a rank
    whose arguments hold no tensor at all)."""
    if isinstance(local_weights, MoEWeights):
        return local_weights.device
    if isinstance(x, torch.Tensor):
        return x.device
    return group_device(group)


# x's dtypes, numbered for the count exchange (dtypes.FUSED_MOE_DTYPES: what validate_inputs lets through)
def _rank_word(failed: bool, x_dtype: torch.dtype | None, hidden: int) -> int:
    """What a rank sends beside its counts, in one integer (one fill: no extra collective, no
    host-to-device copy): 1 where it failed its checks, else its rows' layout, 2 * (H * n + the
    index of x's dtype in FUSED_MOE_DTYPES) (n = len(FUSED_MOE_DTYPES)). A row's bytes follow from x's dtype and
    H, which each rank has checked against its own weights only: ranks that differ would take
    different byte counts to the dispatch (gloo aborts the process, NCCL hangs or misreads)."""
    return 1 if failed else 2 * (hidden * len(FUSED_MOE_DTYPES) + FUSED_MOE_DTYPES.index(x_dtype))


def _layout(word: int) -> str:
    """The row layout a _rank_word says, in words."""
    hidden, code = divmod(word // 2, len(FUSED_MOE_DTYPES))
    return f"{FUSED_MOE_DTYPES[code]}, H = {hidden}"


def _exchange_counts(send_counts: torch.Tensor, group, x_dtype: torch.dtype | None = None, hidden: int = 0,
                     failed: Exception | None = None) -> tuple[list[int], list[int]]:
    """all_to_all_single of the per-rank pair counts, each beside this rank's word (_rank_word: a
    flag saying whether it failed its checks, `failed`, then the counts are zeros and the caller
    re-raises its error; else its rows' layout). Raises RuntimeError where another rank failed,
    else ValueError on every rank where the ranks' layouts differ. The .tolist() is the
    device-to-host sync that all_to_all_single's uneven split sizes need (accepted: see the
    module docstring)."""
    word = torch.full_like(send_counts, _rank_word(failed is not None, x_dtype, hidden))
    send = torch.stack([send_counts, word], dim=1)  # row r goes to rank r
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    received = recv.tolist()
    failed_ranks = [source for source, (_, word) in enumerate(received) if word & 1]
    if failed is not None:
        return [], []
    if failed_ranks:
        raise RuntimeError(
            f"ep_fused_moe: rank(s) {failed_ranks} of the process group refused their inputs (their own error "
            f"says why); no rank ran the layer"
        )
    if len({word for _, word in received}) > 1:
        ranks = "; ".join(f"rank {source}: {_layout(word)}" for source, (_, word) in enumerate(received))
        raise ValueError(
            f"ep_fused_moe: the ranks' x differ in dtype or hidden size ({ranks}); every rank of the group "
            f"must pass x of one dtype and size (the dispatched rows are x's bytes); no rank ran the layer"
        )
    return send_counts.tolist(), [count for count, _ in received]


def _row_bytes(H: int, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of a dispatched row, bytes of its x part): rows padded to 8-byte multiples so that
    every field can be viewed in place."""
    x_bytes = H * torch.empty(0, dtype=dtype).element_size()
    return _META_BYTES + -(-x_bytes // 8) * 8, x_bytes


def ep_comm_only(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, group=None):
    """For benchmarks: a callable running only the collectives of one `ep_fused_moe` call with
    these inputs (count exchange with its host sync, dispatch, return), on buffers of the same
    sizes; no packing, no experts, no combine. A collective: call it on every rank."""
    check_fused_moe_dtype(x.dtype, "x has dtype")  # as ep_fused_moe: the count exchange encodes it
    world = dist.get_world_size(group)
    M, K = topk_ids.shape
    send_counts = _plan(topk_ids, num_experts, world)[3]
    send_splits, recv_splits = _exchange_counts(send_counts, group, x.dtype, x.shape[1])
    row_bytes, _ = _row_bytes(x.shape[1], x.dtype)
    send = torch.zeros(M * K, row_bytes, dtype=torch.uint8, device=x.device)
    recv = torch.empty(sum(recv_splits), row_bytes, dtype=torch.uint8, device=x.device)
    y = torch.zeros(sum(recv_splits), x.shape[1], dtype=x.dtype, device=x.device)
    back = torch.empty(M * K, x.shape[1], dtype=x.dtype, device=x.device)

    def run() -> None:
        _exchange_counts(send_counts, group, x.dtype, x.shape[1])
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
        dist.all_to_all_single(back, y, send_splits, recv_splits, group=group)

    return run
