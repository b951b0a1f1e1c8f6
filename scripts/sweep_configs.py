"""Time the triton backend's GEMMs (or whole layer) over a grid of KernelConfigs at one anchor
point, to choose analytic defaults; the tuner (`moekit tune`) does this properly per batch size.

    python scripts/sweep_configs.py --model "glm-4.5v-fp8 tp2" --batch-sizes 4096 [--mode layer]
"""

import argparse
import itertools

import torch

import moekit
from moekit.backends.triton import KernelConfig
from moekit.timing import time_graph

from bench_anchors import ANCHORS, random_problem

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--batch-sizes", nargs="+", type=int, required=True)
p.add_argument("--mode", default="gemm")
p.add_argument("--top", type=int, default=6)
args = p.parse_args()
shape, scheme = ANCHORS[args.model]
backend = moekit.get_backend("triton")
for M in args.batch_sizes:
    w, x, tw, ids = random_problem(shape, scheme, M)
    default = backend.config_for(w, shape.top_k, M, x.device)
    if M * shape.top_k / shape.num_experts <= 16:  # decode: small tiles, how narrow and how deep
        grid = [KernelConfig(16, bn, 128, 1, nw, ns) for bn, nw, ns in itertools.product((16, 32, 64), (2, 4), (3, 4, 5))]
    else:
        grid = [KernelConfig(bm, bn, 128, 8, nw, ns) for bm, bn, nw, ns in itertools.product((64, 128), (64, 128), (4, 8), (3, 4))]
    results = []
    for cfg in [default] + grid:
        if cfg.problems(w.scheme):
            continue
        try:
            if args.mode == "gemm":
                fn = backend.prepare_gemm_only(x, w, tw, ids, config=cfg)
            else:
                fn = lambda cfg=cfg: backend.run(x, w, tw, ids, config=cfg)  # noqa: E731
            results.append((time_graph(fn, reps=10, warmup=2).median_us, cfg))
        except Exception as e:  # noqa: BLE001
            print("failed", cfg, type(e).__name__, str(e)[:100])
    d = next(t for t, c in results if c == default)
    results.sort(key=lambda r: r[0])
    print(f"{args.model} M={M} default {d:.1f} us {default}")
    for t, c in results[: args.top]:
        print(f"   {t:9.1f} us  {c}")
    w = None  # freed (the lambdas above name it)
    torch.cuda.empty_cache()
