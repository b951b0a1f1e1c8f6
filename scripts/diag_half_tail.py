"""Does GEMM1's half-width last column block pay? GLM-4.5V at TP2 has N = 704: five 128-wide
column blocks and 64 columns, so a full-width last tile computes 64 columns of zeros. Times the
whole layer (the triton backend with the mode's table config) with the half-width tail
(launch.HALF_WIDTH_TAIL) on and off, in the same interleaved rounds, and checks that both give
bitwise the same output.

    PYTHONPATH=. python3 scripts/diag_half_tail.py [--points glm-4.5v-fp8:2:4096 ...] [--modes precise fast] [--json FILE]
"""
import argparse
import json

import torch

import moekit
from diag_fast import in_mode  # scripts/ is on the path when a script runs
from diag_points import layer_points
from moekit.backends.triton import launch
from moekit.timing import time_graphs

POINTS = ["glm-4.5v-fp8:2:64", "glm-4.5v-fp8:2:1024", "glm-4.5v-fp8:2:4096", "glm-4.5v-fp8:2:8192"]


def with_tail(on: bool, fn):
    """fn run with the half-width tail on or off (read at launch, so also while a graph is captured)."""

    def run():
        old = launch.HALF_WIDTH_TAIL
        launch.HALF_WIDTH_TAIL = on
        try:
            return fn()
        finally:
            launch.HALF_WIDTH_TAIL = old

    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", default=POINTS, help="model:tp:M")
    ap.add_argument("--modes", nargs="+", default=["precise", "fast"], choices=["precise", "fast"])
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    backend = moekit.get_backend("triton")
    results = []
    for model, tp, M, shape, scheme, w, x, tw, ids in layer_points(args.points, dev):
        fns = {}
        for mode in args.modes:
            cfg = in_mode(mode, lambda: backend.config_for(w, shape.top_k, M, dev))()
            for on in (True, False):
                label = f"{mode} {'half' if on else 'full'}-width tail"
                fns[label] = in_mode(mode, with_tail(on, lambda cfg=cfg: backend.run(x, w, tw, ids, config=cfg)))
            same = torch.equal(fns[f"{mode} half-width tail"](), fns[f"{mode} full-width tail"]())
            print(f"{model} tp{tp} M={M} {mode}: {cfg}; outputs {'bitwise equal' if same else 'DIFFER'}", flush=True)
        times = time_graphs(fns, reps=20, warmup=2, rounds=5)
        for label, t in times.items():
            if isinstance(t, BaseException):
                print(f"  {label:28s} FAILED {str(t)[:100]}")
                continue
            print(f"  {label:28s} {t.median_us:9.1f} us (p20 {t.p20_us:.1f} p80 {t.p80_us:.1f})", flush=True)
            results.append({"model": model, "tp": int(tp), "M": M, "variant": label, "us": t.median_us,
                            "p20_us": t.p20_us, "p80_us": t.p80_us})
        del fns, times
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
