"""Triton kernels of the triton backend's GEMV path (KernelConfig.GEMV = 1 or 2; launched by gemv.py).

At decode sizes a layer reads each used expert's weights once and does almost no arithmetic, so
its time is launches and how many bytes are in flight, not tensor-core work. This path has no
alignment, no padded row tiles and no combine pass: GEMM1 runs one program per (pair, column
block), reading the pair's activation row and its expert's weight rows directly; GEMM2 runs one
program per (token, column block), reads the token's K experts side by side and sums their
outputs by one fixed reduction (deterministic without atomics). Products are summed in float32
on the CUDA cores (an FP8 x FP8 product is exact in float32), so no tensor-core accumulator
narrows them.

Loads not feeding a tl.dot get no multi-stage pipeline from Triton unless their loop asks for one
(tl.range(num_stages=STAGES), the config's num_stages: Triton then copies the next steps' tiles into
shared memory ahead, cp.async; 1 pipelines nothing; the sums
and their order are the same either way, so are the bits). Otherwise the bytes in flight come
from wide K steps: each step reads BLOCK_K = GROUPS x 128 columns of K, addressed as GROUPS rows
of 128 (one scale each where scales change along K: 1x128 activation groups, 128x128 weight
blocks), and reduces them at once. A probe on an H200 (BENCHMARKS.md, sixth session): GEMM1 of
GLM-4.5V at M = 1 took 22.4 µs with 4 columns x 512 of K per step, 28.6 with 16 x 256, and 31
with 16 x 128 (the step of the tensor-core tiles), against 25.4 for the tiled GEMM1.

GEMM1 reduces its products one of two ways, the config's GEMV value: 1 sums each K step across
its 128-wide rows before adding it (_gemv1_step_sums), 2 adds the products elementwise into
[BLOCK_N, BLOCK_K] accumulators and reduces once after the loop (_gemv1_late_sums). On an H100
(BENCHMARKS.md, thirty-second session) GEMM1 alone ran 4% faster the second way at GLM-4.5V M = 1
(26.2 against the table's 27.3 µs; scripts/diag_gemv1_reduce.py) and 2.3% at Mixtral M = 1, within
0.6-1.3 µs of a bare read of the same weights; as whole layers in the tuner's decision timing it won
by 0.4-1.8% at four decode sizes and lost at the others, so the tuner times both.

Scale kinds as in _kernels.py (A_SCALE, B_SCALE); GEMM2's A_MODE as gemm2_kernel's, except that
5 (one scale per row) computes the row's scale itself from the bf16/fp16 intermediate.
"""

import triton
import triton.language as tl

from ..glue._kernels import _atomic_amax, _magnitude_bits, _scale_from_amax
from ._kernels import _check_expert_ids, _pdl_enter, _quantize_tile, _to_dtype


@triton.jit
def _k_steps(GROUPS: tl.constexpr):
    """Offsets of one K step as a [GROUPS, 128] tile, and the group index of each row."""
    groups = tl.arange(0, GROUPS)
    return groups[:, None] * 128 + tl.arange(0, 128)[None, :], groups


@triton.jit
def _gemv1_step_sums(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, token, e, pid_n, cols, col_ok, N, H,
                     stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn,
                     A_SCALE: tl.constexpr, B_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                     STAGES: tl.constexpr):
    """GEMM1's gate and up sums of one program ([BLOCK_N] each, before the per-tensor and
    per-channel scales) with each K step reduced across its 128-wide rows before it is added
    (GEMV=1): few registers per sum, a cross-thread reduction per step."""
    k_offs, groups = _k_steps(GROUPS)
    a_ptrs = a_ptr + token * stride_am + k_offs
    gate_ptrs = w_ptr + e * stride_we + cols[:, None, None] * stride_wn + k_offs[None, :, :]
    up_ptrs = gate_ptrs + N * stride_wn
    g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in tl.range(0, H, GROUPS * 128, num_stages=STAGES):
        k_ok = k_offs < H - k0
        a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)[None, :, :]
        w_ok = col_ok[:, None, None] & k_ok[None, :, :]
        g_parts = tl.sum(tl.load(gate_ptrs, mask=w_ok, other=0.0).to(tl.float32) * a, axis=2)  # [BLOCK_N, GROUPS]
        u_parts = tl.sum(tl.load(up_ptrs, mask=w_ok, other=0.0).to(tl.float32) * a, axis=2)
        if A_SCALE == 3 or B_SCALE == 3:  # scales that change with each 128 of K: one per group
            group_ok = groups * 128 < H - k0
            step_gate = tl.full((GROUPS,), 1.0, tl.float32)
            if A_SCALE == 3:
                step_gate = tl.load(a_scale_ptr + token * stride_as + k0 // 128 + groups, mask=group_ok, other=0.0)
            step_up = step_gate
            if B_SCALE == 3:
                ws = w_scale_ptr + e * stride_wse + k0 // 128 + groups
                step_gate *= tl.load(ws + (pid_n * BLOCK_N // 128) * stride_wsn, mask=group_ok, other=0.0)
                step_up *= tl.load(ws + ((N + pid_n * BLOCK_N) // 128) * stride_wsn, mask=group_ok, other=0.0)
            g += tl.sum(g_parts * step_gate[None, :], axis=1)
            u += tl.sum(u_parts * step_up[None, :], axis=1)
        else:
            g += tl.sum(g_parts, axis=1)
            u += tl.sum(u_parts, axis=1)
        a_ptrs += GROUPS * 128
        gate_ptrs += GROUPS * 128
        up_ptrs += GROUPS * 128
    return g, u


@triton.jit
def _gemv1_late_sums(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, token, e, pid_n, cols, col_ok, N, H,
                     stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn,
                     A_SCALE: tl.constexpr, B_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr):
    """The same sums with each product added elementwise into [BLOCK_N, BLOCK_K] float32
    accumulators and one reduction after the K loop (GEMV=2): no cross-thread sums inside the
    loop, at the cost of BLOCK_N x BLOCK_K / threads registers per accumulator (the search space
    caps them, space.GEMV_LATE_MAX_VALUES_PER_THREAD). Scales that change every 128 of K (1x128
    activation groups, 128x128 weight blocks) multiply the activation row before the product,
    each column of it by its own group's scale."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + token * stride_am + ks
    gate_ptrs = w_ptr + e * stride_we + cols[:, None] * stride_wn + ks[None, :]
    up_ptrs = gate_ptrs + N * stride_wn
    g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        k_ok = ks < H - k0
        a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        w_ok = col_ok[:, None] & k_ok[None, :]
        gate = tl.load(gate_ptrs, mask=w_ok, other=0.0).to(tl.float32)
        up = tl.load(up_ptrs, mask=w_ok, other=0.0).to(tl.float32)
        a_gate = a
        if A_SCALE == 3:  # each column's 1x128 group scale
            a_gate = a * tl.load(a_scale_ptr + token * stride_as + (k0 + ks) // 128, mask=k_ok, other=0.0)
        a_up = a_gate
        if B_SCALE == 3:  # the 128x128 weight block of these columns (BLOCK_N divides 128), gate's and up's
            ws = w_scale_ptr + e * stride_wse + (k0 + ks) // 128
            a_gate = a_gate * tl.load(ws + (pid_n * BLOCK_N // 128) * stride_wsn, mask=k_ok, other=0.0)
            a_up = a_up * tl.load(ws + ((N + pid_n * BLOCK_N) // 128) * stride_wsn, mask=k_ok, other=0.0)
        g += gate * a_gate[None, :]
        u += up * a_up[None, :]
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    return tl.sum(g, axis=1), tl.sum(u, axis=1)


@triton.jit
def gemv1_kernel(
    a_ptr,  # (M, H) fp8 or bf16/fp16 activations
    a_scale_ptr,  # (1,) | (M,) | (M, ceil(H/128)) float32
    w_ptr,  # (E, 2N, H) weights, gate rows then up rows
    w_scale_ptr,  # (E,) | (E, 2N) | (E, 2N/128, ceil(H/128)) float32
    out_ptr,  # (P, N) SiLU(gate) * up of each pair, in pair order: bf16/fp16, or fp8 (OUT_MODE 2)
    out_scale_ptr,  # (1,) static scale of the output (OUT_MODE 2)
    amax_ptr,  # (1,) shared maximum of |output| (OUT_MODE 1)
    ids_ptr,  # (P,) expert of each pair
    E, N, H, K_TOP,
    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    A_SCALE: tl.constexpr, B_SCALE: tl.constexpr, OUT_MODE: tl.constexpr, ACT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, STAGES: tl.constexpr, INTERPRET: tl.constexpr,
    CHECK_IDS: tl.constexpr, PDL: tl.constexpr, LATE: tl.constexpr,
):
    """OUT_MODE: 0 store in the activations' dtype, 1 also record amax, 2 quantize with the static
    scale. Weight tiles are [BLOCK_N, GROUPS, 128] with K contiguous, as w13 is stored."""
    _pdl_enter(PDL)
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = (pair // K_TOP).to(tl.int64)
    e = tl.load(ids_ptr + pair)
    _check_expert_ids(e, 1, E, CHECK_IDS)
    e = e.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if LATE:
        g, u = _gemv1_late_sums(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, token, e, pid_n, cols, col_ok, N, H,
                                stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn,
                                A_SCALE, B_SCALE, BLOCK_N, GROUPS * 128, STAGES)
    else:
        g, u = _gemv1_step_sums(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, token, e, pid_n, cols, col_ok, N, H,
                                stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn,
                                A_SCALE, B_SCALE, BLOCK_N, GROUPS, STAGES)

    if A_SCALE == 1:
        a_s = tl.load(a_scale_ptr)
        g *= a_s
        u *= a_s
    elif A_SCALE == 2:
        a_s = tl.load(a_scale_ptr + token)
        g *= a_s
        u *= a_s
    if B_SCALE == 1:
        b_s = tl.load(w_scale_ptr + e * stride_wse)
        g *= b_s
        u *= b_s
    elif B_SCALE == 2:
        ws = w_scale_ptr + e * stride_wse
        g *= tl.load(ws + cols, mask=col_ok, other=0.0)
        u *= tl.load(ws + N + cols, mask=col_ok, other=0.0)

    # SiLU(gate) * up, rounded to the activations' dtype as the reference defines it
    act = _to_dtype(g / (1.0 + tl.exp(-g)) * u, ACT_DTYPE, INTERPRET)
    out_ptrs = out_ptr + pair.to(tl.int64) * stride_om + cols
    if OUT_MODE == 1:
        _atomic_amax(amax_ptr, tl.max(tl.where(col_ok, _magnitude_bits(act.to(tl.float32)), 0), axis=0))
    if OUT_MODE == 2:
        static = tl.full((1,), 1.0, tl.float32) * tl.load(out_scale_ptr)
        q = _quantize_tile(act.to(tl.float32)[None, :], static, INTERPRET)  # a [1, BLOCK_N] tile
        tl.store(out_ptrs[None, :], q, mask=col_ok[None, :])
    else:
        tl.store(out_ptrs, act, mask=col_ok)


@triton.jit
def gemv2_kernel(
    a_ptr,  # (P, N) intermediate in pair order: bf16/fp16, or fp8 (A_MODE 1)
    a_scale_ptr,  # (1,) static scale (A_MODE 1) or shared amax (A_MODE 3)
    w_ptr,  # (E, H, N)
    w_scale_ptr,  # (E,) | (E, H) | (E, ceil(H/128), ceil(N/128)) float32
    topk_weights_ptr,  # (P,) float32
    ids_ptr,  # (P,) expert of each pair
    out_ptr,  # (M, H) the layer's output
    N, H,
    stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    A_MODE: tl.constexpr, B_SCALE: tl.constexpr, K_TOP: tl.constexpr, K_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, STAGES: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (token, column block of H): the token's K pairs side by side in every
    tile, each step reading GROUPS 128-groups of N for each pair (rows = K_POW2 x GROUPS, pair
    major), so a program keeps all its experts' bytes in flight at once. Measured on an H200
    (BENCHMARKS.md, seventh session) against walking the pairs one after the other: GLM-4.5V M = 1
    39.9 against 50.6 µs per layer, DeepSeek-V3 M = 1 40.7 against 47.1.

    A_MODE: 0 unquantized, 1 FP8 with a static scale, 2 quantize per 1x128 group while loading,
    3 quantize per tensor while loading (scale from the shared amax), 5 quantize per row while
    loading (each row's scale from its own |max| first). Each pair's weighted output is rounded to
    the output dtype before the K are summed, as the tiled path stores pairs before its combine;
    the sum is one fixed reduction (the same bits every run)."""
    _pdl_enter(PDL)
    ROWS: tl.constexpr = K_POW2 * GROUPS
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    j = tl.arange(0, K_POW2)  # the token's pairs
    pair_ok = j < K_TOP
    pair = token * K_TOP + j
    e = tl.load(ids_ptr + pair, mask=pair_ok, other=0).to(tl.int64)  # [K_POW2]
    # each row of a step: one pair's one 128-group
    row_pair = tl.arange(0, ROWS) // GROUPS
    row_ok = row_pair < K_TOP
    row_e = tl.load(ids_ptr + token * K_TOP + row_pair, mask=row_ok, other=0).to(tl.int64)
    row_k = (tl.arange(0, ROWS) % GROUPS) * 128
    ks = tl.arange(0, 128)
    k_offs = row_k[:, None] + ks[None, :]  # [ROWS, 128]: K offset within the step
    a_ptrs = a_ptr + (token * K_TOP + row_pair)[:, None] * stride_am + k_offs
    w_ptrs = w_ptr + row_e[:, None, None] * stride_we + cols[None, :, None] * stride_wn + k_offs[:, None, :]
    w_rows_ok = row_ok[:, None, None] & col_ok[None, :, None]

    scale = tl.full((K_POW2,), 1.0, tl.float32)  # the per-tensor or per-row scale of each pair
    if A_MODE == 1:
        scale *= tl.load(a_scale_ptr)
    elif A_MODE == 3:
        scale *= _scale_from_amax(tl.load(a_scale_ptr))
    elif A_MODE == 5:  # each row's own |max| first
        amax = tl.zeros((ROWS, 128), dtype=tl.float32)
        for k0 in range(0, N, GROUPS * 128):
            ok = row_ok[:, None] & (k_offs < N - k0)
            amax = tl.maximum(amax, tl.abs(tl.load(a_ptrs + k0, mask=ok, other=0.0).to(tl.float32)))
        scale = _scale_from_amax(tl.max(tl.reshape(tl.max(amax, axis=1), (K_POW2, GROUPS)), axis=1))
    row_scale = tl.reshape(tl.broadcast_to(scale[:, None], (K_POW2, GROUPS)), (ROWS,))

    y = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, N, GROUPS * 128, num_stages=STAGES):
        k_ok = k_offs < N - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok, other=0.0).to(tl.float32)  # [ROWS, 128]
        w = tl.load(w_ptrs, mask=w_rows_ok & k_ok[:, None, :], other=0.0).to(tl.float32)
        step = tl.full((ROWS,), 1.0, tl.float32)  # what each row's partial sum is scaled by
        if A_MODE == 2:
            step = _scale_from_amax(tl.max(tl.abs(a), axis=1))  # one scale per 1x128 group
            a = _quantize_tile(a, step, INTERPRET).to(tl.float32)
        elif A_MODE == 3 or A_MODE == 5:
            a = _quantize_tile(a, row_scale, INTERPRET).to(tl.float32)
        if B_SCALE == 3:
            group_ok = row_ok & (row_k < N - k0)
            step *= tl.load(w_scale_ptr + row_e * stride_wse + (pid_n * BLOCK_N // 128) * stride_wsn + (k0 + row_k) // 128,
                            mask=group_ok, other=0.0)
        parts = tl.sum(w * a[:, None, :], axis=2)  # [ROWS, BLOCK_N]
        if A_MODE == 2 or B_SCALE == 3:
            y += parts * step[:, None]
        else:
            y += parts
        a_ptrs += GROUPS * 128
        w_ptrs += GROUPS * 128
    y_pairs = tl.sum(tl.reshape(y, (K_POW2, GROUPS, BLOCK_N)), axis=1)  # [K_POW2, BLOCK_N]
    if A_MODE == 1 or A_MODE == 3 or A_MODE == 5:
        y_pairs *= scale[:, None]
    if B_SCALE == 1:
        y_pairs *= tl.load(w_scale_ptr + e * stride_wse, mask=pair_ok, other=0.0)[:, None]
    elif B_SCALE == 2:
        y_pairs *= tl.load(w_scale_ptr + e[:, None] * stride_wse + cols[None, :],
                           mask=pair_ok[:, None] & col_ok[None, :], other=0.0)
    y_pairs *= tl.load(topk_weights_ptr + pair, mask=pair_ok, other=0.0)[:, None]
    rounded = _to_dtype(y_pairs, out_ptr.dtype.element_ty, INTERPRET).to(tl.float32)  # as the tiled path stores pairs
    total = tl.sum(tl.where(pair_ok[:, None], rounded, 0.0), axis=0)
    tl.store(out_ptr + token * stride_om + cols, _to_dtype(total, out_ptr.dtype.element_ty, INTERPRET), mask=col_ok)
