"""Probe: how close a plain Triton GEMV (no tensor cores, per-step reduction, wide K steps) gets to
the memory bound for GEMM1 at GLM-4.5V M = 1 (8 pairs), against the tiled GEMM1. Not part of the
package; a measurement for the GEMV path's design (BENCHMARKS.md)."""
import itertools

import torch
import triton
import triton.language as tl

import moekit
from moekit.backends.triton import launch
from moekit.inputs import make_weights, make_x, uniform_routing
from moekit.models import get_model
from moekit.timing import time_graphs


@triton.jit
def probe_kernel(a_ptr, w_ptr, out_ptr, ids_ptr, N, H, K_TOP, stride_we, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = (pair // K_TOP).to(tl.int64)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + e * stride_we + cols[:, None] * stride_wn + ks[None, :]
    u_ptrs = g_ptrs + N * stride_wn
    a_ptrs = a_ptr + token * H + ks
    g = tl.zeros((BLOCK_N,), tl.float32)
    u = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a = tl.load(a_ptrs).to(tl.float32)[None, :]
        g += tl.sum(tl.load(g_ptrs).to(tl.float32) * a, axis=1)
        u += tl.sum(tl.load(u_ptrs).to(tl.float32) * a, axis=1)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    tl.store(out_ptr + pair * N + cols, (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16))


def main():
    dev = torch.device("cuda")
    model = get_model("glm-4.5v-fp8", 2)
    shape = model.shape
    w = make_weights(shape, model.scheme, dev)
    E, K, H, N = shape.num_experts, shape.top_k, shape.hidden, w.n
    backend = moekit.get_backend("triton")
    for M in (1, 4):
        x = make_x(M, H, dev)
        tw, ids = (t.to(dev) for t in uniform_routing(M, E, K))
        cfg = backend.config_for(w, K, M, dev)
        align, a, a_scale = launch.align_and_quantize(x, w, ids, cfg.BLOCK_M)
        out = torch.empty(M * K, N, dtype=torch.bfloat16, device=dev)
        flat = ids.reshape(-1)
        fns = {"tiled gemm1": lambda: launch.gemm1(a, a_scale, w, align, K, x.dtype, cfg)}
        for bn, bk, warps in itertools.product((4, 8, 16), (256, 512, 1024), (2, 4, 8)):
            def run(bn=bn, bk=bk, warps=warps):
                probe_kernel[(M * K, triton.cdiv(N, bn))](a, w.w13, out, flat, N, H, K, w.w13.stride(0), w.w13.stride(1),
                                                          BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
            fns[f"gemv N{bn} K{bk} w{warps}"] = run
        times = time_graphs(fns, reps=20, warmup=2, rounds=4)
        used = int(torch.unique(ids).numel())
        nbytes = used * 2 * N * H
        print(f"\nGLM M={M}: GEMM1 reads {nbytes / 1e6:.1f} MB")
        for label, t in sorted(times.items(), key=lambda kv: kv[1].median_us if not isinstance(kv[1], BaseException) else 1e9):
            if isinstance(t, BaseException):
                print(f"  {label:22s} FAILED {str(t)[:100]}")
                continue
            print(f"  {label:22s} {t.median_us:7.1f} us  {nbytes / t.median_us / 1e6:5.2f} TB/s")


if __name__ == "__main__":
    main()
