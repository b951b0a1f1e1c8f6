"""The MoE glue around two grouped GEMMs, shared by the `cutlass` and `torch` backends.

    a, a_scale, layout = permute(x, topk_ids, E, quant=...)   # rows sorted by expert (+ FP8)
    h = grouped_gemm(a, w13, offs=layout.offs)               # [R, 2N], by the backend
    act, act_scale = silu_mul(h, layout, act_dtype=x.dtype, quant=...)
    y = grouped_gemm(act, w2, offs=layout.offs)              # [R, H], by the backend
    out = combine(y, layout, topk_weights, out_dtype=x.dtype)

Layout of the permuted buffers (R rows): expert e owns rows [starts[e], offs[e]); its first
counts[e] rows hold its (token, expert) pairs in pair order p = t*K + j (stable, deterministic),
the rest are padding up to a multiple of `align` rows (never written, never read back: each GEMM
output row depends on its input row only). `offs` is the int32 cumulative END of each group, the
`offs` of torch's grouped GEMMs. R = M*K + min(E, M*K) * (align - 1) bounds every routing, so no
size depends on the routing: no host synchronisation, and the calls capture into CUDA graphs.

Two implementations, chosen by `impl`:
  "triton": the kernels of `_kernels.py` (GPU; on the CPU only under TRITON_INTERPRET=1).
      route = 2 launches (per-chunk ranks, then one scan), permute 1 (+1 for a dynamic per-tensor
      scale), silu_mul 1 (+1), combine 1. Expert counts and offsets stay on the GPU.
  "torch": a few torch ops (argsort-based), for the CPU. Same layout, same results (the SiLU's exp
      may differ in the last float32 bit, so the rounded intermediate very rarely differs by one unit).
The default (`impl=None`) is "triton" on CUDA or under the interpreter, else "torch".

Quantization (`quant`): None, "token" (one scale per row) or "tensor" (one scale for all rows:
`static_scale` if given, else dynamic: ONE amax over all M rows of x, or over all M*K rows of the
intermediate). Formulas are exactly moekit.quant's: scale = max(amax, 1e-10) / 448,
q = clamp(x / scale, -448, 448) rounded to float8_e4m3fn. Per-tensor scales are written out per
row (`a_scale[r]` is the same for every r), the form a row-wise scaled GEMM takes.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ... import env
from ... import quant as _quant
from ..compile_only import launch  # kernel[grid](...), or its compilation alone under compile_only()
from ..sizes import cdiv, next_pow2
from ..triton_options import ASSERT_OPTIONS, compile_options

ALIGN_M = 16  # rows per expert group: a multiple of this (older torch grouped GEMMs assert it; 16-row
# groups also keep every group's A rows and row scales 16-byte aligned for the GEMM's TMA loads)
BLOCK_P = 128  # pairs per chunk of the route kernels
SCAN_TILE = 4096  # elements of the [chunks, experts] tile the scan kernel reads at a time
IMPLS = ("triton", "torch")

_QUANT_NONE, _QUANT_ROW, _QUANT_STATIC, _QUANT_DYNAMIC = 0, 1, 2, 3


@dataclasses.dataclass
class Layout:
    """Where each (token, expert) pair lives in the permuted buffers (see the module docstring)."""

    row_of_pair: torch.Tensor  # int32 [M*K]: row holding pair p = t*K + j
    offs: torch.Tensor  # int32 [E]: cumulative END row of each expert's (padded) group
    counts: torch.Tensor  # int32 [E]: pairs routed to each expert
    num_rows: int  # R, rows of the permuted buffers
    num_tokens: int  # M
    top_k: int  # K
    align: int
    impl: str
    amax: torch.Tensor | None = None  # float32 [2] scratch of the triton impl (dynamic per-tensor amax)
    act_amax_fresh: bool = True  # amax[1] still holds the zero the route kernels wrote

    @property
    def num_experts(self) -> int:
        return self.offs.numel()

    @property
    def starts(self) -> torch.Tensor:
        """int32 [E]: first row of each expert's group."""
        padded = (self.counts + (self.align - 1)) // self.align * self.align
        return (self.offs - padded).to(torch.int32)


def num_permuted_rows(num_pairs: int, num_experts: int, align: int = ALIGN_M) -> int:
    """R: rows enough for any routing of `num_pairs` pairs with groups padded to `align` rows."""
    return num_pairs + min(num_experts, num_pairs) * (align - 1)


def on_device(device: torch.device):
    """torch.cuda.device(device) where `device` is a GPU other than the current one, else a no-op.
    Triton launches a kernel on the current GPU and its stream, whatever device the tensors are on
    (its JIT asks the driver for the current device): a layer whose tensors are on cuda:1, called
    while cuda:0 is current (a model spread over GPUs with device_map="auto"), would launch its
    kernels on cuda:0 with cuda:1's pointers, unordered with the torch ops on cuda:1's stream."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def interpreting() -> bool:
    """TRITON_INTERPRET as every part of moekit reads it (moekit.env.interpreting)."""
    return env.interpreting()


def unavailable_on(device) -> str | None:
    """Why the glue cannot run on `device` now (None: it can): on a GPU its Triton kernels, where
    TRITON_INTERPRET was turned on after moekit defined them for the GPU (env.interpreter_set_late:
    every launch would raise it). On the CPU the glue is torch ops, not affected. For the
    supports() of the backends that launch it."""
    late = env.interpreter_set_late()
    if late is None or torch.device(device).type != "cuda":
        return None
    return f"its glue's Triton kernels cannot run: {late}"


def _options() -> dict:
    """Compile options of a glue kernel's launch (moekit.backends.triton_options: FP fusion)."""
    return compile_options(interpreting())


def _check_options() -> dict:
    """Compile options of the kernel that checks the expert ids (_rank_kernel's CHECK_IDS): Triton's
    `debug`, which compiles device_assert in; none under the interpreter (tests set its own)."""
    return {} if interpreting() else dict(ASSERT_OPTIONS)


def default_impl(device: torch.device) -> str:
    return "triton" if device.type == "cuda" or interpreting() else "torch"


def _resolve(impl: str | None, device: torch.device) -> str:
    impl = impl or default_impl(device)
    if impl not in IMPLS:
        raise ValueError(f"unknown glue impl {impl!r}; expected one of {IMPLS}")
    if impl == "triton" and device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"the triton glue needs a CUDA device (or TRITON_INTERPRET=1), got {device}; use impl='torch'"
        )
    return impl


def _quant_mode(quant: str | None, static_scale: torch.Tensor | None) -> int:
    if quant is None:
        if static_scale is not None:
            raise ValueError("static_scale given without quant='tensor'")
        return _QUANT_NONE
    if quant == "token":
        if static_scale is not None:
            raise ValueError("static scales exist only per tensor, not per token")
        return _QUANT_ROW
    if quant == "tensor":
        return _QUANT_DYNAMIC if static_scale is None else _QUANT_STATIC
    raise ValueError(f"unknown activation quantization {quant!r}; expected None, 'token' or 'tensor'")


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


# ------------------------------------------------------------------------------------ permute


def permute(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    align: int = ALIGN_M,
    quant: str | None = None,
    static_scale: torch.Tensor | None = None,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, Layout]:
    """Sort the (token, expert) pairs by expert and gather their rows of x.

    x [M, H]; topk_ids [M, K] int32/int64 in [0, E). Returns
      a [R, H]: x's dtype, or float8_e4m3fn when `quant` is given;
      a_scale float32 [R] (None without `quant`): dequantization scale of each row;
      layout: where each pair's row is, and the expert offsets.
    """
    mode = _quant_mode(quant, static_scale)
    impl = _resolve(impl, x.device)
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"permute needs x [M, H] and topk_ids [M, K], got {tuple(x.shape)}, {tuple(topk_ids.shape)}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    M, H = x.shape
    K = topk_ids.shape[1]
    P = M * K
    R = num_permuted_rows(P, num_experts, align)
    dev = x.device
    a_dtype = x.dtype if mode == _QUANT_NONE else _quant.FP8_DTYPE
    a = torch.empty(R, H, dtype=a_dtype, device=dev)
    a_scale = None if mode == _QUANT_NONE else torch.empty(R, dtype=torch.float32, device=dev)
    if static_scale is not None:
        static_scale = static_scale.reshape(1).to(device=dev, dtype=torch.float32)
    if P == 0:
        z = torch.zeros(num_experts, dtype=torch.int32, device=dev)
        empty = torch.empty(0, dtype=torch.int32, device=dev)
        amax = torch.zeros(2, dtype=torch.float32, device=dev)
        return a, a_scale, Layout(empty, z, z.clone(), R, M, K, align, impl, amax)
    if impl == "torch":
        return _permute_torch(x, topk_ids, num_experts, align, mode, static_scale, a, a_scale)
    return _permute_triton(x, topk_ids, num_experts, align, mode, static_scale, a, a_scale)


def _permute_triton(x, topk_ids, E, align, mode, static_scale, a, a_scale):
    from . import _kernels as k

    M, H = x.shape
    K = topk_ids.shape[1]
    P = M * K
    dev = x.device
    if x.stride(1) != 1:
        x = x.contiguous()
    # int32 or int64: the kernels read either, checked in their own dtype; read as ids_ptr + pair, so
    # a strided view (a column slice of a router's ids) is copied first
    ids = topk_ids.contiguous().view(-1)
    C = cdiv(P, BLOCK_P)
    block_e = max(2, next_pow2(E))
    local_rank = torch.empty(P, dtype=torch.int32, device=dev)
    chunk_base = torch.empty(C, E, dtype=torch.int32, device=dev)
    ints = torch.empty(3, E, dtype=torch.int32, device=dev)
    counts, offs, starts = ints[0], ints[1], ints[2]
    amax = torch.empty(2, dtype=torch.float32, device=dev)
    row_of_pair = torch.empty(P, dtype=torch.int32, device=dev)

    launch(k._rank_kernel, (C,), ids, local_rank, chunk_base, P, E, BLOCK_P=BLOCK_P, BLOCK_E=block_e, CHECK_IDS=True,
           **_options(), **_check_options())
    launch(k._scan_kernel, (1,),
        chunk_base, counts, offs, starts, amax, C, E,
        ALIGN=align, BLOCK_C=max(2, SCAN_TILE // block_e), BLOCK_E=block_e, **_options(),
    )
    block_k = max(2, next_pow2(K))
    if mode == _QUANT_DYNAMIC:
        launch(k._row_amax_kernel, (M,), x, amax, H, x.stride(0), BLOCK_H=min(next_pow2(H), 2048), **_options())
    scale_src = static_scale if mode == _QUANT_STATIC else amax
    launch(k._permute_kernel, (M,),
        x, ids, local_rank, chunk_base, starts, row_of_pair,
        a, a_scale if a_scale is not None else amax, scale_src,
        H, K, E, x.stride(0), a.stride(0),
        QUANT=mode, BLOCK_P=BLOCK_P, BLOCK_K=block_k,
        BLOCK_H=max(16, min(next_pow2(H), 4096 // block_k, 2048)), **_options(),
    )
    layout = Layout(row_of_pair, offs, counts, a.shape[0], M, K, align, "triton", amax)
    return a, a_scale, layout


def _torch_route(ids: torch.Tensor, E: int, align: int):
    """(row_of_pair int64 [P], counts int64 [E], offs int64 [E]) in the layout of the module docstring."""
    P = ids.numel()
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=E)
    padded = (counts + (align - 1)) // align * align
    ends = torch.cumsum(padded, 0)
    first_sorted = torch.cumsum(counts, 0) - counts
    sorted_ids = ids[order]
    rank = torch.arange(P, device=ids.device) - first_sorted[sorted_ids]
    row_of_pair = torch.empty_like(ids)
    row_of_pair[order] = (ends - padded)[sorted_ids] + rank
    return row_of_pair, counts, ends


def _scatter_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """dst[rows] = src, for any dtype (index_put is not implemented for FP8 everywhere)."""
    if dst.dtype == _quant.FP8_DTYPE:
        dst.view(torch.uint8)[rows] = src.view(torch.uint8)
    else:
        dst[rows] = src


def _permute_torch(x, topk_ids, E, align, mode, static_scale, a, a_scale):
    M = x.shape[0]
    K = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    row_of_pair, counts, offs = _torch_route(ids, E, align)
    token = torch.arange(M * K, device=x.device) // K
    if mode == _QUANT_NONE:
        _scatter_rows(a, row_of_pair, x[token])
    else:
        granularity = "token" if mode == _QUANT_ROW else "tensor"
        q, s = _quant.quantize_activation(x, granularity, static_scale)
        _scatter_rows(a, row_of_pair, q.view(torch.uint8)[token].view(_quant.FP8_DTYPE))
        a_scale[row_of_pair] = s[token] if mode == _QUANT_ROW else s.expand(M * K)
    layout = Layout(
        row_of_pair.to(torch.int32), offs.to(torch.int32), counts.to(torch.int32),
        a.shape[0], M, K, align, "torch",
    )
    return a, a_scale, layout


# ----------------------------------------------------------------------------------- silu_mul


def silu_mul(
    h: torch.Tensor,
    layout: Layout,
    *,
    act_dtype: torch.dtype,
    quant: str | None = None,
    static_scale: torch.Tensor | None = None,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """act = SiLU(gate) * up of every pair's row, in float32, rounded to `act_dtype` (the
    activations' dtype), then quantized per `quant` (the scheme's activation rule).

    h [R, 2N] (gate columns, then up columns; any row stride). Returns act [R, N] (act_dtype, or
    float8_e4m3fn with `quant`) and act_scale float32 [R] (None without `quant`). Only the rows
    of pairs are written; a dynamic per-tensor scale is ONE amax over all M*K pair rows.
    """
    mode = _quant_mode(quant, static_scale)
    impl = _resolve(impl or layout.impl, h.device)
    R, two_n = h.shape
    if two_n % 2 or R != layout.num_rows:
        raise ValueError(f"silu_mul needs h [R={layout.num_rows}, 2N], got {tuple(h.shape)}")
    N = two_n // 2
    dev = h.device
    out_dtype = act_dtype if mode == _QUANT_NONE else _quant.FP8_DTYPE
    act = torch.empty(R, N, dtype=out_dtype, device=dev)
    act_scale = None if mode == _QUANT_NONE else torch.empty(R, dtype=torch.float32, device=dev)
    if static_scale is not None:
        static_scale = static_scale.reshape(1).to(device=dev, dtype=torch.float32)
    P = layout.row_of_pair.numel()
    if P == 0:
        return act, act_scale
    if impl == "torch":
        rows = layout.row_of_pair.long()
        hv = h[rows].float()
        val = (torch.nn.functional.silu(hv[:, :N]) * hv[:, N:]).to(act_dtype)
        if mode == _QUANT_NONE:
            act[rows] = val
        else:
            granularity = "token" if mode == _QUANT_ROW else "tensor"
            q, s = _quant.quantize_activation(val, granularity, static_scale)
            _scatter_rows(act, rows, q)
            act_scale[rows] = s if mode == _QUANT_ROW else s.expand(P)
        return act, act_scale

    from . import _kernels as k

    if h.stride(1) != 1:
        h = h.contiguous()
    amax = layout.amax
    if amax is None:  # a layout built by the torch impl
        amax = torch.zeros(2, dtype=torch.float32, device=dev)
    act_amax = amax[1:]
    block_n = min(next_pow2(N), 1024)
    tl_act = _tl_dtype(act_dtype)
    if mode == _QUANT_DYNAMIC:
        if not layout.act_amax_fresh:  # a second dynamic call on this layout: reset the running max
            act_amax.zero_()
        layout.act_amax_fresh = False
        launch(k._silu_amax_kernel, (P,),
            h, layout.row_of_pair, act_amax, N, h.stride(0), ACT_DTYPE=tl_act, BLOCK_N=block_n, **_options()
        )
    launch(k._silu_mul_kernel, (P,),
        h, layout.row_of_pair, act, act_scale if act_scale is not None else amax,
        static_scale if mode == _QUANT_STATIC else act_amax,
        N, h.stride(0), act.stride(0),
        QUANT=mode, ACT_DTYPE=tl_act, BLOCK_N=block_n, **_options(),
    )
    return act, act_scale


# ------------------------------------------------------------------------------------ combine


def combine(
    y: torch.Tensor,
    layout: Layout,
    topk_weights: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    impl: str | None = None,
) -> torch.Tensor:
    """out[t] = sum over j = 0..K-1, in that order, of topk_weights[t, j] * y[row of pair t*K+j],
    in float32, then cast to `out_dtype`. No atomics: bitwise deterministic.

    y [R, H] (any row stride); topk_weights [M, K]. Returns out [M, H].
    """
    impl = _resolve(impl or layout.impl, y.device)
    M, K = layout.num_tokens, layout.top_k
    if tuple(topk_weights.shape) != (M, K) or y.shape[0] != layout.num_rows:
        raise ValueError(
            f"combine needs y [R={layout.num_rows}, H] and topk_weights [{M}, {K}], "
            f"got {tuple(y.shape)} and {tuple(topk_weights.shape)}"
        )
    H = y.shape[1]
    out = torch.empty(M, H, dtype=out_dtype, device=y.device)
    if M == 0:
        return out
    w = topk_weights.to(torch.float32).contiguous()
    if impl == "torch":
        yv = y[layout.row_of_pair.long()].float().view(M, K, H)
        acc = torch.zeros(M, H, dtype=torch.float32, device=y.device)
        for j in range(K):
            acc += w[:, j, None] * yv[:, j]
        return out.copy_(acc)

    from . import _kernels as k

    if y.stride(1) != 1:
        y = y.contiguous()
    block_h = min(next_pow2(H), 1024)
    launch(k._combine_kernel, (M, cdiv(H, block_h)),
        y, layout.row_of_pair, w, out, H, K, y.stride(0), out.stride(0), BLOCK_H=block_h, **_options()
    )
    return out


# ---------------------------------------------------------------------------------- input check

IDS_CHECK_BLOCK = 1024  # ids per step (one program) or per program (several)
IDS_ONE_PROGRAM_MAX = 4 * IDS_CHECK_BLOCK  # beyond this many ids, one program per block


def ids_in_range(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A one-element int32 tensor on topk_ids' device: 1 if every id lies in [0, num_experts),
    else 0, computed on the device (no host synchronisation; fused_moe asserts on it with
    torch._assert_async). Up to IDS_ONE_PROGRAM_MAX ids, the decode sizes, one launch; beyond,
    a fill and one program per block, so that the check does not become a serial loop at prefill.
    Needs CUDA or TRITON_INTERPRET=1, like the triton glue."""
    from . import _kernels as k

    ids = topk_ids.contiguous()
    P = ids.numel()
    one = P <= IDS_ONE_PROGRAM_MAX
    ok = torch.empty(1, dtype=torch.int32, device=ids.device) if one else torch.ones(1, dtype=torch.int32, device=ids.device)
    grid = (1,) if one else (cdiv(P, IDS_CHECK_BLOCK),)
    with on_device(ids.device):
        launch(k._ids_in_range_kernel, grid, ids, ok, P, num_experts, BLOCK=IDS_CHECK_BLOCK, ONE_PROGRAM=one, **_options())
    return ok


NARROW_IDS_BLOCK = 1024  # ids per program


def narrow_ids(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 topk_ids as int32 in one launch, with no host synchronisation: an id outside
    [0, num_experts) becomes -1, so that the device-side range checks after it still see it
    (`.to(torch.int32)` would wrap 2**32 + 3 to expert 3). Same launch count as that cast. Needs
    CUDA or TRITON_INTERPRET=1, like the triton glue."""
    from . import _kernels as k

    ids = topk_ids.contiguous()
    out = torch.empty(ids.shape, dtype=torch.int32, device=ids.device)
    if ids.numel():
        with on_device(ids.device):
            launch(k._narrow_ids_kernel, (cdiv(ids.numel(), NARROW_IDS_BLOCK),),
                   ids, out, ids.numel(), num_experts, BLOCK=NARROW_IDS_BLOCK, **_options())
    return out
