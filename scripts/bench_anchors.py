"""Time moekit's backends at the anchor points (BENCHMARKS.md, Reference points: the H100 table):
GLM-4.5V-FP8 TP2, Mixtral-8x7B FP8 (channel weights, token activations) and DeepSeek-V3 TP8
(128x128 blocks), M = 1, 8, 64, 192, 1024, 4096, 8192. Both the whole layer (routing excluded) and
the two expert GEMMs alone. Prints a table and writes JSON rows to the path given (or stdout).

    python scripts/bench_anchors.py [--backends triton cutlass] [--out rows.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import moekit
from moekit import roofline
from moekit.backends import get_backend
from moekit.spec import MoEShape
from moekit.timing import time_graph

ANCHORS = {  # name: (shape, scheme)
    "glm-4.5v-fp8 tp2": (MoEShape(128, 4096, 1408, 8, tp=2), "fp8-channel-token"),
    "mixtral-8x7b fp8": (MoEShape(8, 4096, 14336, 2), "fp8-channel-token"),
    "deepseek-v3 tp8 blk": (MoEShape(256, 7168, 2048, 8, tp=8), "fp8-block128"),
}
BATCH_SIZES = [1, 8, 64, 192, 1024, 4096, 8192]


def random_problem(shape: MoEShape, scheme: str, M: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, H, N, K = shape.num_experts, shape.hidden, shape.n, shape.top_k
    w13 = torch.randn(E, 2 * N, H, device="cuda", generator=g) / H**0.5
    w2 = torch.randn(E, H, N, device="cuda", generator=g) / N**0.5
    weights = moekit.quantize_weights(w13, w2, scheme)
    del w13, w2
    x = torch.randn(M, H, device="cuda", generator=g).bfloat16()
    logits = torch.randn(M, E, device="cuda", generator=g)
    tw, ids = moekit.route(logits, K)
    return weights, x, tw, ids


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backends", nargs="+", default=["triton"])
    p.add_argument("--models", nargs="+", default=list(ANCHORS))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=BATCH_SIZES)
    p.add_argument("--modes", nargs="+", default=["layer", "gemm"])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out")
    args = p.parse_args()
    ceilings = roofline.get_ceilings("cuda", refresh=True)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; ceilings: {ceilings.describe()}", flush=True)
    rows = []
    for model in args.models:
        shape, scheme = ANCHORS[model]
        scheme_v = moekit.get_scheme(scheme)
        weights = None
        for M in args.batch_sizes:
            weights, x, tw, ids = random_problem(shape, scheme, M) if weights is None else (weights, *random_problem_inputs(shape, M))
            counts = roofline.count(shape, scheme_v, M, ids)
            floor = roofline.floor_us(counts, ceilings, scheme_v)
            for name in args.backends:
                backend = get_backend(name)
                if backend.supports(weights.shape(shape.top_k), scheme_v, x.device):
                    continue
                for mode in args.modes:
                    try:
                        if mode == "layer":
                            fn = lambda: moekit.fused_moe(x, weights, tw, ids, backend=name)  # noqa: E731
                        else:
                            fn = backend.prepare_gemm_only(x, weights, tw, ids)
                        t = time_graph(fn, reps=args.reps)
                    except Exception as e:  # noqa: BLE001 - report and go on
                        print(f"{model} M={M} {name} {mode}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    row = dict(model=model, scheme=scheme, backend=name, mode=mode, M=M,
                               median_us=round(t.median_us, 1), p20_us=round(t.p20_us, 1), p80_us=round(t.p80_us, 1),
                               floor_us=round(floor, 1), efficiency=round(floor / t.median_us, 3),
                               tflops=round(counts.flops / t.median_us / 1e6, 1), method=t.method)
                    rows.append(row)
                    print(f"{model:22s} M={M:5d} {name:8s} {mode:5s} {t.median_us:9.1f} us  floor {floor:7.1f}  eff {floor / t.median_us:.2f}  [{t.method}]", flush=True)
        weights = None  # freed (the lambdas above name it)
        torch.cuda.empty_cache()
    text = json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           ceilings=ceilings.describe(), rows=rows), indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


def random_problem_inputs(shape: MoEShape, M: int, seed: int = 1):
    g = torch.Generator(device="cuda").manual_seed(seed + M)
    x = torch.randn(M, shape.hidden, device="cuda", generator=g).bfloat16()
    tw, ids = moekit.route(torch.randn(M, shape.num_experts, device="cuda", generator=g), shape.top_k)
    return x, tw, ids


if __name__ == "__main__":
    sys.exit(main())
