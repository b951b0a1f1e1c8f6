"""Where does the triton backend's prefill time go? Each GEMM alone, with each way of handing the
intermediate from GEMM1 to GEMM2, against cuBLAS's FP8 GEMM on the same rows (one torch._scaled_mm
per expert: a ceiling for a grouped GEMM of this shape). Times only: the numbers of the variants
that do not match the scheme's rule are meaningless.

Also GEMM1 with the joined tile (KernelConfig.JOIN: gate and up columns interleaved in one
2*BLOCK_N-wide tile, one tl.dot per K step), checked against the unjoined GEMM1 before it is timed.
The backend's GEMM1 ("backend gemm1") follows MOEKIT_FP8_ACCUMULATION: FP8 1x128-group output
when precise, bf16 output plus the per-row quantization pass when fast.

    PYTHONPATH=. python3 scripts/diag_prefill.py [--batch-sizes 1024 4096] [--json FILE]
"""
import argparse
import dataclasses

import torch
import triton

from diag_fast import in_mode  # scripts/ is on the path when a script runs
from diag_points import parse_model, write_json
from moekit.backends.triton import _kernels as k
from moekit.backends.triton import launch
from moekit.backends.triton.config import KernelConfig
from moekit.inputs import make_weights, make_x, uniform_routing
from moekit.spec import get_scheme
from moekit.timing import time_graphs

CONFIGS = [
    KernelConfig(64, 128, 128, 8, 8, 4),
    KernelConfig(128, 128, 128, 8, 8, 3),
    KernelConfig(128, 128, 128, 8, 8, 4),
    # BLOCK_K 256: FP8 products promoted into float32 every 256 of K instead of 128 (fewer waits;
    # this script's own experiment: the backend promotes every 128 whatever the step, launch.PROMOTE_EVERY)
    KernelConfig(64, 128, 256, 8, 8, 2),
    KernelConfig(128, 128, 256, 8, 8, 2),
]


def joined_matches(a, a_scale, w, align, K, cfg) -> float:
    """Relative L2 between the joined GEMM1's bf16 output and the unjoined one, on the real rows."""
    mine = gemm1_bf16(a, a_scale, w, align, K, dataclasses.replace(cfg, JOIN=1))
    theirs = gemm1_bf16(a, a_scale, w, align, K, cfg)
    real = torch.cat([torch.arange(s, s + c) for s, c in zip(align.start.tolist(), align.count.tolist())]).to(a.device)
    return float((mine[real].float() - theirs[real].float()).norm() / theirs[real].float().norm())


def gemm1_bf16(a, a_scale, w, align, K, cfg):
    """GEMM1 with its output left in bf16 (OUT_MODE 0), as GEMM2's A_MODE 2 reads it."""
    N, H, E = w.n, w.hidden, w.num_experts
    out = torch.empty(align.max_rows, N, dtype=torch.bfloat16, device=a.device)
    ws = w.w13_scale
    launch._launch(k.gemm1_kernel, launch._tiles(align, cfg, N),
        a, a_scale, w.w13, ws, out, a, a, align.sorted_pairs, align.count, align.start,
        align.num_pairs, E, N, H, K, a.stride(0), 1, w.w13.stride(0), w.w13.stride(1), ws.stride(0), 0,
        out.stride(0), 0,
        A_SCALE=2, B_SCALE=2, OUT_MODE=0, ACT_DTYPE=triton.language.bfloat16, E_POW2=triton.next_power_of_2(E),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, PROMOTE=launch.fp8_promote(cfg) and cfg.BLOCK_K,
        JOIN=cfg.JOIN, HALF_TAIL=launch._half_tail(N, cfg.BLOCK_N, cfg.JOIN), INTERPRET=launch._interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def scaled_mm_ceiling(w, align_counts, device):
    """One FP8 GEMM per expert through cuBLAS (per-row x per-column scales), GEMM1 then GEMM2 shapes."""
    N, H = w.n, w.hidden
    mats = []
    for e, rows in enumerate(align_counts):
        if rows == 0:
            continue
        rows16 = -(-rows // 16) * 16
        a1 = torch.randn(rows16, H, device=device).to(torch.float8_e4m3fn)
        a2 = torch.randn(rows16, N, device=device).to(torch.float8_e4m3fn)
        mats.append((a1, a2, w.w13[e], w.w2[e], torch.ones(rows16, 1, device=device),
                     w.w13_scale[e].reshape(1, -1).float(), w.w2_scale[e].reshape(1, -1).float()))

    def g1():
        for a1, _, w13, _, sa, s13, _ in mats:
            torch._scaled_mm(a1, w13.t(), scale_a=sa, scale_b=s13, out_dtype=torch.bfloat16)

    def g2():
        for _, a2, _, w2, sa, _, s2 in mats:
            torch._scaled_mm(a2, w2.t(), scale_a=sa, scale_b=s2, out_dtype=torch.bfloat16)

    return g1, g2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--models", nargs="+", default=["mixtral-8x7b:1", "glm-4.5v-fp8:2"])
    ap.add_argument("--json")
    ap.add_argument("--gemm1-only", action="store_true", help="skip the GEMM2 variants and cuBLAS")
    args = ap.parse_args()
    dev = torch.device("cuda")
    scheme = get_scheme("fp8-channel-token")
    results = []
    for spec_name in args.models:
        name, tp, preset, _ = parse_model(spec_name, scheme.name, scheme_field=False)
        shape = preset.shape
        w = make_weights(shape, scheme, dev)
        E, K, N, H = shape.num_experts, shape.top_k, shape.n, shape.hidden
        for M in args.batch_sizes:
            x = make_x(M, H, dev)
            tw, ids = uniform_routing(M, E, K)
            tw, ids = tw.to(dev).float(), ids.to(dev)
            flops1 = 2 * M * K * H * 2 * N
            flops2 = 2 * M * K * N * H
            a, a_scale = launch.quantize_input(x, w)
            fns = {}
            for cfg in CONFIGS:
                tag = f"M{cfg.BLOCK_M} N{cfg.BLOCK_N} K{cfg.BLOCK_K} G{cfg.GROUP_M} w{cfg.num_warps} s{cfg.num_stages}"
                align = launch.align_pairs(ids, E, cfg.BLOCK_M)
                # fp8 + 1x128 group scales, whatever MOEKIT_FP8_ACCUMULATION says
                act = in_mode("precise", lambda a=a, s=a_scale, al=align, c=cfg: launch.gemm1(a, s, w, al, K, x.dtype, c))()
                bf16 = gemm1_bf16(a, a_scale, w, align, K, cfg)
                row_scale = act.scale[:, :1].contiguous()
                per_row = launch.Intermediate(act.values, row_scale, 5)
                on_load = launch.Intermediate(bf16, None, 2)
                joined = dataclasses.replace(cfg, JOIN=1)
                fns[f"{tag} | backend gemm1"] = (lambda a=a, s=a_scale, al=align, c=cfg: launch.gemm1(a, s, w, al, K, x.dtype, c), flops1)
                fns[f"{tag} | gemm1 bf16 out"] = (lambda a=a, s=a_scale, al=align, c=cfg: gemm1_bf16(a, s, w, al, K, c), flops1)
                print(f"{name} M={M} {tag}: joined GEMM1 vs the backend's, rel L2 {joined_matches(a, a_scale, w, align, K, cfg):.2e}")
                fns[f"{tag} | backend gemm1 JOINED"] = (lambda a=a, s=a_scale, al=align, c=joined: launch.gemm1(a, s, w, al, K, x.dtype, c), flops1)
                fns[f"{tag} | gemm1 JOINED bf16 out"] = (lambda a=a, s=a_scale, al=align, c=joined: gemm1_bf16(a, s, w, al, K, c), flops1)
                if args.gemm1_only:
                    continue
                fns[f"{tag} | gemm2 row scale (A_MODE 5)"] = (lambda i=per_row, al=align, c=cfg: launch.gemm2(i, w, al, tw, x.dtype, c), flops2)
                if cfg.BLOCK_K != 128:
                    continue  # the group modes read one scale per BLOCK_K: 128 only
                fns[f"{tag} | gemm2 group scales (A_MODE 4)"] = (lambda i=act, al=align, c=cfg: launch.gemm2(i, w, al, tw, x.dtype, c), flops2)
                fns[f"{tag} | gemm2 quantize on load (A_MODE 2)"] = (lambda i=on_load, al=align, c=cfg: launch.gemm2(i, w, al, tw, x.dtype, c), flops2)
            if not args.gemm1_only:
                counts = torch.bincount(ids.reshape(-1).long(), minlength=E).tolist()
                g1, g2 = scaled_mm_ceiling(w, counts, dev)
                fns["cuBLAS per expert | gemm1 shape"] = (g1, flops1)
                fns["cuBLAS per expert | gemm2 shape"] = (g2, flops2)
            times = time_graphs({n: f for n, (f, _) in fns.items()}, reps=20, warmup=2, rounds=3)
            print(f"\n{name} tp{tp} M={M} (E={E} K={K} N={N} H={H})")
            for n, (_, fl) in fns.items():
                t = times[n]
                if isinstance(t, BaseException):
                    print(f"  {n:58s} FAILED {str(t)[:80]}")
                    continue
                us = t.median_us
                print(f"  {n:58s} {us:9.1f} us  {fl / us / 1e6:7.1f} TFLOP/s")
                results.append({"model": name, "tp": int(tp), "M": M, "what": n, "us": us, "tflops": fl / us / 1e6})
            del fns, times
            torch.cuda.empty_cache()
        w = None  # freed before the next model
        torch.cuda.empty_cache()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
