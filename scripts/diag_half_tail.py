"""Does a GEMM1 tile-trimming switch pay? Times the whole layer (the triton backend) with one of
launch.py's switches on and off, in the same interleaved rounds, and checks that both give
bitwise the same output:

- `half-width-tail` (launch.HALF_WIDTH_TAIL): GEMM1's last column block at half width. GLM-4.5V
  at TP2 has N = 704: five 128-wide column blocks and 64 columns, so a full-width last tile
  computes 64 columns of zeros.
- `gluon-half-height` (launch.GLUON_HALF_HEIGHT): the 128-row Gluon GEMM1 running an expert's last
  row block at 64 rows when it holds at most 64 (many experts with few rows each: DeepSeek-V3 at
  TP8, Qwen3-30B-A3B). Needs a config with OVERLAP = 1 and BLOCK_M = 128 (--config).

    PYTHONPATH=. python3 scripts/diag_half_tail.py [--switch half-width-tail] [--points glm-4.5v-fp8:2:4096 ...]
        [--config KEY] [--scheme fp8-channel-token] [--modes precise fast] [--json FILE]
"""
import argparse

import torch

import moekit
from diag_fast import in_mode  # scripts/ is on the path when a script runs
from diag_points import layer_points, write_json
from moekit.backends.triton import launch
from moekit.timing import time_graphs
from moekit.tune.space import config_from_key, config_key

POINTS = ["glm-4.5v-fp8:2:64", "glm-4.5v-fp8:2:1024", "glm-4.5v-fp8:2:4096", "glm-4.5v-fp8:2:8192"]
SWITCHES = {"half-width-tail": "HALF_WIDTH_TAIL", "gluon-half-height": "GLUON_HALF_HEIGHT"}


def with_switch(name: str, on: bool, fn):
    """fn run with launch's switch `name` on or off (read at launch, so also while a graph is captured)."""

    def run():
        old = getattr(launch, name)
        setattr(launch, name, on)
        try:
            return fn()
        finally:
            setattr(launch, name, old)

    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--switch", choices=SWITCHES, default="half-width-tail")
    ap.add_argument("--points", nargs="+", default=POINTS, help="model:tp:M")
    ap.add_argument("--config", help="a config key (moekit.tune.space.config_key); default: the mode's table config")
    ap.add_argument("--scheme", help="the scheme (default: the model preset's)")
    ap.add_argument("--modes", nargs="+", default=["precise", "fast"], choices=["precise", "fast"])
    ap.add_argument("--json")
    args = ap.parse_args()
    switch = SWITCHES[args.switch]
    forced = config_from_key(args.config) if args.config else None  # a bad key fails before any GPU work
    dev = torch.device("cuda")
    backend = moekit.get_backend("triton")
    results = []
    for model, tp, M, shape, scheme, w, x, tw, ids in layer_points(args.points, dev, args.scheme):
        fns = {}
        for mode in args.modes:
            cfg = forced or in_mode(mode, lambda: backend.config_for(w, shape.top_k, M, dev))()
            for on in (True, False):
                label = f"{mode} {args.switch} {'on' if on else 'off'}"
                fns[label] = in_mode(mode, with_switch(switch, on, lambda cfg=cfg: backend.run(x, w, tw, ids, config=cfg)))
            same = torch.equal(fns[f"{mode} {args.switch} on"](), fns[f"{mode} {args.switch} off"]())
            print(f"{model} tp{tp} M={M} {mode}: {config_key(cfg)}; outputs {'bitwise equal' if same else 'DIFFER'}",
                  flush=True)
        times = time_graphs(fns, reps=20, warmup=2, rounds=5)
        for label, t in times.items():
            if isinstance(t, BaseException):
                print(f"  {label:36s} FAILED {str(t)[:100]}")
                continue
            print(f"  {label:36s} {t.median_us:9.1f} us (p20 {t.p20_us:.1f} p80 {t.p80_us:.1f})", flush=True)
            results.append({"model": model, "tp": int(tp), "M": M, "variant": label, "us": t.median_us,
                            "p20_us": t.p20_us, "p80_us": t.p80_us})
        del fns, times
    write_json(args.json, results)


if __name__ == "__main__":
    main()
