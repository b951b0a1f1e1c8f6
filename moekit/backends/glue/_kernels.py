"""Triton kernels of the MoE glue: route, permute (+ quantize), SiLU-and-mul (+ requantize), combine.

Launched by `ops.py`, which documents what each one computes. Shape letters: M tokens, K top-k,
P = M*K (token, expert) pairs, pair p = t*K + j; E experts; H hidden; N intermediate;
R rows of the permuted buffers; C chunks of BLOCK_P pairs.

Rounding is done in float32 arithmetic before each narrowing cast (`_round_bf16`, `_round_e4m3`),
so the cast itself is exact. That gives round-to-nearest-even on every GPU and every Triton
version (whatever path the cast takes), and also under TRITON_INTERPRET=1, whose casts truncate.
Divisions that must match torch bit for bit use `tl.div_rn` (plain `/` is approximate on GPUs).
"""

import triton
import triton.language as tl

# QUANT modes (constexpr), shared with ops.py
# 0: no quantization, 1: per row, 2: per tensor with a static scale, 3: per tensor, dynamic


@triton.jit
def _round_bf16(v):
    """float32 -> the nearest bfloat16 value (ties to even), still as float32; a NaN -> the quiet
    NaN 0x7FC00000, which any bf16 cast keeps (torch's does the same). The rounding's addition
    alone turns the GPU's own NaN, 0x7FFFFFFF, into -0.0 (found on an H200, 2026-12-05: a NaN
    token's output came out finite), and a truncating cast would turn 0x7F800001 into inf."""
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return tl.where(v != v, float("nan"), b.to(tl.float32, bitcast=True))


@triton.jit
def _round_act(v, ACT_DTYPE: tl.constexpr):
    """float32 -> the nearest value of ACT_DTYPE (the activations' dtype), still as float32."""
    out = v  # float32: nothing to round
    if ACT_DTYPE == tl.bfloat16:
        out = _round_bf16(v)
    elif ACT_DTYPE == tl.float16:
        out = v.to(tl.float16).to(tl.float32)
    return out


@triton.jit
def _round_e4m3(v):
    """float32 with |v| <= 448 -> the nearest float8_e4m3fn value (ties to even), as float32.

    Adding then subtracting c = 2**(e - 3 + 23) rounds |v| in [2**e, 2**(e+1)) to a multiple of
    2**(e - 3), the e4m3 spacing there (3 mantissa bits); below 2**-6 e4m3 is subnormal with
    spacing 2**-9, hence e >= -6. The sign bit is copied over (not `-r`: Triton negates as
    0 - r, which turns a value rounded to zero into +0.0 where torch keeps -0.0: found on an
    H200, 2026-12-03, as 80 of 16.8 million FP8 bytes differing from torch's).
    """
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    c = ((e + (20 + 127)) << 23).to(tl.float32, bitcast=True)
    r = (a + c) - c
    sign = bits & -2147483648  # 0x80000000
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _scale_from_amax(amax):
    """moekit.quant.scale_from_amax: max(amax, 1e-10) / 448, IEEE division, a NaN amax kept NaN
    (a GPU's plain max would make it 1e-10, saturating every value to +-448)."""
    return tl.div_rn(tl.maximum(amax, 1e-10, propagate_nan=tl.PropagateNan.ALL), 448.0)


@triton.jit
def _clamp_fp8(q):
    """q clamped to e4m3's range, +-448, a NaN kept NaN (as torch.clamp does). Plain min / max on a
    GPU return the other operand for a NaN, which would quantize it to +-448: a finite value where
    `reference` gives NaN. Elementwise only, so the Gluon kernels run the same code."""
    q = tl.maximum(q, -448.0, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(q, 448.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _magnitude_bits(v):
    """|v| of float32 values as their int32 bits (the sign bit cleared). Non-negative floats order
    as their bits, +inf above every finite value and every NaN above +inf, so an integer maximum
    of these is the float maximum of |v| with a NaN winning, as torch's amax (a GPU's float max
    drops a NaN), and integers compute alike on a GPU and in the CPU interpreter."""
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _atomic_amax(amax_ptr, bits):
    """The float32 at amax_ptr (zeroed before the launch) raised to the magnitude whose
    _magnitude_bits are `bits`, by an integer atomic max: the same result in any order, so
    deterministic, a NaN included."""
    tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), bits)


@triton.jit
def _row_scale(running_amax, scale_ptr, QUANT: tl.constexpr):
    """A row's dequantization scale: from the row's own |max| (QUANT 1, `running_amax` a block of
    running maxima), the static scale (2), or the whole tensor's amax (3) at scale_ptr."""
    if QUANT == 1:
        scale = _scale_from_amax(tl.max(running_amax, axis=0))
    elif QUANT == 2:
        scale = tl.load(scale_ptr)
    else:
        scale = _scale_from_amax(tl.load(scale_ptr))
    return scale


@triton.jit
def _to_e4m3(v, scale):
    """moekit.quant.to_fp8 in float32: clamp(v / scale, -448, 448) rounded to e4m3 (as float32)."""
    return _round_e4m3(_clamp_fp8(tl.div_rn(v, scale)))


# ------------------------------------------------------------------------------------ route


@triton.jit
def _check_expert_ids(ids, valid, E, CHECK_IDS: tl.constexpr):
    """A device-side assertion that every valid id lies in [0, E), in the first kernel that reads
    the routing (the triton backend's: launch.py; the glue's: _rank_kernel), compiled with Triton's
    `debug` option (without it device_assert compiles to nothing). It stops the layer before any
    expert index is used, in place of fused_moe's own checking kernel and torch._assert_async (two
    launches, about 4 µs of a decode layer on an H200, BENCHMARKS.md sixth session)."""
    if CHECK_IDS:
        tl.device_assert(((ids >= 0) & (ids < E)) | (valid == 0), "moekit: topk_ids outside [0, num_experts)")


@triton.jit
def _as_int32_ids(ids, E):
    """int64 ids (transformers' routers give them; fused_moe passes them as they are) as int32,
    after their check: the comparisons with expert indices are then 32-bit, and an id outside
    [0, E) (stopped by the check, or a masked lane's) becomes -1, never a wrapped expert index."""
    if ids.dtype == tl.int64:
        ids = tl.where((ids >= 0) & (ids < E), ids, -1).to(tl.int32)
    return ids


@triton.jit
def _rank_kernel(
    ids_ptr,  # int32 or int64 [P]: expert of each pair
    local_rank_ptr,  # int32 [P] out: how many earlier pairs of the same chunk have the same expert
    chunk_counts_ptr,  # int32 [C, E] out: pairs of each expert in each chunk
    P,
    E,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHECK_IDS: tl.constexpr,  # assert every id in [0, E) (ops._permute_triton: the glue reads the ids first here)
):
    c = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(chunk_counts_ptr + c * E + offs_e, tl.zeros([BLOCK_E], dtype=tl.int32), mask=offs_e < E)
    # The zeros above must land before the counts below (the same addresses, other threads).
    tl.debug_barrier()
    i = tl.arange(0, BLOCK_P)
    p = c * BLOCK_P + i
    valid = p < P
    ids = tl.load(ids_ptr + p, mask=valid, other=-1)
    _check_expert_ids(ids, valid, E, CHECK_IDS)
    ids = _as_int32_ids(ids, E)
    same = (ids[:, None] == ids[None, :]) & valid[None, :]  # [i, j]: pairs i and j share an expert
    before = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    after = tl.sum((same & (i[None, :] > i[:, None])).to(tl.int32), axis=1)
    tl.store(local_rank_ptr + p, before, mask=valid)
    # The last pair of each expert in the chunk knows the chunk's count: one writer per address.
    # (An id out of range has failed the check, whose trap need not stop this thread's store: masked.)
    tl.store(chunk_counts_ptr + c * E + ids, before + 1, mask=valid & (after == 0) & (ids >= 0) & (ids < E))


@triton.jit
def _scan_kernel(
    chunk_counts_ptr,  # int32 [C, E] in: pairs per (chunk, expert); out: pairs of that expert in earlier chunks
    counts_ptr,  # int32 [E] out: pairs per expert
    offs_ptr,  # int32 [E] out: END row of each expert's group (groups padded to ALIGN rows), cumulative
    starts_ptr,  # int32 [E] out: first row of each expert's group
    amax_ptr,  # float32 [2] out: zeroed, for the dynamic per-tensor amax of x and of the intermediate
    C,
    E,
    ALIGN: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    running = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        ptrs = chunk_counts_ptr + offs_c[:, None] * E + offs_e[None, :]
        mask = (offs_c[:, None] < C) & mask_e[None, :]
        tile = tl.load(ptrs, mask=mask, other=0)
        # In place: every stored value depends on the value loaded from its own address.
        tl.store(ptrs, tl.cumsum(tile, axis=0) - tile + running[None, :], mask=mask)
        running += tl.sum(tile, axis=0)
    padded = (running + (ALIGN - 1)) // ALIGN * ALIGN
    ends = tl.cumsum(padded, axis=0)
    tl.store(counts_ptr + offs_e, running, mask=mask_e)
    tl.store(offs_ptr + offs_e, ends, mask=mask_e)
    tl.store(starts_ptr + offs_e, ends - padded, mask=mask_e)
    offs_2 = tl.arange(0, 2)
    tl.store(amax_ptr + offs_2, tl.zeros([2], dtype=tl.float32))


# ---------------------------------------------------------------------------------- permute


@triton.jit
def _row_amax_kernel(
    x_ptr,  # [M, H] activations, row stride stride_xm
    amax_ptr,  # float32 [1] in/out: running max of |x| (zeroed by _scan_kernel)
    H,
    stride_xm,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    m = tl.zeros([BLOCK_H], dtype=tl.int32)  # running max of |x|'s bits (_magnitude_bits)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        v = tl.load(x_ptr + t * stride_xm + cols, mask=cols < H, other=0.0).to(tl.float32)
        m = tl.maximum(m, _magnitude_bits(v))
    _atomic_amax(amax_ptr, tl.max(m, axis=0))


@triton.jit
def _permute_kernel(
    x_ptr,  # [M, H] activations (x.dtype), row stride stride_xm
    ids_ptr,  # int32 or int64 [P] (checked by _rank_kernel)
    local_rank_ptr,  # int32 [P] (from _rank_kernel)
    chunk_base_ptr,  # int32 [C, E] (from _scan_kernel)
    starts_ptr,  # int32 [E] (from _scan_kernel)
    row_of_pair_ptr,  # int32 [P] out: row of the permuted buffers that holds pair p
    a_ptr,  # [R, H] out: the permuted rows, x.dtype (QUANT 0) or float8_e4m3fn; row stride stride_am
    a_scale_ptr,  # float32 [R] out (QUANT > 0): dequantization scale of each permuted row
    scale_ptr,  # float32 [1] in: static scale (QUANT 2) or amax of all of x (QUANT 3)
    H,
    K,
    E,
    stride_xm,
    stride_am,
    QUANT: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    p = t * K + offs_k
    e = _as_int32_ids(tl.load(ids_ptr + p, mask=mask_k, other=0), E)
    mask_k = mask_k & (e >= 0) & (e < E)  # an id out of range failed _rank_kernel's check: nothing written
    rows = (
        tl.load(starts_ptr + e, mask=mask_k, other=0)
        + tl.load(chunk_base_ptr + (p // BLOCK_P) * E + e, mask=mask_k, other=0)
        + tl.load(local_rank_ptr + p, mask=mask_k, other=0)
    )
    tl.store(row_of_pair_ptr + p, rows, mask=mask_k)
    rows = rows.to(tl.int64)
    x_row = x_ptr + t.to(tl.int64) * stride_xm

    m = tl.zeros([BLOCK_H], dtype=tl.float32)  # running |max| of the row (QUANT 1)
    if QUANT == 1:
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            v = tl.load(x_row + cols, mask=cols < H, other=0.0).to(tl.float32)
            m = tl.maximum(m, tl.abs(v))
    if QUANT != 0:
        scale = _row_scale(m, scale_ptr, QUANT)
        tl.store(a_scale_ptr + rows, tl.zeros([BLOCK_K], dtype=tl.float32) + scale, mask=mask_k)

    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask_h = cols < H
        v = tl.load(x_row + cols, mask=mask_h, other=0.0)
        if QUANT != 0:
            v = _to_e4m3(v.to(tl.float32), scale)
        block = tl.broadcast_to(v.to(a_ptr.dtype.element_ty)[None, :], (BLOCK_K, BLOCK_H))
        tl.store(
            a_ptr + rows[:, None] * stride_am + cols[None, :],
            block,
            mask=mask_k[:, None] & mask_h[None, :],
        )


# ------------------------------------------------------------------------------ SiLU-and-mul


@triton.jit
def _silu_mul_block(h_row, cols, mask, N, ACT_DTYPE: tl.constexpr):
    """SiLU(gate) * up of some columns of one row, in float32, rounded to ACT_DTYPE."""
    g = tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_row + N + cols, mask=mask, other=0.0).to(tl.float32)
    act = g / (1.0 + tl.exp(-g)) * u
    return _round_act(act, ACT_DTYPE)


@triton.jit
def _silu_amax_kernel(
    h_ptr,  # [R, 2N] GEMM1 output (gate columns then up columns), row stride stride_hm
    row_of_pair_ptr,  # int32 [P]
    amax_ptr,  # float32 [1] in/out: running max of |SiLU(gate) * up| over all pairs
    N,
    stride_hm,
    ACT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    p = tl.program_id(0)
    row = tl.load(row_of_pair_ptr + p).to(tl.int64)
    h_row = h_ptr + row * stride_hm
    m = tl.zeros([BLOCK_N], dtype=tl.int32)  # running max of the bits of |SiLU(gate) * up|
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        act = _silu_mul_block(h_row, cols, cols < N, N, ACT_DTYPE)
        m = tl.maximum(m, _magnitude_bits(act))
    _atomic_amax(amax_ptr, tl.max(m, axis=0))


@triton.jit
def _silu_mul_kernel(
    h_ptr,  # [R, 2N] GEMM1 output (gate columns then up columns), row stride stride_hm
    row_of_pair_ptr,  # int32 [P]
    act_ptr,  # [R, N] out: ACT_DTYPE (QUANT 0) or float8_e4m3fn; row stride stride_am
    act_scale_ptr,  # float32 [R] out (QUANT > 0): dequantization scale of each row
    scale_ptr,  # float32 [1] in: static scale (QUANT 2) or amax of the whole intermediate (QUANT 3)
    N,
    stride_hm,
    stride_am,
    QUANT: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    p = tl.program_id(0)
    row = tl.load(row_of_pair_ptr + p).to(tl.int64)
    h_row = h_ptr + row * stride_hm
    act_row = act_ptr + row * stride_am
    m = tl.zeros([BLOCK_N], dtype=tl.float32)  # running |max| of the row (QUANT 1)
    if QUANT == 1:
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            act = _silu_mul_block(h_row, cols, cols < N, N, ACT_DTYPE)
            m = tl.maximum(m, tl.abs(act))
    if QUANT != 0:
        scale = _row_scale(m, scale_ptr, QUANT)
        tl.store(act_scale_ptr + row, scale)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        mask = cols < N
        act = _silu_mul_block(h_row, cols, mask, N, ACT_DTYPE)
        if QUANT != 0:
            act = _to_e4m3(act, scale)
        tl.store(act_row + cols, act.to(act_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------- combine


@triton.jit
def _combine_kernel(
    y_ptr,  # [R, H] GEMM2 output of the permuted rows, row stride stride_ym
    row_of_pair_ptr,  # int32 [P]
    w_ptr,  # float32 [P]: top-k weight of each pair
    out_ptr,  # [M, H] out (x.dtype), row stride stride_om
    H,
    K,
    stride_ym,
    stride_om,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(0, K):  # fixed order, no atomics: deterministic
        p = t * K + j
        row = tl.load(row_of_pair_ptr + p).to(tl.int64)
        w = tl.load(w_ptr + p)
        acc += w * tl.load(y_ptr + row * stride_ym + cols, mask=mask, other=0.0).to(tl.float32)
    out = _round_act(acc, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + cols, out, mask=mask)


@triton.jit
def _narrow_ids_kernel(ids_ptr, out_ptr, P, E, BLOCK: tl.constexpr):
    """int64 expert ids to int32, each id outside [0, E) written as -1: narrowed as it is, an id of
    2**32 + 3 would read as expert 3, and the range checks after this pass would not see it."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=0)
    tl.store(out_ptr + offs, tl.where((ids >= 0) & (ids < E), ids, -1).to(tl.int32), mask=offs < P)


@triton.jit
def _ids_in_range_kernel(ids_ptr, ok_ptr, P, E, BLOCK: tl.constexpr, ONE_PROGRAM: tl.constexpr):
    """ok[0] = 0 if any of the P ids lies outside [0, E). ONE_PROGRAM (few ids, decode): one
    program reads them all and writes ok (1 or 0), so the check is one launch inside a CUDA graph.
    Otherwise each program reads BLOCK ids and clears ok (set to 1 beforehand) with an atomic
    minimum, the same result in any order."""
    if ONE_PROGRAM:
        bad = tl.zeros((BLOCK,), dtype=tl.int32)
        for start in range(0, P, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ids = tl.load(ids_ptr + offs, mask=offs < P, other=0)
            bad += ((ids < 0) | (ids >= E)).to(tl.int32)
        tl.store(ok_ptr, (tl.sum(bad, axis=0) == 0).to(tl.int32))
    else:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=0)
        if tl.sum(((ids < 0) | (ids >= E)).to(tl.int32), axis=0) > 0:
            tl.atomic_min(ok_ptr, 0)
