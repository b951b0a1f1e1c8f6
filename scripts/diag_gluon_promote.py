"""Can FP8 promotion overlap the tensor cores? A dense FP8 GEMM in Gluon (Triton's lower-level
language, which exposes wgmma's asynchrony) against the same GEMM in Triton's tl.dot.

Precise mode adds each BLOCK_K-long FP8 product into a float32 accumulator (the tensor cores'
own FP8 accumulator keeps fewer mantissa bits). Triton 3.6 lowers `max_num_imprecise_acc` to
"issue the product, wait for it, add it": the tensor cores idle while the warps add. In Gluon the
product of step k can be issued before the product of step k - 1 is added, so the add runs while
the tensor cores work. This script measures whether that closes the gap to fast mode, on one
dense GEMM C = (A @ B^T) * row_scale * col_scale in bf16 (fp8-channel-token's numerics), before
any of it goes into the MoE kernels:

    PYTHONPATH=. python3 scripts/diag_gluon_promote.py [--shapes 8192x28672x4096 ...] [--json F]
    python3 scripts/diag_gluon_promote.py --compile-only      # compile for sm90, no GPU needed

Kernels, all 128x128x128 tiles, 8 warps, grouped tile order:
  tl fast      tl.dot accumulating all of K in the tensor cores (vLLM's numerics)
  tl precise   tl.dot with max_num_imprecise_acc = BLOCK_K (moekit's precise mode today)
  gl fast      the Gluon kernel, one accumulator carried through wgmma
  gl wait      the Gluon kernel, each product waited for and added at once (what Triton emits)
  gl overlap   the Gluon kernel, product k - 1 added while product k runs
"""
import argparse
import json

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)

FAST, WAIT, OVERLAP = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)
# cp.async into shared memory: `async_copy_global_to_shared` in triton 3.6, `async_load` by 3.9
_async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared


@gluon.jit
def _tile_origin(M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """Grouped tile order: GROUP_M row blocks sweep the columns together, so B tiles stay in L2."""
    pid = gl.program_id(0)
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows = gl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@gluon.jit
def _issue_loads(a_bufs, b_bufs, a_ptrs, b_ptrs, k_step, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    stage = k_step % STAGES
    _async_load(a_bufs.index(stage), a_ptrs + k_step * BLOCK_K)
    _async_load(b_bufs.index(stage), b_ptrs + k_step * BLOCK_K)


@gluon.jit
def _product(a_bufs, b_bufs, zero, k_step, STAGES: gl.constexpr):
    """Issue step k_step's product into registers of its own (the accumulator is not read)."""
    stage = k_step % STAGES
    cp.wait_group(STAGES - 2)
    fence_async_shared()
    return warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), zero, use_acc=False,
                         is_async=True)


@gluon.jit
def _refill(a_bufs, b_bufs, a_ptrs, b_ptrs, k_step, k_steps, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """After step k_step's product was issued and the one before it waited for, the stage that one
    read is free: load step k_step + STAGES - 1 into it (an empty group past the end keeps the
    wait_group count right)."""
    if k_step + STAGES - 1 < k_steps:
        _issue_loads(a_bufs, b_bufs, a_ptrs, b_ptrs, k_step + STAGES - 1, BLOCK_K, STAGES)
    cp.commit_group()


@gluon.jit
def gl_fp8_gemm(a_ptr, b_ptr, c_ptr, row_scale_ptr, col_scale_ptr, M, N, K,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                GROUP_M: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr,
                num_warps: gl.constexpr):
    """C[M, N] = (A[M, K] @ B[N, K]^T) * row_scale[:, None] * col_scale[None, :]; K a multiple of
    BLOCK_K and at least STAGES - 1 steps long, rows and columns clamped (not masked) at the edge."""
    off_m, off_n = _tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # 16-byte cp.async vectors along K: BLOCK_K / 16 threads cover a row, the rest of the warp
    # takes further rows.
    load_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (BLOCK_K // 16), BLOCK_K // 16],
                                                 [num_warps, 1], [1, 0])
    rows = gl.minimum(off_m + gl.arange(0, BLOCK_M, gl.SliceLayout(1, load_layout)), M - 1)
    cols = gl.minimum(off_n + gl.arange(0, BLOCK_N, gl.SliceLayout(1, load_layout)), N - 1)
    ks = gl.arange(0, BLOCK_K, gl.SliceLayout(0, load_layout))
    a_ptrs = a_ptr + rows.to(gl.int64)[:, None] * K + ks[None, :]
    b_ptrs = b_ptr + cols.to(gl.int64)[:, None] * K + ks[None, :]

    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], b_layout)

    # One warpgroup per 64 rows; instruction N as wide as the tile.
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
    k_steps = K // BLOCK_K

    for i in gl.static_range(STAGES - 1):
        _issue_loads(a_bufs, b_bufs, a_ptrs, b_ptrs, i, BLOCK_K, STAGES)
        cp.commit_group()

    if MODE == OVERLAP:
        # Two products alternate: while the warps add one into float32, the tensor cores run the
        # other. The loop is unrolled by two so that the product in flight across the loop's
        # back edge is always the same variable: a copy of a product still being written (which
        # a single loop's `prev = product` needs) makes ptxas serialize every wgmma.
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
        odd = _product(a_bufs, b_bufs, zero, 0, STAGES)
        _refill(a_bufs, b_bufs, a_ptrs, b_ptrs, 0, k_steps, BLOCK_K, STAGES)
        for pair in range((k_steps - 1) // 2):
            step = 1 + 2 * pair
            even = _product(a_bufs, b_bufs, zero, step, STAGES)
            acc = acc + warpgroup_mma_wait(num_outstanding=1, deps=(odd, ))
            _refill(a_bufs, b_bufs, a_ptrs, b_ptrs, step, k_steps, BLOCK_K, STAGES)
            odd = _product(a_bufs, b_bufs, zero, step + 1, STAGES)
            acc = acc + warpgroup_mma_wait(num_outstanding=1, deps=(even, ))
            _refill(a_bufs, b_bufs, a_ptrs, b_ptrs, step + 1, k_steps, BLOCK_K, STAGES)
        if k_steps % 2 == 0:
            even = _product(a_bufs, b_bufs, zero, k_steps - 1, STAGES)
            acc = acc + warpgroup_mma_wait(num_outstanding=1, deps=(odd, ))
            acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(even, ))
        else:
            acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(odd, ))
    else:
        for k in range(k_steps):
            stage = k % STAGES
            cp.wait_group(STAGES - 2)
            fence_async_shared()
            if MODE == FAST:
                acc = warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), acc,
                                    is_async=True)
                # Keep this step's product in flight; the one before it (and its stage) is done.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            else:
                product = warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), acc,
                                        use_acc=False, is_async=True)
                acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(product, ))
            if k + STAGES - 1 < k_steps:
                _issue_loads(a_bufs, b_bufs, a_ptrs, b_ptrs, k + STAGES - 1, BLOCK_K, STAGES)
            cp.commit_group()
        if MODE == FAST:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    cp.wait_group(0)

    out_rows = off_m + gl.arange(0, BLOCK_M, gl.SliceLayout(1, mma_layout))
    out_cols = off_n + gl.arange(0, BLOCK_N, gl.SliceLayout(0, mma_layout))
    row_scale = gl.load(row_scale_ptr + out_rows, mask=out_rows < M, other=0.0)
    col_scale = gl.load(col_scale_ptr + out_cols, mask=out_cols < N, other=0.0)
    out = (acc * row_scale[:, None] * col_scale[None, :]).to(gl.bfloat16)
    mask = (out_rows < M)[:, None] & (out_cols < N)[None, :]
    gl.store(c_ptr + out_rows.to(gl.int64)[:, None] * N + out_cols[None, :], out, mask=mask)


@triton.jit
def tl_fp8_gemm(a_ptr, b_ptr, c_ptr, row_scale_ptr, col_scale_ptr, M, N, K,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, PROMOTE: tl.constexpr):
    """The same GEMM in tl: PROMOTE 0 accumulates in the tensor cores, PROMOTE = BLOCK_K asks the
    compiler for a float32 add after every product (the backend's precise mode)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    off_m = (first_m + (pid % per_group) % group_rows) * BLOCK_M
    off_n = ((pid % per_group) // group_rows) * BLOCK_N
    rows = tl.minimum(off_m + tl.arange(0, BLOCK_M), M - 1)
    cols = tl.minimum(off_n + tl.arange(0, BLOCK_N), N - 1)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :]
    b_ptrs = b_ptr + cols.to(tl.int64)[None, :] * K + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs + k)
        b = tl.load(b_ptrs + k)
        if PROMOTE > 0:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)
        else:
            acc = tl.dot(a, b, acc)
    out_rows = off_m + tl.arange(0, BLOCK_M)
    out_cols = off_n + tl.arange(0, BLOCK_N)
    row_scale = tl.load(row_scale_ptr + out_rows, mask=out_rows < M, other=0.0)
    col_scale = tl.load(col_scale_ptr + out_cols, mask=out_cols < N, other=0.0)
    out = (acc * row_scale[:, None] * col_scale[None, :]).to(tl.bfloat16)
    mask = (out_rows < M)[:, None] & (out_cols < N)[None, :]
    tl.store(c_ptr + out_rows.to(tl.int64)[:, None] * N + out_cols[None, :], out, mask=mask)


TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8)
WARPS, STAGES = 8, 4


def launchers(a, b, c, row_scale, col_scale):
    M, K = a.shape
    N = b.shape[0]
    grid = (triton.cdiv(M, TILE["BLOCK_M"]) * triton.cdiv(N, TILE["BLOCK_N"]), )
    args = (a, b, c, row_scale, col_scale, M, N, K)

    def tl_run(promote):
        return lambda: tl_fp8_gemm[grid](*args, **TILE, PROMOTE=promote, num_warps=WARPS, num_stages=STAGES)

    def gl_run(mode):
        return lambda: gl_fp8_gemm[grid](*args, **TILE, STAGES=STAGES, MODE=mode, num_warps=WARPS)

    return {"tl fast": tl_run(0), "tl precise": tl_run(TILE["BLOCK_K"]),
            "gl fast": gl_run(FAST), "gl wait": gl_run(WAIT), "gl overlap": gl_run(OVERLAP)}


def compile_only(dump_dir=None):
    """Compile the Gluon kernel's three modes for sm90 on a machine without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    signature = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "row_scale_ptr": "*fp32",
                 "col_scale_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32"}
    for mode in (FAST, WAIT, OVERLAP):
        constexprs = dict(TILE, STAGES=STAGES, MODE=mode, num_warps=WARPS)
        sig = dict(signature, **{name: "constexpr" for name in constexprs})
        names = list(sig)
        # What a launch specializes on by itself: 16-byte aligned pointers, sizes divisible by 16.
        aligned = {(names.index(k), ): [["tt.divisibility", 16]] for k in signature}
        src = GluonASTSource(gl_fp8_gemm, sig, {(names.index(k), ): v for k, v in constexprs.items()}, aligned)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS})
        print(f"mode {int(mode)}: compiled, {kernel.metadata.shared} bytes of shared memory")
        if dump_dir:
            with open(f"{dump_dir}/gl_fp8_gemm_mode{int(mode)}.ptx", "w") as fh:
                fh.write(kernel.asm["ptx"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["8192x28672x4096", "8192x4096x14336", "4096x1408x4096"],
                    help="MxNxK (Mixtral's GEMM1 and GEMM2 at M = 4096 top-2, GLM-4.5V TP2's GEMM1 rows)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--dump-ptx", help="with --compile-only: write each mode's PTX into this folder")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.compile_only:
        return compile_only(args.dump_ptx)
    import torch
    from moekit.timing import time_graphs
    results = []
    for shape in args.shapes:
        M, N, K = (int(v) for v in shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(M, K, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        b = torch.randn(N, K, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        row_scale = torch.rand(M, device="cuda", generator=gen) + 0.5
        col_scale = torch.rand(N, device="cuda", generator=gen) / 64 + 1 / 128
        ref = (a.float() @ b.float().T) * row_scale[:, None] * col_scale[None, :]
        fns, errors, outs = {}, {}, {}
        for name, fn in launchers(a, b, torch.empty(M, N, device="cuda", dtype=torch.bfloat16),
                                  row_scale, col_scale).items():
            c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            run = launchers(a, b, c, row_scale, col_scale)[name]
            try:
                run()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a kernel that fails to build is a result
                print(f"{shape} {name}: FAILED {type(exc).__name__}: {str(exc)[:600]}", flush=True)
                continue
            errors[name] = ((c.float() - ref).norm() / ref.norm()).item()
            outs[name] = c
            fns[name] = run
        times = time_graphs(fns, reps=20, warmup=2, rounds=args.rounds)
        flops = 2 * M * N * K
        print(f"\n{shape} (relative L2 against float32 on the same FP8 inputs)", flush=True)
        for name, t in times.items():
            if isinstance(t, BaseException):
                print(f"  {name:12s} FAILED {str(t)[:200]}")
                continue
            us = t.median_us
            same = {other: torch.equal(outs[name], outs[other]) for other in outs if other != name}
            print(f"  {name:12s} {us:9.1f} us (p20-p80 {t.p20_us:.0f}-{t.p80_us:.0f})  {flops / us / 1e6:7.1f} TFLOP/s  rel L2 {errors[name]:.2e}  "
                  f"bitwise equal to: {[o for o, eq in same.items() if eq]}", flush=True)
            results.append({"shape": shape, "kernel": name, "us": us, "p20_us": t.p20_us, "p80_us": t.p80_us,
                            "rel_l2": errors[name]})
        del ref, outs
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
