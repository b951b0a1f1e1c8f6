"""Triton kernels of the `triton` backend: only @triton.jit code lives here; launch.py runs it.

Letters: P = M*K (token, expert) pairs, pair p = token p // K; E experts; H hidden; N intermediate.
Rows of the "sorted" space are pairs grouped by expert, each expert's group padded to BLOCK_M;
expert e owns rows [start[e], start[e+1]) of which the first count[e] are real pairs.
"""

import triton
import triton.language as tl

# IEEE division, as moekit.quant: Triton's `/` on float32 is an approximate division on the GPU,
# which moved FP8 values away from the reference's (BENCHMARKS.md, 2026-12-03); the clamp before
# FP8 keeps a NaN NaN, as torch's does
from ..glue._kernels import _atomic_amax, _clamp_fp8, _magnitude_bits, _round_bf16, _scale_from_amax
# the expert ids' check and their int32 form, shared with the glue's first kernel
from ..glue._kernels import _as_int32_ids, _check_expert_ids

try:  # programmatic dependent launch (Hopper+); launch.py turns it off where this import fails
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """First thing of every kernel launched with programmatic dependent launch (launch.py's
    pdl_enabled): such a kernel may start while the kernel before it in the stream still runs, so
    it waits here for that kernel's writes before it reads or writes any memory."""
    if PDL:
        gdc_wait()


@triton.jit
def _pdl_release(PDL: tl.constexpr):
    """Let the next kernel in the stream start once every program of this one has passed here
    (its programs then wait in _pdl_wait): its launch overlaps this kernel's tail instead of
    following it. Where a program releases matters: the next kernel's programs take free SM
    slots as soon as all of ours have released, so releasing at the start lets a small next grid
    crowd onto the few SMs free at that moment (two of Mixtral's GEMM2 programs per SM, at half
    the bandwidth each, is our reading of 181 against 140 µs per layer at M = 1 on an H200); even
    released after GEMM1's K loop, Mixtral at M = 4 lost 4% (BENCHMARKS.md, seventh session). So
    GEMM1 does not release (its exit does), GEMM2 releases after its K loop (the combine after it
    is small; a GEMM2 program running several column tiles, N_TILES2, after its last tile), and
    the small kernels and both GEMV-path kernels (whose next grid has hundreds of programs) at
    once."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    """_pdl_wait, then _pdl_release at once: for kernels followed by a large grid (or by nothing
    of ours)."""
    _pdl_wait(PDL)
    _pdl_release(PDL)


# --------------------------------------------------------------------------- CPU-interpreter fixes
# INTERPRET (constexpr) is True only under TRITON_INTERPRET=1. The interpreter of triton 3.9 gets four
# things wrong that the GPU gets right: a float32 -> e4m3 cast that rounds up across a power of two
# loses the carry (124.97 becomes 64, not 128) and makes a NaN 384; a float32 -> bfloat16 cast
# truncates instead of rounding to nearest; and tl.dot on bfloat16 operands returns garbage.


@triton.jit
def _to_fp8(x, INTERPRET: tl.constexpr):
    """float32 within +-448 -> float8e4nv, rounding to nearest even."""
    if INTERPRET:
        # Round in float32 first, so that the cast itself is exact: normal values keep 3 mantissa
        # bits (add half an ulp of the kept bits, ties to even, then drop the low 20 bits);
        # subnormals (below 2**-6) are multiples of 2**-9, rounded by adding and removing 1.5 * 2**14.
        bits = x.to(tl.int32, bitcast=True)
        kept = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        x = tl.where(tl.abs(x) < 0.015625, (x + 24576.0) - 24576.0, kept)
        # and the interpreter's cast truncates a NaN's bits to 384: e4m3's NaN (0x7F) by hand
        nan = tl.full(x.shape, 0x7F, tl.int8).to(tl.float8e4nv, bitcast=True)
        return tl.where(x != x, nan, x.to(tl.float8e4nv))
    return x.to(tl.float8e4nv)


@triton.jit
def _to_dtype(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 -> the activations' dtype, rounding to nearest even."""
    if INTERPRET and dtype == tl.bfloat16:
        x = _round_bf16(x)
    return x.to(dtype)


@triton.jit
def _dot(a, b, acc, PROMOTE: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a @ b in float32. Hopper's tensor cores sum FP8 products in a narrower accumulator
    (about 1e-2 relative error over K = 4096, measured); max_num_imprecise_acc makes the compiler
    add each PROMOTE-long partial product into the float32 acc instead, as DeepGEMM does (a dot
    longer than PROMOTE is several such products, added in K order: launch.fp8_promote).
    PROMOTE 0: no such request (the caller scales and adds each product into float32 itself)."""
    if INTERPRET and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)  # exact: bf16 -> f32 loses nothing
    if a.dtype == tl.float8e4nv and PROMOTE > 0:
        return tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)
    return tl.dot(a, b, acc)


# --------------------------------------------------------------------------- token alignment
# Deterministic counting sort of the pairs by expert, entirely on the GPU: chunks of CHUNK pairs
# count their experts, a scan turns counts into padded offsets, and each chunk scatters its pairs
# (pairs of one expert keep their order, so the layout is the same on every run).


@triton.jit
def _chunk_counts(ids_ptr, counts_ptr, chunk, P, E, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr,
                  CHECK_IDS: tl.constexpr):
    """counts[e] = pairs of this chunk routed to expert e, for every e (dense row, no atomics)."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)  # [CHUNK] int32 or int64
    _check_expert_ids(ids, offs < P, E, CHECK_IDS)
    ids = _as_int32_ids(ids, E)
    for e0 in range(0, E, E_BLOCK):
        experts = e0 + tl.arange(0, E_BLOCK)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_BLOCK]
        tl.store(counts_ptr + experts, tl.sum(hits, axis=0), mask=experts < E)


@triton.jit
def _scatter_chunk(ids_ptr, sorted_ptr, chunk_offset_ptr, start_ptr, chunk, P, E, CHUNK: tl.constexpr,
                   HAS_EARLIER_CHUNKS: tl.constexpr):
    """Write each pair p of this chunk to row start[e] + (pairs of e in earlier chunks) + rank."""
    local = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + local
    valid = offs < P
    ids = _as_int32_ids(tl.load(ids_ptr + offs, mask=valid, other=-1), E)  # [CHUNK]
    same = (ids[:, None] == ids[None, :]) & (local[None, :] < local[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)  # earlier pairs of the same expert in this chunk
    safe_ids = tl.where(valid, ids, 0)
    row = tl.load(start_ptr + safe_ids, mask=valid) + rank
    if HAS_EARLIER_CHUNKS:
        row += tl.load(chunk_offset_ptr + safe_ids, mask=valid)
    tl.store(sorted_ptr + row, offs, mask=valid)


@triton.jit
def _padded_starts(counts_ptr, count_out_ptr, start_ptr, E, BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr):
    """start[e] = sum over e' < e of count[e'] rounded up to BLOCK_M; start[E] = rows in use."""
    carry = 0
    for e0 in range(0, E, E_BLOCK):
        experts = e0 + tl.arange(0, E_BLOCK)
        cnt = tl.load(counts_ptr + experts, mask=experts < E, other=0)
        padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        inclusive = tl.cumsum(padded, axis=0)
        tl.store(start_ptr + experts, carry + inclusive - padded, mask=experts < E)
        tl.store(count_out_ptr + experts, cnt, mask=experts < E)
        carry += tl.sum(padded, axis=0)
    tl.store(start_ptr + E, carry)


@triton.jit
def _align_single(ids_ptr, sorted_ptr, count_ptr, start_ptr, P, E,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr, CHECK_IDS: tl.constexpr):
    """The whole alignment in one program, for P <= CHUNK (decode sizes)."""
    _chunk_counts(ids_ptr, count_ptr, 0, P, E, CHUNK, E_BLOCK, CHECK_IDS)
    tl.debug_barrier()  # the counts written above are read back by other threads
    _padded_starts(count_ptr, count_ptr, start_ptr, E, BLOCK_M, E_BLOCK)
    tl.debug_barrier()
    _scatter_chunk(ids_ptr, sorted_ptr, count_ptr, start_ptr, 0, P, E, CHUNK, False)


@triton.jit
def align_count_kernel(ids_ptr, chunk_counts_ptr, P, E, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr,
                       CHECK_IDS: tl.constexpr, PDL: tl.constexpr):
    _pdl_enter(PDL)
    chunk = tl.program_id(0)
    _chunk_counts(ids_ptr, chunk_counts_ptr + chunk * E, chunk, P, E, CHUNK, E_BLOCK, CHECK_IDS)


@triton.jit
def align_scan_kernel(
    chunk_counts_ptr,  # (C, E) int32 in: per-chunk counts; out: pairs of e in earlier chunks
    total_ptr,  # (E,) int32 out: pairs of each expert
    count_ptr, start_ptr,  # written here only WITH_STARTS (else by align_starts_kernel)
    C, E,
    BLOCK_M: tl.constexpr, C_POW2: tl.constexpr, E_BLOCK: tl.constexpr, WITH_STARTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per E_BLOCK experts (the experts' scans are independent): the exclusive prefix
    of their counts over the chunks, and their totals. One program walking every block in turn
    took 70 µs of DeepSeek-V3's layer at M = 8192 (256 experts, 512 chunks) on an H100, as long
    as quantizing x; 24 µs so (BENCHMARKS.md, thirty-third session). WITH_STARTS (a single program:
    E <= E_BLOCK) also writes each expert's count and padded first row, which align_starts_kernel
    does otherwise: a launch fewer (1.5 µs of Mixtral's alignment)."""
    _pdl_enter(PDL)
    chunks = tl.arange(0, C_POW2)
    experts = tl.program_id(0) * E_BLOCK + tl.arange(0, E_BLOCK)
    mask = (chunks[:, None] < C) & (experts[None, :] < E)
    ptrs = chunk_counts_ptr + chunks[:, None] * E + experts[None, :]
    cnt = tl.load(ptrs, mask=mask, other=0)  # [C_POW2, E_BLOCK]
    inclusive = tl.cumsum(cnt, axis=0)
    tl.store(ptrs, inclusive - cnt, mask=mask)  # exclusive prefix over chunks
    tl.store(total_ptr + experts, tl.sum(cnt, axis=0), mask=experts < E)
    if WITH_STARTS:
        tl.debug_barrier()  # the totals written above are read back by other threads
        _padded_starts(total_ptr, count_ptr, start_ptr, E, BLOCK_M, E_BLOCK)


@triton.jit
def align_starts_kernel(total_ptr, count_ptr, start_ptr, E, BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    """Each expert's count and padded first row from the totals of align_scan_kernel."""
    _pdl_enter(PDL)
    _padded_starts(total_ptr, count_ptr, start_ptr, E, BLOCK_M, E_BLOCK)


@triton.jit
def align_scatter_kernel(ids_ptr, sorted_ptr, chunk_offsets_ptr, start_ptr, P, E, CHUNK: tl.constexpr,
                         PDL: tl.constexpr):
    _pdl_enter(PDL)
    chunk = tl.program_id(0)
    _scatter_chunk(ids_ptr, sorted_ptr, chunk_offsets_ptr + chunk * E, start_ptr, chunk, P, E, CHUNK, True)


# --------------------------------------------------------------------------- activation quantization
# MODE: 0 = one scale per row, 1 = one scale per 1x128 group, 2 = amax of the row into a shared
# per-tensor maximum (atomic max of non-negative floats: the same result in any order),
# 3 = quantize with a per-tensor scale (static, or from the shared maximum when FROM_AMAX).


@triton.jit
def _quantize_row(
    row, chunk, x_ptr, q_ptr, scale_ptr, amax_ptr, H, stride_x, stride_q, stride_s,
    MODE: tl.constexpr, FROM_AMAX: tl.constexpr, BLOCK_H: tl.constexpr, GROUP: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Columns [chunk * BLOCK_H, (chunk + 1) * BLOCK_H) of one row (MODE 0 needs the whole row in
    one chunk: its scale is the row's |max|). Divisions by the scale as _quantize_tile does them:
    the correctly rounded quotient, so the bits of an IEEE division per element, for less work."""
    col0 = chunk * BLOCK_H
    if MODE == 1:
        # 1x128 groups, addressed as a [groups, GROUP] tile (no tl.reshape: reductions over a
        # reshaped view were wrong on an H200 with triton 3.6, 2026-12-03)
        g_idx = tl.arange(0, BLOCK_H // GROUP)
        cols2 = col0 + g_idx[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        x2 = tl.load(x_ptr + row * stride_x + cols2, mask=cols2 < H, other=0.0).to(tl.float32)
        g_scale = _scale_from_amax(tl.max(tl.abs(x2), axis=1))  # [BLOCK_H // GROUP]
        tl.store(scale_ptr + row * stride_s + col0 // GROUP + g_idx, g_scale, mask=col0 + g_idx * GROUP < H)
        tl.store(q_ptr + row * stride_q + cols2, _quantize_tile(x2, g_scale, INTERPRET), mask=cols2 < H)
    else:
        cols = col0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < H, other=0.0).to(tl.float32)
        if MODE == 2:
            _atomic_amax(amax_ptr, tl.max(_magnitude_bits(x), axis=0))
        else:
            if MODE == 0:
                scale = _scale_from_amax(tl.max(tl.abs(x), axis=0))
                tl.store(scale_ptr + row, scale)
            elif FROM_AMAX:
                scale = _scale_from_amax(tl.load(amax_ptr))
                if row == 0 and chunk == 0:
                    tl.store(scale_ptr, scale)
            else:
                scale = tl.load(scale_ptr)
            q = _quantize_tile(x[None, :], tl.full((1,), 1.0, tl.float32) * scale, INTERPRET)  # a [1, BLOCK_H] tile
            tl.store(q_ptr + row * stride_q + cols[None, :], q, mask=cols[None, :] < H)


@triton.jit
def quantize_rows_kernel(
    x_ptr,  # (M, H) bf16/fp16
    q_ptr,  # (M, H) fp8 out
    scale_ptr,  # (M,) or (M, ceil(H/128)) float32 out; or (1,) in for MODE 3
    amax_ptr,  # (1,) float32 shared maximum (MODE 2 writes it, MODE 3 + FROM_AMAX reads it)
    H, stride_x, stride_q, stride_s,
    MODE: tl.constexpr, FROM_AMAX: tl.constexpr, BLOCK_H: tl.constexpr, GROUP: tl.constexpr,
    INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (row, chunk of BLOCK_H columns)."""
    _pdl_enter(PDL)
    _quantize_row(tl.program_id(0).to(tl.int64), tl.program_id(1), x_ptr, q_ptr, scale_ptr, amax_ptr, H, stride_x,
                  stride_q, stride_s, MODE, FROM_AMAX, BLOCK_H, GROUP, INTERPRET)


@triton.jit
def align_single_kernel(ids_ptr, sorted_ptr, count_ptr, start_ptr, P, E,
                        BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr,
                        CHECK_IDS: tl.constexpr, PDL: tl.constexpr):
    _pdl_enter(PDL)
    _align_single(ids_ptr, sorted_ptr, count_ptr, start_ptr, P, E, BLOCK_M, CHUNK, E_BLOCK, CHECK_IDS)


@triton.jit
def decode_prologue_kernel(
    ids_ptr, sorted_ptr, count_ptr, start_ptr, P, E,
    x_ptr, q_ptr, scale_ptr, H, stride_x, stride_q, stride_s, chunks_per_row,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr,
    MODE: tl.constexpr, BLOCK_H: tl.constexpr, GROUP: tl.constexpr, INTERPRET: tl.constexpr,
    CHECK_IDS: tl.constexpr, PDL: tl.constexpr,
):
    """Alignment (program 0) and the quantization of x (programs 1.., chunks_per_row per row of
    BLOCK_H columns each) in one launch: at decode sizes each launch costs about as much as the
    work itself."""
    _pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid == 0:
        _align_single(ids_ptr, sorted_ptr, count_ptr, start_ptr, P, E, BLOCK_M, CHUNK, E_BLOCK, CHECK_IDS)
    else:
        row = (pid - 1) // chunks_per_row
        _quantize_row(row.to(tl.int64), (pid - 1) % chunks_per_row, x_ptr, q_ptr, scale_ptr, scale_ptr, H, stride_x,
                      stride_q, stride_s, MODE, False, BLOCK_H, GROUP, INTERPRET)


# --------------------------------------------------------------------------- expert GEMMs
# Scale kinds (constexpr): A_SCALE 0 none, 1 per tensor, 2 per row, 3 per 1x128 group of K;
# B_SCALE 0 none, 1 per tensor (one per expert), 2 per output channel, 3 per 128x128 block.
# Group and block scales change with each K step, so they are applied inside the loop; the
# others once after it. Block scales need BLOCK_K == 128 and BLOCK_N dividing 128.


@triton.jit
def _expert_of_block(start_ptr, row0, E, E_POW2: tl.constexpr):
    """The expert whose padded rows contain row0 (number of experts starting after row 0 at or
    before row0, minus one)."""
    experts = tl.arange(0, E_POW2)
    starts = tl.load(start_ptr + 1 + experts, mask=experts < E, other=2147483647)
    return tl.sum((starts <= row0).to(tl.int32), axis=0)


@triton.jit
def _tile_ids(num_rows_ptr, num_n_blocks, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr):
    """Grouped ordering of (row block, column block): GROUP_M row blocks share columns in L2."""
    pid = tl.program_id(0)
    num_m_blocks = tl.cdiv(tl.load(num_rows_ptr), BLOCK_M)
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    group_size = tl.maximum(group_size, 1)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n, num_m_blocks


@triton.jit
def _divide_rn(a, s, inv):
    """a / s correctly rounded (IEEE division's float32 result), given inv = 1 / s correctly
    rounded, without a division per element (inside the GEMMs an IEEE division per element cost
    up to 25% of a decode-size layer, H200 2026-12-03): Markstein's correction
    q + (a - q * s) / s ~ q + fma(-q, s, a) * inv, two FMAs. The plain product a * inv is not
    enough: with bf16 inputs a / s often lands exactly on an FP8 rounding midpoint, and a 1-ulp
    error then moves 0.04% of the values by one FP8 step (2e-3 relative L2, measured on the CPU).
    Where a * inv is zero or the correction is NaN (a, s or the quotient not finite: inf - inf),
    a * inv already is the division's result (a signed zero, an infinity, a NaN) and is kept: the
    correction would turn -0 into +0 and an overflow that saturates into a NaN. Below |a| = 2**-102
    the residual is subnormal and the quotient may end a few bits off: there a / s is under 2**-60
    for any scale a dynamic rule makes (at least 1e-10 / 448), far below e4m3's smallest step
    (2**-9), so the FP8 value is the same (tests/test_triton_division.py)."""
    q = a * inv
    corrected = tl.fma(tl.fma(-q, s, a), inv, q)
    return tl.where((q == 0) | (corrected != corrected), q, corrected)


@triton.jit
def _quantize_tile(a, scale_of_row, INTERPRET: tl.constexpr):
    """float32 tile -> FP8 with per-row scales [BLOCK_M] (the 1x128 group or per-tensor rule):
    clamp(a / scale) by _divide_rn, so the bits of moekit.quant.to_fp8's IEEE division."""
    inv = tl.div_rn(tl.full(scale_of_row.shape, 1.0, tl.float32), scale_of_row)[:, None]
    return _to_fp8(_clamp_fp8(_divide_rn(a, scale_of_row[:, None], inv)), INTERPRET)


@triton.jit
def _gemm1_joined(a_ptrs, row_ok, w_ptr, pid_n, N, H, stride_wn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PROMOTE: tl.constexpr, INTERPRET: tl.constexpr):
    """GEMM1's main loop as vLLM's tile: column j of one 2*BLOCK_N-wide tile is gate column j // 2
    when j is even and up column j // 2 when odd, so one wide tl.dot per K step reads A once (two
    narrower dots each read it), and the accumulator splits into gate and up along a last axis of
    2. Without FP8 promotion this was GEMM1's fastest tile on an H200 (BENCHMARKS.md, fourth
    session: 1635 against 1731 µs, Mixtral-8x7B M = 4096); with promotion 2.4x slower. Scales
    that change with each K step are not supported (KernelConfig.problems)."""
    j = tl.arange(0, 2 * BLOCK_N)
    col = pid_n * BLOCK_N + j // 2
    col_ok = col < N
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (col + (j % 2) * N)[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = ks < H - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot(a, b, acc, PROMOTE, INTERPRET)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))


@triton.jit
def _half_tile(count_ptr, start_ptr, e, row0, BLOCK_M: tl.constexpr):
    """Whether the row block at row0 runs as a half-height tile: an expert's last block holding
    at most BLOCK_M // 2 real rows, with BLOCK_M 128 or more. Both heights are instantiations of
    the same tile code in one kernel, so the padding rows of that lower half cost no tensor-core
    work (with BLOCK_M 128 and ~256 rows per expert, GLM-4.5V at M = 4096, about a quarter of the
    rows computed were padding). Measured on an H200 (BENCHMARKS.md, tenth session), whole layer:
    faster at all seven 128-row points (0.5-6%) and bitwise equal to the full tile (64-row halves keep
    Hopper's 64-row tensor-core instructions); 64-row blocks split into 32-row halves were up to
    22% slower and are not split."""
    if BLOCK_M >= 128:
        return tl.load(count_ptr + e) - (row0 - tl.load(start_ptr + e)) <= BLOCK_M // 2
    return False


@triton.jit
def gemm1_kernel(
    a_ptr,  # (M, H) fp8 or bf16/fp16 activations (rows read through the sorted pair ids)
    a_scale_ptr,  # (1,) | (M,) | (M, ceil(H/128)) float32
    w_ptr,  # (E, 2N, H) weights, gate rows then up rows
    w_scale_ptr,  # (E,) | (E, 2N) | (E, 2N/128, ceil(H/128)) float32
    out_ptr,  # (rows, N) bf16/fp16 SiLU(gate) * up, or fp8 (OUT_MODE 2: a static scale; 3: 1x128 group scales)
    out_scale_ptr,  # (1,) float32 static scale of the output (fp8-tensor-static), or
    # (rows, ceil(N/128)) float32 scales of the output's 1x128 groups (OUT_MODE 3)
    amax_ptr,  # (1,) float32 shared maximum of |output| (fp8-tensor-dynamic)
    sorted_ptr, count_ptr, start_ptr,  # alignment (see module docstring)
    P, E, N, H, K_TOP,
    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_os,
    A_SCALE: tl.constexpr, B_SCALE: tl.constexpr, OUT_MODE: tl.constexpr, ACT_DTYPE: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PROMOTE: tl.constexpr, JOIN: tl.constexpr, HALF_TAIL: tl.constexpr,
    INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """OUT_MODE: 0 store in the output dtype, 1 also record amax, 2 quantize with a static scale,
    3 quantize per 1x128 group (BLOCK_N a multiple of 128, so a tile holds whole groups).
    JOIN: gate and up columns in one 2*BLOCK_N-wide tile, one tl.dot per K step (_gemm1_joined).
    An expert's last row block may run at half height (_half_tile); with HALF_TAIL the last
    column block, which then holds at most BLOCK_N // 2 real columns, runs at half width (the
    same tile code, BLOCK_N // 2 wide): GLM-4.5V's 704 columns at TP2 are 5.5 tiles of 128, and
    the full-width last tile computed 64 columns of zeros. Measured on an H200 (BENCHMARKS.md,
    twelfth session), whole layer, precise mode: GLM-4.5V M = 4096 1160.0 -> 1130.6 µs, M = 8192
    2122.8 -> 2058.4, M = 64 and 1024 unchanged; bitwise equal to the full-width tile."""
    _pdl_wait(PDL)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n, num_m_blocks = _tile_ids(start_ptr + E, num_n_blocks, GROUP_M, BLOCK_M)
    if pid_m >= num_m_blocks or pid_n >= num_n_blocks:
        # the grid is sized for the worst routing: this block has no rows this time, or (last,
        # short group of GROUP_M) its column block lies past the end
        return
    row0 = pid_m * BLOCK_M
    e = _expert_of_block(start_ptr, row0, E, E_POW2)
    if HALF_TAIL and pid_n == num_n_blocks - 1:
        _gemm1_rows(row0, e, pid_n * BLOCK_N, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr, amax_ptr,
                    sorted_ptr, count_ptr, start_ptr, N, H, K_TOP,
                    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_os,
                    A_SCALE, B_SCALE, OUT_MODE, ACT_DTYPE, BLOCK_M, BLOCK_N // 2, BLOCK_K, PROMOTE, JOIN, INTERPRET)
    else:
        _gemm1_rows(row0, e, pid_n * BLOCK_N, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr, amax_ptr,
                    sorted_ptr, count_ptr, start_ptr, N, H, K_TOP,
                    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_os,
                    A_SCALE, B_SCALE, OUT_MODE, ACT_DTYPE, BLOCK_M, BLOCK_N, BLOCK_K, PROMOTE, JOIN, INTERPRET)


@triton.jit
def _gemm1_rows(
    row0, e, col0, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr, amax_ptr,
    sorted_ptr, count_ptr, start_ptr, N, H, K_TOP,
    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_os,
    A_SCALE: tl.constexpr, B_SCALE: tl.constexpr, OUT_MODE: tl.constexpr, ACT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr,
    JOIN: tl.constexpr, INTERPRET: tl.constexpr,
):
    """GEMM1 of the tile at (row0, col0), at half height where _half_tile says so."""
    if _half_tile(count_ptr, start_ptr, e, row0, BLOCK_M):
        _gemm1_tile(row0, e, col0, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr, amax_ptr,
                    sorted_ptr, count_ptr, start_ptr, N, H, K_TOP,
                    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_os,
                    A_SCALE, B_SCALE, OUT_MODE, ACT_DTYPE, BLOCK_M // 2, BLOCK_N, BLOCK_K, PROMOTE, JOIN, INTERPRET)
    else:
        _gemm1_tile(row0, e, col0, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr, amax_ptr,
                    sorted_ptr, count_ptr, start_ptr, N, H, K_TOP,
                    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_os,
                    A_SCALE, B_SCALE, OUT_MODE, ACT_DTYPE, BLOCK_M, BLOCK_N, BLOCK_K, PROMOTE, JOIN, INTERPRET)


@triton.jit
def _gemm1_tile(
    row0, e, col0, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr, amax_ptr,
    sorted_ptr, count_ptr, start_ptr, N, H, K_TOP,
    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_os,
    A_SCALE: tl.constexpr, B_SCALE: tl.constexpr, OUT_MODE: tl.constexpr, ACT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr,
    JOIN: tl.constexpr, INTERPRET: tl.constexpr,
):
    """GEMM1 of one tile: BLOCK_M rows from row0 (of expert e) by BLOCK_N columns from col0."""
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows - tl.load(start_ptr + e) < tl.load(count_ptr + e)
    pair = tl.load(sorted_ptr + rows, mask=row_ok, other=0)
    token = (pair // K_TOP).to(tl.int64)  # [BLOCK_M]

    cols = col0 + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    a_ptrs = a_ptr + token[:, None] * stride_am + ks[None, :]
    gate_ptrs = w_ptr + e64 * stride_we + cols[None, :] * stride_wn + ks[:, None]
    up_ptrs = gate_ptrs + N * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if JOIN:
        acc_gate, acc_up = _gemm1_joined(a_ptrs, row_ok, w_ptr + e64 * stride_we, col0 // BLOCK_N, N, H, stride_wn,
                                         BLOCK_M, BLOCK_N, BLOCK_K, PROMOTE, INTERPRET)
    else:
        for k0 in range(0, H, BLOCK_K):
            k_ok = ks < H - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b_gate = tl.load(gate_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            b_up = tl.load(up_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if A_SCALE == 3 or B_SCALE == 3:
                step_a = tl.full((BLOCK_M,), 1.0, tl.float32)
                if A_SCALE == 3:
                    step_a = tl.load(a_scale_ptr + token * stride_as + k0 // BLOCK_K, mask=row_ok, other=0.0)
                step_gate = 1.0
                step_up = 1.0
                if B_SCALE == 3:
                    ws = w_scale_ptr + e64 * stride_wse + k0 // BLOCK_K
                    step_gate = tl.load(ws + (col0 // 128) * stride_wsn)
                    step_up = tl.load(ws + ((N + col0) // 128) * stride_wsn)
                # each BLOCK_K-long product is scaled and added into float32 here, which is already
                # the promotion _dot asks the compiler for (and asking again slowed the loop down)
                acc_gate += _dot(a, b_gate, None, 0, INTERPRET) * (step_a[:, None] * step_gate)
                acc_up += _dot(a, b_up, None, 0, INTERPRET) * (step_a[:, None] * step_up)
            else:
                acc_gate = _dot(a, b_gate, acc_gate, PROMOTE, INTERPRET)
                acc_up = _dot(a, b_up, acc_up, PROMOTE, INTERPRET)
            a_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
    # no _pdl_release: GEMM2 starts when every GEMM1 program has exited (see _pdl_release)

    if A_SCALE == 1:
        a_s = tl.load(a_scale_ptr)
        acc_gate *= a_s
        acc_up *= a_s
    elif A_SCALE == 2:
        a_s = tl.load(a_scale_ptr + token, mask=row_ok, other=0.0)
        acc_gate *= a_s[:, None]
        acc_up *= a_s[:, None]
    if B_SCALE == 1:
        b_s = tl.load(w_scale_ptr + e64 * stride_wse)
        acc_gate *= b_s
        acc_up *= b_s
    elif B_SCALE == 2:
        ws = w_scale_ptr + e64 * stride_wse
        acc_gate *= tl.load(ws + cols, mask=col_ok, other=0.0)[None, :]
        acc_up *= tl.load(ws + N + cols, mask=col_ok, other=0.0)[None, :]

    # SiLU(gate) * up, rounded to the activations' dtype as the reference defines it.
    act = _to_dtype(acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up, ACT_DTYPE, INTERPRET)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    if OUT_MODE == 1:
        bits = tl.where(out_mask, _magnitude_bits(act.to(tl.float32)), 0)
        _atomic_amax(amax_ptr, tl.max(tl.max(bits, axis=1), axis=0))
    if OUT_MODE == 2:
        static = tl.full((BLOCK_M,), 1.0, tl.float32) * tl.load(out_scale_ptr)
        tl.store(out_ptrs, _quantize_tile(act.to(tl.float32), static, INTERPRET), mask=out_mask)
    elif OUT_MODE == 3:
        # each tile row is one 1x128 group of the intermediate (launch's BLOCK_N is 128; a half-width
        # last tile holds all its group's real columns). (Reductions over a tl.reshape'd 3-D view
        # were wrong on an H200 with triton 3.6, 2026-12-03, so no reshape.)
        a32 = tl.where(out_mask, act.to(tl.float32), 0.0)
        g_scale = _scale_from_amax(tl.max(tl.abs(a32), axis=1))  # [BLOCK_M]
        tl.store(out_ptrs, _quantize_tile(a32, g_scale, INTERPRET), mask=out_mask)
        tl.store(out_scale_ptr + rows.to(tl.int64) * stride_os + col0 // 128, g_scale, mask=row_ok)
    else:
        tl.store(out_ptrs, act, mask=out_mask)


@triton.jit
def gemm2_kernel(
    a_ptr,  # (rows, N) intermediate in sorted-row order: bf16/fp16, or fp8 (static scheme)
    a_scale_ptr,  # (1,) static scale, (1,) shared amax (per-tensor dynamic), or (rows, ceil(N/128))
    w_ptr,  # (E, H, N)
    w_scale_ptr,  # (E,) | (E, H) | (E, H/128... ceil, N/128) float32
    topk_weights_ptr,  # (P,) float32
    out_ptr,  # (P, H) x's dtype: each pair's weighted expert output
    sorted_ptr, count_ptr, start_ptr,
    P, E, N, H,
    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    A_MODE: tl.constexpr, B_SCALE: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, N_TILES: tl.constexpr, KEEP_A_STEPS: tl.constexpr,
    PROMOTE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """A_MODE: 0 unquantized, 1 FP8 with a static scale, 2 quantize per 1x128 group while loading,
    3 quantize per tensor while loading (scale from the shared amax), 4 FP8 with 1x128 group scales,
    5 FP8 with one scale per row (a_scale_ptr: (rows,)).
    N_TILES > 1: each program runs N_TILES column blocks of one row block in turn (_gemm2_row_run),
    row block after row block in program order (GROUP_M does not apply: the programs of a row
    block already share its A rows, and neighbouring row blocks mostly share an expert).
    KEEP_A_STEPS (1 to 6, with N_TILES > 1; 0: off): the run loads its row block's A once, in that
    many K steps (the whole inner dimension N), and keeps it across its column tiles
    (_gemm2_resident_run)."""
    _pdl_wait(PDL)
    num_n_blocks = tl.cdiv(H, BLOCK_N)
    if N_TILES == 1:
        pid_m, pid_n, num_m_blocks = _tile_ids(start_ptr + E, num_n_blocks, GROUP_M, BLOCK_M)
        n_count = 1
    else:
        runs = tl.cdiv(num_n_blocks, N_TILES)
        pid_m = tl.program_id(0) // runs
        pid_n = (tl.program_id(0) % runs) * N_TILES
        num_m_blocks = tl.cdiv(tl.load(start_ptr + E), BLOCK_M)
        n_count = tl.minimum(num_n_blocks - pid_n, N_TILES)
    if pid_m >= num_m_blocks or pid_n >= num_n_blocks:
        return  # see gemm1_kernel
    row0 = pid_m * BLOCK_M
    e = _expert_of_block(start_ptr, row0, E, E_POW2)
    if _half_tile(count_ptr, start_ptr, e, row0, BLOCK_M):
        _gemm2_row_run(row0, e, pid_n, n_count, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, topk_weights_ptr, out_ptr,
                       sorted_ptr, count_ptr, start_ptr, N, H,
                       stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                       A_MODE, B_SCALE, BLOCK_M // 2, BLOCK_N, BLOCK_K, N_TILES, KEEP_A_STEPS, PROMOTE, INTERPRET, PDL)
    else:
        _gemm2_row_run(row0, e, pid_n, n_count, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, topk_weights_ptr, out_ptr,
                       sorted_ptr, count_ptr, start_ptr, N, H,
                       stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                       A_MODE, B_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, N_TILES, KEEP_A_STEPS, PROMOTE, INTERPRET, PDL)


@triton.jit
def _gemm2_row_run(
    row0, e, pid_n, n_count, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, topk_weights_ptr, out_ptr,
    sorted_ptr, count_ptr, start_ptr, N, H,
    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    A_MODE: tl.constexpr, B_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, N_TILES: tl.constexpr, KEEP_A_STEPS: tl.constexpr, PROMOTE: tl.constexpr,
    INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """GEMM2 of column blocks pid_n .. pid_n + n_count - 1 of one row block, one after another.
    With a short inner dimension (256 for DeepSeek-V3 at TP8: two K steps per tile) a one-tile
    program spends much of its life starting, finding its expert and filling its pipeline; a run
    of tiles pays that once. Measured on an H200 (BENCHMARKS.md, eleventh session), GEMM2 alone,
    precise mode: DeepSeek-V3 M = 8192 944 -> 859 µs with runs of 8 (64-wide tiles, 4 warps),
    GLM-4.5V M = 8192 1001 -> 860 with runs of 4 of 128-wide tiles on 8 warps (942 with the
    table's 64-wide tiles, which runs made slower), GLM M = 4096 no gain: the tuner chooses
    (KernelConfig.N_TILES2). The same sums in the same order: bitwise equal to one tile per
    program. Flattening the two loops into one pipelined loop (tl.range(flatten=True)) was
    1.08-2.6x slower than one tile per program in every case measured."""
    if N_TILES == 1:
        _gemm2_tile(row0, e, pid_n, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, topk_weights_ptr, out_ptr,
                    sorted_ptr, count_ptr, start_ptr, N, H,
                    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                    A_MODE, B_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, PROMOTE, INTERPRET, PDL)
    elif KEEP_A_STEPS > 0:
        _gemm2_resident_run(row0, e, pid_n, n_count, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, topk_weights_ptr, out_ptr,
                            sorted_ptr, count_ptr, start_ptr, N, H,
                            stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                            A_MODE, B_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, KEEP_A_STEPS, PROMOTE, INTERPRET)
        _pdl_release(PDL)
    else:
        for j in range(0, n_count):
            _gemm2_tile(row0, e, pid_n + j, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, topk_weights_ptr, out_ptr,
                        sorted_ptr, count_ptr, start_ptr, N, H,
                        stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                        A_MODE, B_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, PROMOTE, INTERPRET, False)
        _pdl_release(PDL)


@triton.jit
def _gemm2_tile(
    row0, e, pid_n, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, topk_weights_ptr, out_ptr,
    sorted_ptr, count_ptr, start_ptr, N, H,
    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    A_MODE: tl.constexpr, B_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """GEMM2 of one tile: BLOCK_M rows from row0 (of expert e) by column block pid_n."""
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows - tl.load(start_ptr + e) < tl.load(count_ptr + e)

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
    b_ptrs = w_ptr + e64 * stride_we + cols[None, :] * stride_wn + ks[:, None]
    tensor_scale = _gemm2_tensor_scale(a_scale_ptr, A_MODE)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, N, BLOCK_K):
        k_ok = ks < N - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        a, step_a = _gemm2_a_step(a, a_scale_ptr, rows, row_ok, k0, stride_as, tensor_scale, A_MODE, BLOCK_K,
                                  INTERPRET)
        acc = _gemm2_accumulate(acc, a, step_a, b, w_scale_ptr, e64, pid_n, k0, stride_wse, stride_wsn,
                                A_MODE, B_SCALE, BLOCK_N, BLOCK_K, PROMOTE, INTERPRET)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    _pdl_release(PDL)
    _gemm2_store(acc, rows, row_ok, cols, col_ok, e64, a_scale_ptr, w_scale_ptr, topk_weights_ptr, out_ptr,
                 sorted_ptr, stride_as, stride_wse, stride_om, tensor_scale, A_MODE, B_SCALE, INTERPRET)


@triton.jit
def _gemm2_resident_run(
    row0, e, pid_n, n_count, a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, topk_weights_ptr, out_ptr,
    sorted_ptr, count_ptr, start_ptr, N, H,
    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    A_MODE: tl.constexpr, B_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, PROMOTE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """_gemm2_row_run's run of column tiles where GEMM2's whole inner dimension is K_STEPS (1 to
    6) steps of BLOCK_K (N <= 768 at BLOCK_K 128: DeepSeek-V3 at TP8 has 2, GLM-4.5V at TP2 and
    Qwen3-30B-A3B 6). The row block's A is loaded (and scaled or quantized) once, before the run,
    instead of once per column tile; the loop over the tiles is then the kernel's only loop, so
    Triton's pipeliner prefetches the next tiles' weights while a tile multiplies and stores, where
    one tile per K loop starts cold. At prefill the L2 serves every tile's A and B (an expert's
    weights are read once per row block): at DeepSeek-V3 M = 8192 that was about 3 GB of L2 reads
    beside 1.4 GB of HBM traffic. The products, their scales and the epilogue are _gemm2_tile's,
    in the same order: bitwise equal. Each step's A is a variable of its own (a0 .. a5: Triton
    keeps no list of tensors), each guarded by the compile-time step count."""
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows - tl.load(start_ptr + e) < tl.load(count_ptr + e)
    ks = tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    tensor_scale = _gemm2_tensor_scale(a_scale_ptr, A_MODE)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
    a0, s0 = _gemm2_kept_a(a_ptrs, a_scale_ptr, rows, row_ok, ks, N, 0, stride_as, tensor_scale, A_MODE, BLOCK_K,
                           INTERPRET)
    if K_STEPS > 1:
        a1, s1 = _gemm2_kept_a(a_ptrs, a_scale_ptr, rows, row_ok, ks, N, 1, stride_as, tensor_scale, A_MODE,
                               BLOCK_K, INTERPRET)
    if K_STEPS > 2:
        a2, s2 = _gemm2_kept_a(a_ptrs, a_scale_ptr, rows, row_ok, ks, N, 2, stride_as, tensor_scale, A_MODE,
                               BLOCK_K, INTERPRET)
    if K_STEPS > 3:
        a3, s3 = _gemm2_kept_a(a_ptrs, a_scale_ptr, rows, row_ok, ks, N, 3, stride_as, tensor_scale, A_MODE,
                               BLOCK_K, INTERPRET)
    if K_STEPS > 4:
        a4, s4 = _gemm2_kept_a(a_ptrs, a_scale_ptr, rows, row_ok, ks, N, 4, stride_as, tensor_scale, A_MODE,
                               BLOCK_K, INTERPRET)
    if K_STEPS > 5:
        a5, s5 = _gemm2_kept_a(a_ptrs, a_scale_ptr, rows, row_ok, ks, N, 5, stride_as, tensor_scale, A_MODE,
                               BLOCK_K, INTERPRET)
    for j in range(0, n_count):
        tile_n = pid_n + j
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < H
        b_ptrs = w_ptr + e64 * stride_we + cols[None, :] * stride_wn + ks[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _gemm2_kept_product(acc, a0, s0, b_ptrs, ks, N, col_ok, w_scale_ptr, e64, tile_n, 0, stride_wse,
                                  stride_wsn, A_MODE, B_SCALE, BLOCK_N, BLOCK_K, PROMOTE, INTERPRET)
        if K_STEPS > 1:
            acc = _gemm2_kept_product(acc, a1, s1, b_ptrs, ks, N, col_ok, w_scale_ptr, e64, tile_n, 1, stride_wse,
                                      stride_wsn, A_MODE, B_SCALE, BLOCK_N, BLOCK_K, PROMOTE, INTERPRET)
        if K_STEPS > 2:
            acc = _gemm2_kept_product(acc, a2, s2, b_ptrs, ks, N, col_ok, w_scale_ptr, e64, tile_n, 2, stride_wse,
                                      stride_wsn, A_MODE, B_SCALE, BLOCK_N, BLOCK_K, PROMOTE, INTERPRET)
        if K_STEPS > 3:
            acc = _gemm2_kept_product(acc, a3, s3, b_ptrs, ks, N, col_ok, w_scale_ptr, e64, tile_n, 3, stride_wse,
                                      stride_wsn, A_MODE, B_SCALE, BLOCK_N, BLOCK_K, PROMOTE, INTERPRET)
        if K_STEPS > 4:
            acc = _gemm2_kept_product(acc, a4, s4, b_ptrs, ks, N, col_ok, w_scale_ptr, e64, tile_n, 4, stride_wse,
                                      stride_wsn, A_MODE, B_SCALE, BLOCK_N, BLOCK_K, PROMOTE, INTERPRET)
        if K_STEPS > 5:
            acc = _gemm2_kept_product(acc, a5, s5, b_ptrs, ks, N, col_ok, w_scale_ptr, e64, tile_n, 5, stride_wse,
                                      stride_wsn, A_MODE, B_SCALE, BLOCK_N, BLOCK_K, PROMOTE, INTERPRET)
        _gemm2_store(acc, rows, row_ok, cols, col_ok, e64, a_scale_ptr, w_scale_ptr, topk_weights_ptr, out_ptr,
                     sorted_ptr, stride_as, stride_wse, stride_om, tensor_scale, A_MODE, B_SCALE, INTERPRET)


@triton.jit
def _gemm2_kept_a(a_ptrs, a_scale_ptr, rows, row_ok, ks, N, STEP: tl.constexpr, stride_as, tensor_scale,
                  A_MODE: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """K step STEP of a kept row block's A, loaded as _gemm2_tile loads it (columns past N read
    as 0), and its per-row scale (_gemm2_a_step)."""
    k0 = STEP * BLOCK_K
    a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & (ks < N - k0)[None, :], other=0.0)
    return _gemm2_a_step(a, a_scale_ptr, rows, row_ok, k0, stride_as, tensor_scale, A_MODE, BLOCK_K, INTERPRET)


@triton.jit
def _gemm2_kept_product(acc, a, step_a, b_ptrs, ks, N, col_ok, w_scale_ptr, e64, tile_n, STEP: tl.constexpr,
                        stride_wse, stride_wsn, A_MODE: tl.constexpr, B_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr, INTERPRET: tl.constexpr):
    """acc plus K step STEP's product of a kept A step with the tile's weights, loaded here."""
    k0 = STEP * BLOCK_K
    b = tl.load(b_ptrs + k0, mask=(ks < N - k0)[:, None] & col_ok[None, :], other=0.0)
    return _gemm2_accumulate(acc, a, step_a, b, w_scale_ptr, e64, tile_n, k0, stride_wse, stride_wsn,
                             A_MODE, B_SCALE, BLOCK_N, BLOCK_K, PROMOTE, INTERPRET)


@triton.jit
def _gemm2_tensor_scale(a_scale_ptr, A_MODE: tl.constexpr):
    """The intermediate's per-tensor scale (A_MODE 1: static, 3: from the shared amax), else 1."""
    tensor_scale = 1.0
    if A_MODE == 1:
        tensor_scale = tl.load(a_scale_ptr)
    elif A_MODE == 3:
        tensor_scale = _scale_from_amax(tl.load(a_scale_ptr))
    return tensor_scale


@triton.jit
def _gemm2_a_step(a, a_scale_ptr, rows, row_ok, k0, stride_as, tensor_scale,
                  A_MODE: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """A's K step from k0 as the tensor cores take it, and its per-row scale where the step has
    one of its own (A_MODE 2: quantized here per 1x128 group; 4: FP8 with group scales; else 1)."""
    step_a = tl.full((a.shape[0],), 1.0, tl.float32)
    if A_MODE == 2:
        a32 = a.to(tl.float32)
        step_a = _scale_from_amax(tl.max(tl.abs(a32), axis=1))  # [BLOCK_M]
        a = _quantize_tile(a32, step_a, INTERPRET)
    elif A_MODE == 4:
        step_a = tl.load(a_scale_ptr + rows.to(tl.int64) * stride_as + k0 // BLOCK_K, mask=row_ok, other=0.0)
    elif A_MODE == 3:
        a = _quantize_tile(a.to(tl.float32), tl.full((a.shape[0],), 1.0, tl.float32) * tensor_scale, INTERPRET)
    return a, step_a


@triton.jit
def _gemm2_accumulate(acc, a, step_a, b, w_scale_ptr, e64, pid_n, k0, stride_wse, stride_wsn,
                      A_MODE: tl.constexpr, B_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PROMOTE: tl.constexpr, INTERPRET: tl.constexpr):
    """acc plus one K step's product: scaled by the step's scales where it has its own (A_MODE 2
    and 4, with a 128x128 weight block's scale for B_SCALE 3), else by the compiler's promotion."""
    if A_MODE == 2 or A_MODE == 4:
        step_b = 1.0
        if B_SCALE == 3:
            step_b = tl.load(w_scale_ptr + e64 * stride_wse + (pid_n * BLOCK_N // 128) * stride_wsn + k0 // BLOCK_K)
        acc += _dot(a, b, None, 0, INTERPRET) * (step_a[:, None] * step_b)  # see gemm1_kernel
    else:
        acc = _dot(a, b, acc, PROMOTE, INTERPRET)
    return acc


@triton.jit
def _gemm2_store(acc, rows, row_ok, cols, col_ok, e64, a_scale_ptr, w_scale_ptr, topk_weights_ptr, out_ptr,
                 sorted_ptr, stride_as, stride_wse, stride_om, tensor_scale,
                 A_MODE: tl.constexpr, B_SCALE: tl.constexpr, INTERPRET: tl.constexpr):
    """GEMM2's epilogue: the scales not applied per K step, the pair's top-k weight, and the
    store to each pair's own row."""
    if A_MODE == 1 or A_MODE == 3:
        acc *= tensor_scale
    elif A_MODE == 5:
        acc *= tl.load(a_scale_ptr + rows.to(tl.int64) * stride_as, mask=row_ok, other=0.0)[:, None]
    if B_SCALE == 1:
        acc *= tl.load(w_scale_ptr + e64 * stride_wse)
    elif B_SCALE == 2:
        acc *= tl.load(w_scale_ptr + e64 * stride_wse + cols, mask=col_ok, other=0.0)[None, :]

    pair = tl.load(sorted_ptr + rows, mask=row_ok, other=0)
    acc *= tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, _to_dtype(acc, out_ptr.dtype.element_ty, INTERPRET), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def quantize_sorted_rows_kernel(
    x_ptr,  # (rows, N) bf16/fp16 GEMM1 output in sorted-row order
    q_ptr,  # (rows, N) fp8 out
    scale_ptr,  # (rows,) float32 out: one scale per row
    count_ptr, start_ptr, E, N, stride_x, stride_q,
    E_POW2: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """The intermediate quantized with one scale per row (the per-token rule), one program per
    row, real rows only: padding rows and rows past the last expert's are never read by GEMM2
    (its loads mask them), so they are skipped rather than quantized from uninitialised memory."""
    _pdl_enter(PDL)
    row = tl.program_id(0)
    if row >= tl.load(start_ptr + E):
        return
    e = _expert_of_block(start_ptr, row, E, E_POW2)
    if row - tl.load(start_ptr + e) >= tl.load(count_ptr + e):
        return
    _quantize_row(row.to(tl.int64), 0, x_ptr, q_ptr, scale_ptr, scale_ptr, N, stride_x, stride_q, 0,
                  0, False, BLOCK_H, 128, INTERPRET)


# --------------------------------------------------------------------------- combine


@triton.jit
def combine_kernel(
    pairs_ptr,  # (M*K, H) weighted expert outputs
    out_ptr,  # (M, H)
    H, K_TOP: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """out[t] = sum over j of pairs[t*K + j], in float32 and in j order: deterministic."""
    _pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(K_TOP):
        acc += tl.load(pairs_ptr + (token * K_TOP + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + cols, _to_dtype(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)
