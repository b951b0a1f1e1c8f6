"""Probe: does asking the L2 for the weights before waiting on the kernel before speed up the GEMV
path's decode layer? With programmatic dependent launch GEMM2's grid is resident while GEMM1 still
runs (GEMM1 releases it at once), and GEMM1's while x is quantized; neither kernel's weights depend
on the kernel before, so each program may prefetch its rows (`PREFETCH`, _kernels._prefetch_l2:
one cp.async.bulk.prefetch per run of rows) before it waits. At GLM-4.5V M = 1 GEMM1 reads 46 MB
and GEMM2 23 MB one after the other, GEMM2 at only 1.2-1.6 TB/s (BENCHMARKS.md, thirty-second and
thirty-third sessions): overlapped, their reads could keep the HBM busy through the gap.

The layer (quantize x, GEMM1, GEMM2) with the table's GEMV config, in the same rounds:
`off` (no prefetch, what the backend runs), `g1` (GEMM1's own rows), `g2` (GEMM2's rows while
GEMM1 runs), `g1+g2`, and `g2 last` / `g1+g2 last` with GEMM2's prefetch kept in the L2 before
other lines (an evict_last policy: GEMM1's streaming reads would evict it otherwise), each run of
rows asked for in one request; `g2 x8` and `g2 x64` split each into 8 and 64 (64 lost 9-36% on an
H100 in every variant, BENCHMARKS.md thirty-third session). Every
variant's output must equal `off`'s bit for bit (a prefetch is a hint). Not part of the package: a
measurement to decide what to build (BENCHMARKS.md).

    PYTHONPATH=. python3 scripts/diag_gemv_prefetch.py [--points glm-4.5v-fp8:2:1 ...] [--json FILE]
"""
import argparse

import torch

import moekit
from moekit.backends.triton import gemv
from moekit.timing import FLUSH_WITH, time_graphs
from moekit.tune.space import config_key

from diag_points import gemv_config, layer_points, write_json  # scripts/ is on the path when a script runs

# (GEMM1's PREFETCH, GEMM2's, requests per run of rows) of each variant
VARIANTS = {"off": (0, 0, 1), "g1": (1, 0, 1), "g2": (0, 1, 1), "g1+g2": (1, 1, 1), "g2 last": (0, 2, 1),
            "g1+g2 last": (1, 2, 1), "g2 x8": (0, 1, 8), "g2 x64": (0, 1, 64)}
DEFAULT_POINTS = ["glm-4.5v-fp8:2:1", "glm-4.5v-fp8:2:2", "glm-4.5v-fp8:2:4", "deepseek-v3:8:1", "deepseek-v3:8:2",
                  "deepseek-v3:8:4", "mixtral-8x7b:1:1:fp8-channel-token", "mixtral-8x7b:1:2:fp8-channel-token",
                  "qwen3-30b-a3b-fp8:1:1", "qwen3-30b-a3b-fp8:1:2"]


def layer(p, cfg, prefetch1: int, prefetch2: int, parts: int):
    """The GEMV path's layer at point `p` with these prefetches (gemv.prefetch_mode's values), each
    run of rows asked for in `parts` requests."""
    def run():
        a, a_scale = gemv.quantize_input(p.x, p.w)
        act, act_scale, a_mode = gemv.gemv1(a, a_scale, p.w, p.ids, p.x.dtype, cfg, False, prefetch=prefetch1,
                                            prefetch_parts=parts)
        return gemv.gemv2(act, act_scale, a_mode, p.w, p.tw, p.ids, p.x.dtype, cfg, prefetch=prefetch2,
                          prefetch_parts=parts)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", default=DEFAULT_POINTS)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--flush-with", choices=FLUSH_WITH, default=FLUSH_WITH[0],
                    help="the harness's L2 flush: zero (the reference points') or read (clean lines, scripts/diag_flush.py)")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    backend = moekit.get_backend("triton")
    results = []
    for p in layer_points(args.points, dev):
        cfg = gemv_config(backend, p, dev)
        fns = {name: layer(p, cfg, *modes) for name, modes in VARIANTS.items()}
        expected = fns["off"]()
        for name, fn in fns.items():
            if not torch.equal(fn(), expected):
                raise SystemExit(f"{p.model} M={p.M}: {name} differs from off: a prefetch changed the result")
        times = time_graphs(fns, reps=6 * args.rounds, warmup=2, rounds=args.rounds, flush_with=args.flush_with)
        print(f"\n{p.model} tp{p.tp} M={p.M}: {config_key(cfg)}, L2 flushed by {args.flush_with}", flush=True)
        off = times["off"].median_us
        for name, t in times.items():
            print(f"  {name:12s} {t.median_us:8.1f} us (p20 {t.p20_us:.1f} p80 {t.p80_us:.1f})  {off / t.median_us:5.3f}x")
            results.append({"model": p.model, "tp": p.tp, "M": p.M, "config": config_key(cfg), "variant": name, "flush": args.flush_with,
                            "us": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us})
        torch.cuda.empty_cache()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
