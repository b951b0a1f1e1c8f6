"""The GEMV path with x quantized inside GEMM1 (gemv.FUSE_INPUT_QUANT, gemv1_kernel's A_QUANT: two
launches per layer) against a launch of quantize_input first (three), at decode sizes, in the
same rounds. Both must give the same bits (the same scales and FP8 values, the same sums), which
the script asserts before timing. Also timed: the two GEMMs alone on x quantized first (what
`moekit bench --mode gemm` times), so the layer's cost above its GEMMs shows for both.

At each point the table's config runs where it is a GEMV config; where the table runs the tiled
path there, GEMV_START (the tuner's first GEMV guess) and the table's tiled config are timed.

    PYTHONPATH=. python3 scripts/diag_gemv_input_quant.py [--points glm-4.5v-fp8:2:1 ...] [--json FILE]
"""
import argparse
import itertools

import torch

import moekit
from moekit.backends.triton import gemv
from moekit.timing import time_graphs
from moekit.tune.space import GEMV_START

from diag_points import layer_points, print_gemm_times, write_json  # scripts/ is on the path when a script runs


def layer_with(backend, p, cfg, fused: bool):
    """A closure of the layer with GEMM1 quantizing x itself (fused) or not; the switch is set
    inside, so the CUDA graph captures the launches that setting gives."""
    def layer():
        gemv.FUSE_INPUT_QUANT = fused
        try:
            return backend.run(p.x, p.w, p.tw, p.ids, config=cfg)
        finally:
            gemv.FUSE_INPUT_QUANT = True
    return layer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", default=[f"{m}:{M}{s}" for (m, s), M in itertools.product(
        (("glm-4.5v-fp8:2", ""), ("deepseek-v3:8", ""), ("mixtral-8x7b:1", ":fp8-channel-token")), (1, 2, 4, 8))],
        help="model:tp:M[:scheme] points (default: GLM-4.5V TP2, DeepSeek-V3 TP8, Mixtral at M = 1, 2, 4, 8)")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    backend = moekit.get_backend("triton")
    results = []
    for p in layer_points(args.points, dev):
        table = backend.config_for(p.w, p.shape.top_k, p.M, dev)
        cfg = table if table.GEMV else GEMV_START
        fused, unfused = layer_with(backend, p, cfg, True), layer_with(backend, p, cfg, False)
        assert torch.equal(fused(), unfused()), f"{p.model} M={p.M}: fused input quantization changed the bits"
        fns = {"layer fused": fused, "layer quantize first": unfused,
               "gemms alone": backend.prepare_gemm_only(p.x, p.w, p.tw, p.ids, config=cfg)}
        if not table.GEMV:
            fns["layer tiled (table)"] = lambda: backend.run(p.x, p.w, p.tw, p.ids, config=table)
        times = time_graphs(fns, reps=20, warmup=2, rounds=6)
        print(f"\n{p.model} tp{p.tp} M={p.M}: {cfg}{'' if table.GEMV else ' (GEMV_START; the table runs tiled)'}",
              flush=True)
        for label, us in print_gemm_times(times, 0, 0):
            results.append({"model": p.model, "tp": p.tp, "M": p.M, "what": label, "us": us, "config": str(cfg)})
        torch.cuda.empty_cache()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
