"""The whole layer of the triton backend in its numerics variants, against cutlass, in the same
interleaved rounds: precise (default), fast (MOEKIT_FP8_ACCUMULATION=fast: no FP8 promotion and
a per-row intermediate quantized in its own pass; the config a fast-mode table gives, see
moekit.tables), and fast with the precise table's config where that differs; also the precise layer through
`moekit.fused_moe` (its input checks included) rather than the backend directly. Each variant's relative L2 error against
the reference (with the intermediate rule that variant declares) is printed beside its time.

    PYTHONPATH=. python3 scripts/diag_fast.py [--models glm-4.5v-fp8:2 mixtral-8x7b:1]
        [--batch-sizes 1 64 1024 4096 8192] [--json FILE]
"""
import argparse
import dataclasses
import os

import torch

import moekit
from moekit.api import assert_ids_in_range
from moekit.backends.reference import reference_moe
from moekit.backends.triton import launch
from moekit.inputs import make_weights, make_x, uniform_routing
from moekit.check import intermediate_granularity
from moekit.spec import get_scheme
from moekit.timing import time_graphs

from diag_points import parse_model, write_json  # scripts/ is on the path when a script runs


def in_mode(mode: str, fn):
    """fn run with MOEKIT_FP8_ACCUMULATION=mode (read at launch, so also while a graph is captured)."""

    def run():
        old = os.environ.get(launch.FP8_ACCUMULATION_ENV)
        os.environ[launch.FP8_ACCUMULATION_ENV] = mode
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop(launch.FP8_ACCUMULATION_ENV, None)
            else:
                os.environ[launch.FP8_ACCUMULATION_ENV] = old

    return run


def rel_l2(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["glm-4.5v-fp8:2", "mixtral-8x7b:1"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 1024, 4096, 8192])
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    scheme = get_scheme("fp8-channel-token")
    triton_backend = moekit.get_backend("triton")
    results = []
    for spec in args.models:
        name, tp, preset, _ = parse_model(spec, scheme.name, scheme_field=False)
        shape = preset.shape
        w = make_weights(shape, scheme, dev)
        E, K, H = shape.num_experts, shape.top_k, shape.hidden
        for M in args.batch_sizes:
            x = make_x(M, H, dev)
            tw, ids = (t.to(dev) for t in uniform_routing(M, E, K))
            tw = tw.float()
            cfg = in_mode("precise", lambda: triton_backend.config_for(w, K, M, dev))()
            cfg_fast = in_mode("fast", lambda: triton_backend.config_for(w, K, M, dev))()  # fast tables first
            variants = {
                "precise": ("precise", cfg),
                "fast": ("fast", cfg_fast),
            }
            if cfg_fast != cfg:
                variants["fast, precise config"] = ("fast", cfg)
            fns, errors = {}, {}
            for label, (mode, c) in variants.items():
                run = in_mode(mode, lambda c=c: triton_backend.run(x, w, tw, ids, config=c))
                fns[label] = run
                granularity = in_mode(mode, lambda: intermediate_granularity("triton", scheme))()
                errors[label] = rel_l2(run(), reference_moe(x, w, tw, ids, intermediate_granularity=granularity))
            # the same precise layer through fused_moe: what its input checks add inside a graph
            fns["precise, fused_moe"] = in_mode("precise", lambda: moekit.fused_moe(x, w, tw, ids, backend="triton"))
            # the backend (which asserts the ids in its first kernel) after fused_moe's own checking
            # kernel and assertion, as fused_moe ran it before the backend checked: what that cost
            fns["precise, own id check"] = in_mode(
                "precise", lambda: (assert_ids_in_range(ids, E), triton_backend.run(x, w, tw, ids, config=cfg))[1])
            fns["cutlass"] = lambda: moekit.fused_moe(x, w, tw, ids, backend="cutlass")
            times = time_graphs(fns, reps=20, warmup=2, rounds=4)
            print(f"\n{name} tp{tp} M={M} config {cfg}" + (f", fast {cfg_fast}" if cfg_fast != cfg else ""), flush=True)
            for label in fns:
                t = times[label]
                if isinstance(t, BaseException):
                    print(f"  {label:22s} FAILED {str(t)[:100]}")
                    continue
                err = f"rel L2 {errors[label]:.2e}" if label in errors else ""
                print(f"  {label:22s} {t.median_us:9.1f} us  (p20 {t.p20_us:.1f} p80 {t.p80_us:.1f})  {err}")
                used = variants[label][1] if label in variants else cfg
                results.append({"model": name, "tp": int(tp), "M": M, "variant": label, "us": t.median_us,
                                "rel_l2": errors.get(label), "config": dataclasses.asdict(used)})
            del fns, times
            torch.cuda.empty_cache()
        w = None
        torch.cuda.empty_cache()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
