"""Does GEMM2 gain from keeping its row block's activations across a run of column tiles
(KernelConfig.KEEP_A2, _kernels._gemm2_resident_run)? At prefill GEMM2 reads each tile's A and B
from the L2 (DeepSeek-V3 TP8 M = 8192: about 3 GB of L2 reads beside 1.4 GB of HBM traffic, and
GEMM2 alone took 851 µs, BENCHMARKS.md thirty-third session). Where the intermediate is at most
two K steps long (DeepSeek-V3 at TP8), a run can load A once and pipeline its tiles.

At each point, with the table's config: GEMM2 alone with the table's launch and with KEEP_A2 over
GEMM2 widths, warps, stages and run lengths (each KEEP_A2 output checked bitwise equal to the
table's), in the same rounds; then the whole layer with the table's config and with the fastest
KEEP_A2 launches. Not part of the package: a measurement (BENCHMARKS.md).

    PYTHONPATH=. python3 scripts/diag_gemm2_keep_a.py [--points deepseek-v3:8:8192 ...] [--json FILE]
"""
import itertools

import torch

from moekit.backends.triton import launch
from moekit.timing import time_graphs
from moekit.tune.space import config_key

# scripts/ is on the path when a script runs
from diag_points import cuda_triton, points_parser, tiled_intermediate, tiled_points, write_json

DEFAULT_POINTS = ["deepseek-v3:8:1024", "deepseek-v3:8:2048", "deepseek-v3:8:4096", "deepseek-v3:8:8192"]
LAYER_BEST = 3  # KEEP_A2 launches timed in the whole layer, fastest GEMM2 alone first


def keep_a_variants(cfg, scheme):
    """cfg's GEMM1 with GEMM2 launches keeping A: the table's own GEMM2 launch with KEEP_A2, then
    widths (block scales: dividing 128), warps, stages and run lengths."""
    g2 = cfg.gemm2()
    widths = (64, 128) if scheme.weight == "block" else (128, 256)
    seen = []
    first = cfg.with_gemm2(N_TILES=g2.gemm2_tiles if g2.gemm2_tiles > 1 else 8, KEEP_A=1)  # runs of 8 where it had none
    for v in [first] + [cfg.gemm1().with_gemm2(BLOCK_N=bn, num_warps=w, num_stages=s, GROUP_M=g2.GROUP_M,
                                               N_TILES=n, KEEP_A=1)
                        for bn, w, s, n in itertools.product(widths, (4, 8), (2, 3, 4), (8, 16))]:
        if v not in seen and not v.problems(scheme):
            seen.append(v)
    return seen


def gemm2_closure(p, cfg, align, act):
    return lambda: launch.gemm2(act, p.w, align, p.tw, p.x.dtype, cfg)


def main():
    ap = points_parser(DEFAULT_POINTS)
    args = ap.parse_args()
    dev, backend = cuda_triton()
    results = []
    for p, cfg in tiled_points(args.points, dev, backend):
        if not cfg.keep_a2_fits(p.shape.n):
            print(f"\n{p.model} M={p.M}: an intermediate of {p.shape.n} columns, more than two K steps: skipped")
            continue
        align, a, a_scale, act = tiled_intermediate(p, cfg)
        expected = launch.gemm2(act, p.w, align, p.tw, p.x.dtype, cfg)
        variants = keep_a_variants(cfg, p.scheme)
        closures = {"table": gemm2_closure(p, cfg, align, act)}
        for v in variants:
            got = launch.gemm2(act, p.w, align, p.tw, p.x.dtype, v)
            equal = torch.equal(got, expected)
            print(f"  {config_key(v)}: bitwise equal to the table's GEMM2: {equal}", flush=True)
            if not equal:
                raise SystemExit("KEEP_A2 changed GEMM2's output")
            closures[config_key(v)] = gemm2_closure(p, v, align, act)
        del expected
        times = time_graphs(closures, reps=20, warmup=2, rounds=4)
        print(f"\n{p.model} tp{p.tp} M={p.M}: table {config_key(cfg)}; GEMM2 alone", flush=True)
        ranked = sorted((t.median_us, name) for name, t in times.items() if not isinstance(t, BaseException))
        for us, name in ranked:
            print(f"  {us:9.1f} us  {name}")
            results.append({"model": p.model, "tp": p.tp, "M": p.M, "what": "gemm2", "config": name, "us": us})
        for name, t in times.items():
            if isinstance(t, BaseException):
                print(f"  FAILED {name}: {str(t)[:160]}")
        best = [name for _, name in ranked if name != "table"][:LAYER_BEST]
        by_name = {config_key(v): v for v in variants}
        layer = {"table": lambda: backend.run(p.x, p.w, p.tw, p.ids, config=cfg)}
        layer.update({name: (lambda v=by_name[name]: backend.run(p.x, p.w, p.tw, p.ids, config=v)) for name in best})
        times = time_graphs(layer, reps=20, warmup=2, rounds=4)
        print(f"{p.model} tp{p.tp} M={p.M}: whole layer", flush=True)
        for name, t in times.items():
            if isinstance(t, BaseException):
                print(f"  FAILED {name}: {str(t)[:160]}")
                continue
            print(f"  {t.median_us:9.1f} us (p20 {t.p20_us:.1f} p80 {t.p80_us:.1f})  {name}")
            results.append({"model": p.model, "tp": p.tp, "M": p.M, "what": "layer", "config": name,
                            "us": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us})
        del act, align, a, a_scale
        torch.cuda.empty_cache()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
