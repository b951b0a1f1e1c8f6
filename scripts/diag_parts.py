"""Where the triton layer's time goes beyond its two GEMMs at prefill sizes (issue 3's must-hold
compares the whole layer with vLLM's GEMMs alone: DeepSeek-V3 TP8 M = 8192's layer took 2109 µs
against 1610 for its GEMMs on an H100, BENCHMARKS.md thirty-first session). Each launch of the
tiled layer with the table's config, alone, in the same rounds:

- `layer`: backend.run, what `moekit bench` times;
- `gemms`: the closure `moekit bench --mode gemm` times (prepare_gemm_only: GEMM1 and GEMM2 on
  inputs aligned and quantized before);
- `align`: the pairs sorted by expert and padded (launch.align_pairs: count, scan, starts, scatter);
- `quantize x`: launch.quantize_input;
- `gemm1`, `gemm2`, `combine`: the layer's own launches (launch.gemm1, gemm2, combine).

The parts' sum differs from the layer by what programmatic dependent launch overlaps and by each
replay's own fixed cost. Not part of the package: a measurement (BENCHMARKS.md).

    PYTHONPATH=. python3 scripts/diag_parts.py [--points deepseek-v3:8:8192 ...] [--json FILE]
"""

import torch

from moekit.backends.triton import launch
from moekit.timing import time_graphs
from moekit.tune.space import config_key

# scripts/ is on the path when a script runs
from diag_points import cuda_triton, points_parser, tiled_intermediate, tiled_points, write_json

DEFAULT_POINTS = ["deepseek-v3:8:1024", "deepseek-v3:8:4096", "deepseek-v3:8:8192", "glm-4.5v-fp8:2:1024",
                  "glm-4.5v-fp8:2:4096", "glm-4.5v-fp8:2:8192", "mixtral-8x7b:1:1024:fp8-channel-token",
                  "mixtral-8x7b:1:4096:fp8-channel-token"]


def parts(backend, p, cfg) -> dict:
    """The closures timed at point `p` with the tiled config `cfg`."""
    K = p.shape.top_k
    align, a, a_scale, act = tiled_intermediate(p, cfg)
    pairs = launch.gemm2(act, p.w, align, p.tw, p.x.dtype, cfg)
    return {
        "layer": lambda: backend.run(p.x, p.w, p.tw, p.ids, config=cfg),
        "gemms": backend.prepare_gemm_only(p.x, p.w, p.tw, p.ids, config=cfg),
        "align": lambda: launch.align_pairs(p.ids, p.w.num_experts, cfg.BLOCK_M),
        "quantize x": lambda: launch.quantize_input(p.x, p.w),
        "gemm1": lambda: launch.gemm1(a, a_scale, p.w, align, K, p.x.dtype, cfg),
        "gemm2": lambda: launch.gemm2(act, p.w, align, p.tw, p.x.dtype, cfg),
        "combine": lambda: launch.combine(pairs, p.M, K),
    }


def main():
    ap = points_parser(DEFAULT_POINTS)
    args = ap.parse_args()
    dev, backend = cuda_triton()
    results = []
    for p, cfg in tiled_points(args.points, dev, backend):
        times = time_graphs(parts(backend, p, cfg), reps=20, warmup=2, rounds=4)
        print(f"\n{p.model} tp{p.tp} M={p.M}: {config_key(cfg)}", flush=True)
        for name, t in times.items():
            if isinstance(t, BaseException):
                print(f"  {name:12s} FAILED {str(t)[:120]}")
                continue
            print(f"  {name:12s} {t.median_us:9.1f} us (p20 {t.p20_us:.1f} p80 {t.p80_us:.1f})")
            results.append({"model": p.model, "tp": p.tp, "M": p.M, "config": config_key(cfg), "what": name,
                            "us": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us})
        torch.cuda.empty_cache()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
