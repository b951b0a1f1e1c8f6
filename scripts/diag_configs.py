"""The whole layer of the triton backend with configs named on the command line, against the
mode's table config, in the same interleaved rounds, each with its relative L2 error against the
reference: for launch shapes the tuner's search space does not hold (256-row tiles, 16 warps on
tiles other than 128x128) or hand comparisons a tune would take too long for.

    PYTHONPATH=. python3 scripts/diag_configs.py --points mixtral-8x7b:1:4096 glm-4.5v-fp8:2:8192
        --configs M128-N128-K128-G8-w16-s4 "M256-N128-K128-G8-w16-s3+N128-G8-w16-s3-r8"
        [--scheme fp8-channel-token] [--modes precise fast] [--rounds 4] [--json FILE]

A config is named as `moekit tune` names it in its journals (moekit.tune.space.config_key); a
config that cannot compile or run is reported as failed and the others still run.
"""
import argparse

import torch

import moekit
from diag_fast import in_mode, rel_l2  # scripts/ is on the path when a script runs
from diag_points import layer_points, write_json
from moekit.backends.reference import reference_moe
from moekit.check import intermediate_granularity
from moekit.timing import time_graphs
from moekit.tune.space import config_from_key, config_key


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", required=True, help="model:tp:M")
    ap.add_argument("--configs", nargs="+", required=True, help="config keys (moekit.tune.space.config_key)")
    ap.add_argument("--scheme", help="the scheme (default: the model preset's; Mixtral's is bf16)")
    ap.add_argument("--modes", nargs="+", default=["precise"], choices=["precise", "fast"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    configs = [config_from_key(key) for key in args.configs]  # a bad key fails before any GPU work
    dev = torch.device("cuda")
    backend = moekit.get_backend("triton")
    results = []
    for model, tp, M, shape, scheme, w, x, tw, ids in layer_points(args.points, dev, args.scheme):
        fns, errors, outputs = {}, {}, {}
        for mode in args.modes:
            table = in_mode(mode, lambda: backend.config_for(w, shape.top_k, M, dev))()
            ref = reference_moe(x, w, tw, ids,
                                intermediate_granularity=in_mode(mode, lambda: intermediate_granularity("triton", scheme))())
            for cfg in [table] + [c for c in configs if c != table]:
                label = f"{mode} {'table ' if cfg == table else ''}{config_key(cfg)}"
                run = in_mode(mode, lambda cfg=cfg: backend.run(x, w, tw, ids, config=cfg))
                try:
                    outputs[label] = run()
                    errors[label] = rel_l2(outputs[label], ref)
                except Exception as exc:  # noqa: BLE001 - a config that cannot run is a result
                    print(f"{model} tp{tp} M={M} {label}: FAILED {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    continue
                fns[label] = run
            del ref
        times = time_graphs(fns, reps=20, warmup=2, rounds=args.rounds)
        print(f"\n{model} tp{tp} M={M} ({scheme.name})", flush=True)
        for label, t in times.items():
            if isinstance(t, BaseException):
                print(f"  {label:60s} FAILED {str(t)[:100]}")
                continue
            same = [i for i, other in enumerate(outputs) if other != label and torch.equal(outputs[other], outputs[label])]
            print(f"  {label:60s} {t.median_us:9.1f} us (p20 {t.p20_us:.1f} p80 {t.p80_us:.1f})  "
                  f"rel L2 {errors[label]:.2e}  bitwise equal to #{same}", flush=True)
            results.append({"model": model, "tp": int(tp), "M": M, "variant": label, "us": t.median_us,
                            "p20_us": t.p20_us, "p80_us": t.p80_us, "rel_l2": errors[label]})
        print("  (#i: the i-th variant listed, from 0)")
        del fns, times, outputs
    write_json(args.json, results)


if __name__ == "__main__":
    main()
