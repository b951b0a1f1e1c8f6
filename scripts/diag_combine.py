"""Is the combine cheaper inside GEMM2? The triton backend's whole layer with the combine pass
after GEMM2 against the combine fused into GEMM2's epilogue (launch.FUSED_COMBINE: the program that
stores a token's last row sums its rows), in the same interleaved rounds, each checked bitwise
against the other, at the tables' configs. Both accumulation modes for per-channel schemes.

    PYTHONPATH=. python3 scripts/diag_combine.py [--points glm-4.5v-fp8:2:4096 ...] [--json FILE]
"""
import argparse
import json

import torch

import moekit
from diag_fast import in_mode  # scripts/ is on the path when a script runs
from moekit.backends.triton import launch
from moekit.bench import make_weights, make_x, uniform_routing
from moekit.models import get_model
from moekit.spec import get_scheme
from moekit.timing import time_graphs

POINTS = [f"glm-4.5v-fp8:2:{m}" for m in (1, 64, 1024, 4096, 8192)] + \
    [f"deepseek-v3:8:{m}" for m in (64, 1024, 4096, 8192)] + [f"mixtral-8x7b:1:{m}" for m in (1024, 4096)]


def fused(flag: bool, fn):
    def run():
        old = launch.FUSED_COMBINE
        launch.FUSED_COMBINE = flag
        try:
            return fn()
        finally:
            launch.FUSED_COMBINE = old
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", default=POINTS, help="model:tp:M")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    backend = moekit.get_backend("triton")
    results = []
    for point in args.points:
        name, tp, M = point.split(":")
        model = get_model(name, int(tp))
        shape = model.shape
        scheme = model.scheme if model.scheme.is_fp8 else get_scheme("fp8-channel-token")  # Mixtral's preset: bf16
        w = make_weights(shape, scheme, dev)
        x = make_x(int(M), shape.hidden, dev)
        tw, ids = (t.to(dev) for t in uniform_routing(int(M), shape.num_experts, shape.top_k))
        tw = tw.float()
        modes = ["precise", "fast"] if scheme.name != "fp8-block128" else ["precise"]
        fns = {}
        for mode in modes:
            cfg = in_mode(mode, lambda: backend.config_for(w, shape.top_k, int(M), dev))()
            for flag in (False, True):
                fns[f"{mode}, {'fused' if flag else 'pass'}"] = in_mode(
                    mode, fused(flag, lambda cfg=cfg: backend.run(x, w, tw, ids, config=cfg)))
            same = torch.equal(fns[f"{mode}, pass"](), fns[f"{mode}, fused"]())
            print(f"{point} {mode}: config {cfg}; fused bitwise equal to the pass: {same}", flush=True)
        times = time_graphs(fns, reps=20, warmup=2, rounds=4)
        for label, t in times.items():
            if isinstance(t, BaseException):
                print(f"  {label:16s} FAILED {str(t)[:120]}")
                continue
            print(f"  {label:16s} {t.median_us:9.1f} us  (p20 {t.p20_us:.1f} p80 {t.p80_us:.1f})")
            results.append({"point": point, "variant": label, "us": t.median_us})
        fns = w = None
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
