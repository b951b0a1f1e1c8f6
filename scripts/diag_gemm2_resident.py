"""Experiment: GEMM2 for short inner dimensions with the A rows resident in shared memory.

At prefill GEMM2's inner dimension (the intermediate) is short on many-expert shapes: 256 for
DeepSeek-V3 at TP8 (2 K steps), 704 for GLM-4.5V at TP2, 768 for Qwen3-30B-A3B. The backend's
Triton GEMM2 (even with runs of column tiles, KernelConfig.N_TILES2) reloads a tile's A rows
for every column tile and fills and drains its pipeline per tile. Here one program owns a row
block and a run of RUN column tiles: it loads the row block's whole A (K_STEPS x 128 columns)
into shared memory once, then streams only w2's tiles through a ring of STAGES buffers whose
loads run on across column tiles (the next tile's first K steps load during this tile's last
steps and epilogue). Each K step's product is scaled and added as _kernels._gemm2_tile does, so
the output must be bitwise the Triton GEMM2's: the script checks it, then times both, GEMM2 alone,
on the intermediate the table's config produces.

    cd scripts && PYTHONPATH=.. python3 diag_gemm2_resident.py [--points deepseek-v3:8:8192 ...]
        [--launches 128:8:4:8 ...]

Not part of the backend: if it wins, it moves into _gluon_kernels.py behind a config field.
"""
import argparse

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from moekit.backends.triton import launch
from moekit.backends.triton._gluon_kernels import _async_load, _expert_rows, _promote, _tile_rows
from moekit.backends.triton.config import get_config
from moekit.inputs import make_weights, make_x, uniform_routing
from moekit.timing import time_graphs

from diag_points import parse_point  # scripts/ is on the path when a script runs

POINTS = ["deepseek-v3:8:8192", "glm-4.5v-fp8:2:4096", "qwen3-30b-a3b-fp8:1:4096"]


@gluon.jit
def _load_b(b_smem, b_base, cols, ks, i, total, first_n, N, H, stride_wn,
            BLOCK_N: gl.constexpr, K_STEPS: gl.constexpr, STAGES: gl.constexpr):
    """cp.async of pipeline step i's w2 tile (column tile first_n + i // K_STEPS, K step
    i % K_STEPS) into its stage, masked past H and past N (zero-filled, as the Triton kernel's
    masked loads); past the run's end an empty group, so that wait_group counts stay aligned."""
    if i < total:
        k = i % K_STEPS
        col = (first_n + i // K_STEPS) * BLOCK_N + cols
        mask = (col < H)[:, None] & (k * 128 + ks < N)[None, :]
        ptrs = b_base + gl.minimum(col, H - 1).to(gl.int64)[:, None] * stride_wn + k * 128
        _async_load(b_smem.index(i % STAGES), ptrs, mask=mask)
    cp.commit_group()


@gluon.jit
def gemm2_resident_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, topk_weights_ptr, out_ptr,
    sorted_ptr, count_ptr, start_ptr,
    E, N, H,
    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    B_SCALE: gl.constexpr, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    K_STEPS: gl.constexpr, RUN: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    BLOCK_K: gl.constexpr = 128
    num_n_blocks = gl.cdiv(H, BLOCK_N)
    runs = gl.cdiv(num_n_blocks, RUN)
    pid = gl.program_id(0)
    pid_m = pid // runs
    first_n = (pid % runs) * RUN
    if pid_m >= gl.cdiv(gl.load(start_ptr + E), BLOCK_M):
        return  # the grid is sized for the worst routing
    n_count = gl.minimum(num_n_blocks - first_n, RUN)
    row0 = pid_m * BLOCK_M
    e64, first_row, real_rows = _expert_rows(start_ptr, count_ptr, row0, E, E_POW2, num_warps)

    load_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (BLOCK_K // 16), BLOCK_K // 16], [num_warps, 1], [1, 0])
    ks, rows, row_ok = _tile_rows(row0, first_row, real_rows, BLOCK_M, BLOCK_K, load_layout)
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [K_STEPS, BLOCK_M, BLOCK_K], a_layout)
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], b_layout)

    # the row block's whole A, once (the oldest cp.async group)
    a_rows = a_ptr + rows.to(gl.int64)[:, None] * stride_am + ks[None, :]
    for ka in gl.static_range(K_STEPS):
        _async_load(a_smem.index(ka), a_rows + ka * BLOCK_K, mask=row_ok[:, None] & (ka * BLOCK_K + ks < N)[None, :])
    cp.commit_group()
    cols = gl.arange(0, BLOCK_N, gl.SliceLayout(1, load_layout))
    b_base = w_ptr + e64 * stride_we + ks[None, :]
    total = n_count * K_STEPS
    for first in gl.static_range(STAGES - 1):
        _load_b(b_smem, b_base, cols, ks, first, total, first_n, N, H, stride_wn, BLOCK_N, K_STEPS, STAGES)

    WARPS_M: gl.constexpr = 4 * (BLOCK_M // 64)
    WARPS_N: gl.constexpr = num_warps // WARPS_M
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N],
                                                         instr_shape=[16, BLOCK_N // WARPS_N, 32])
    m_rows = row0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, mma_layout))
    m_row_ok = m_rows - first_row < real_rows
    pair = gl.load(sorted_ptr + m_rows, mask=m_row_ok, other=0)
    weight = gl.load(topk_weights_ptr + pair, mask=m_row_ok, other=0.0)
    out_rows = out_ptr + pair.to(gl.int64)[:, None] * stride_om
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
    for t in range(n_count):
        col0 = (first_n + t) * BLOCK_N
        acc = zero
        for k in gl.static_range(K_STEPS):
            i = t * K_STEPS + k
            cp.wait_group(STAGES - 2)
            fence_async_shared()
            product = warpgroup_mma(a_smem.index(k), b_smem.index(i % STAGES).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)
            product = warpgroup_mma_wait(num_outstanding=0, deps=(product, ))
            acc = _promote(acc, product, k, a_scale_ptr, w_scale_ptr, m_rows.to(gl.int64), m_row_ok, e64, col0, N,
                           stride_as, stride_wse, stride_wsn, 3, B_SCALE, BLOCK_N, False, mma_layout)
            _load_b(b_smem, b_base, cols, ks, i + STAGES - 1, total, first_n, N, H, stride_wn, BLOCK_N, K_STEPS, STAGES)
        # _kernels._gemm2_tile's epilogue, in its order
        m_cols = col0 + gl.arange(0, BLOCK_N, gl.SliceLayout(0, mma_layout))
        col_ok = m_cols < H
        if B_SCALE == 2:
            acc = acc * gl.load(w_scale_ptr + e64 * stride_wse + m_cols, mask=col_ok, other=0.0)[None, :]
        acc = acc * weight[:, None]
        gl.store(out_rows + m_cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_row_ok[:, None] & col_ok[None, :])
    cp.wait_group(0)


def resident_gemm2(act, w, align, topk_weights, out_dtype, block_m, block_n, warps, stages, run):
    """Launch the kernel above on GEMM1's intermediate (A_MODE 4 only)."""
    assert act.a_mode == 4, "the intermediate must be FP8 with 1x128 group scales"
    E, N, H = w.num_experts, w.n, w.hidden
    values = act.values
    out = torch.empty(align.num_pairs, H, dtype=out_dtype, device=values.device)
    w_scale = w.w2_scale
    stride_wse, stride_wsn = launch._scale_strides(w_scale)
    runs = triton.cdiv(triton.cdiv(H, block_n), run)
    grid = (triton.cdiv(align.max_rows, block_m) * runs,)
    gemm2_resident_kernel[grid](
        values, act.scale, w.w2, w_scale, topk_weights.reshape(-1).contiguous(), out,
        align.sorted_pairs, align.count, align.start, E, N, H,
        values.stride(0), act.scale.stride(0), w.w2.stride(0), w.w2.stride(1), stride_wse, stride_wsn, out.stride(0),
        B_SCALE=launch.B_SCALE_KIND[w.scheme.weight], E_POW2=triton.next_power_of_2(E),
        BLOCK_M=block_m, BLOCK_N=block_n, K_STEPS=triton.cdiv(N, 128), RUN=run, STAGES=stages, num_warps=warps,
    )
    return out


def launches(block_m):
    """(BLOCK_N, warps, stages, RUN) tried at a row height: 64 rows on one warpgroup, 128 rows on
    two (64 x 256 on two warpgroups spilled registers with 6 K steps, without a GPU: not tried);
    block scales need tiles within one 128-column block, so BLOCK_N stays at most 128."""
    if block_m == 64:
        return [(128, 4, 4, 8), (128, 4, 4, 32), (64, 4, 4, 32), (128, 4, 3, 32)]
    return [(128, 8, 4, 8), (128, 8, 4, 32), (128, 8, 3, 32)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", default=POINTS, help="model:tp:M[:scheme]")
    ap.add_argument("--launches", nargs="+", help="BLOCK_N:warps:stages:RUN each (default: launches())")
    args = ap.parse_args()
    chosen = [tuple(int(v) for v in item.split(":")) for item in args.launches] if args.launches else None
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    for point in args.points:
        (model, tp, preset, scheme), M = parse_point(point)
        shape = preset.shape
        torch.cuda.empty_cache()
        w = make_weights(shape, scheme, dev)
        M = int(M)
        E, K, H = shape.num_experts, shape.top_k, shape.hidden
        x = make_x(M, H, dev)
        tw, ids = uniform_routing(M, E, K)
        tw, ids = tw.to(dev).float(), ids.to(dev)
        a, a_scale = launch.quantize_input(x, w)
        cfg = get_config(shape, scheme, M, name)
        align = launch.align_pairs(ids, E, cfg.BLOCK_M)
        act = launch.gemm1(a, a_scale, w, align, K, x.dtype, cfg)
        base = launch.gemm2(act, w, align, tw, x.dtype, cfg)
        fns = {"table GEMM2 (Triton)": lambda: launch.gemm2(act, w, align, tw, x.dtype, cfg)}
        print(f"\n{model} tp{tp} M={M} {scheme.name}: table {cfg}", flush=True)
        for bn, warps, stages, run in chosen or launches(cfg.BLOCK_M):
            label = f"resident M{cfg.BLOCK_M} N{bn} w{warps} s{stages} run{run}"
            def fn(bn=bn, warps=warps, stages=stages, run=run):
                return resident_gemm2(act, w, align, tw, x.dtype, cfg.BLOCK_M, bn, warps, stages, run)
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            if not torch.equal(out, base):
                diff = (out.float() - base.float()).abs().max().item()
                print(f"  {label}: OUTPUT DIFFERS (max |diff| {diff:.3g})", flush=True)
                continue
            fns[label] = fn
        times = time_graphs(fns, reps=20, warmup=2, rounds=3)
        for label, t in times.items():
            if isinstance(t, BaseException):
                print(f"  {label:42s} FAILED {str(t)[:100]}")
                continue
            print(f"  {label:42s} {t.median_us:9.1f} us (p20 {t.p20_us:.1f} p80 {t.p80_us:.1f})", flush=True)
        del fns, times


if __name__ == "__main__":
    main()
