"""The triton layer with its weight tiles loaded through TMA (KernelConfig.TMA) against the
pointer loads, in both accumulation modes, and (EXPERIMENT) precise mode with GEMM1's FP8
promotion every PROMOTE_STEPS K steps: same interleaved rounds, each variant's relative L2 error
against the reference beside its time.

    PYTHONPATH=. python3 scripts/diag_tma.py [--points glm-4.5v-fp8:2:4096 ...] [--json FILE]
"""
import argparse
import dataclasses
import json
import os
import time

import torch

import moekit
from moekit.backends.reference import reference_moe
from moekit.backends.triton import launch
from moekit.bench import make_weights, make_x, uniform_routing
from moekit.check import intermediate_granularity
from moekit.models import get_model
from moekit.spec import get_scheme
from moekit.timing import time_graphs

SCHEME_OF = {"deepseek-v3": "fp8-block128"}
STEPS_ENV = "MOEKIT_EXPERIMENT_PROMOTE_STEPS"


def with_env(env: dict, fn):
    def run():
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return run


def rel_l2(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", default=[
        "glm-4.5v-fp8:2:1024", "glm-4.5v-fp8:2:4096", "glm-4.5v-fp8:2:8192",
        "deepseek-v3:8:4096", "deepseek-v3:8:8192",
        "mixtral-8x7b:1:1024", "mixtral-8x7b:1:4096"])
    ap.add_argument("--steps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--no-tma", action="store_true")
    ap.add_argument("--ws", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    backend = moekit.get_backend("triton")
    results, weights_of = [], {}
    for point in args.points:
        t0 = time.time()
        name, tp, M = point.split(":")
        tp, M = int(tp), int(M)
        scheme = get_scheme(SCHEME_OF.get(name, "fp8-channel-token"))
        shape = get_model(name, tp).shape
        if (name, tp) not in weights_of:
            weights_of.clear()
            torch.cuda.empty_cache()
            weights_of[(name, tp)] = make_weights(shape, scheme, dev)
        w = weights_of[(name, tp)]
        E, K, H = shape.num_experts, shape.top_k, shape.hidden
        x = make_x(M, H, dev)
        tw, ids = (t.to(dev) for t in uniform_routing(M, E, K))
        tw = tw.float()
        precise = {"MOEKIT_FP8_ACCUMULATION": "precise"}
        fast = {"MOEKIT_FP8_ACCUMULATION": "fast"}
        cfg = with_env(precise, lambda: backend.config_for(w, K, M, dev))()
        cfg_fast = with_env(fast, lambda: backend.config_for(w, K, M, dev))()
        tma = dataclasses.replace(cfg, TMA=1, JOIN=0)
        tma_fast = dataclasses.replace(cfg_fast, TMA=1, JOIN=0)
        variants = {"precise": (precise, cfg)}
        if not args.no_tma:
            variants["precise tma"] = (precise, tma)
        if scheme.weight != "block":  # per-step scales: no promotion to space out
            for s in args.steps:  # s K steps unrolled: s times the shared memory per stage
                stages = cfg.num_stages // s
                if stages >= 2:
                    fewer = dataclasses.replace(cfg, num_stages=stages, num_stages2=cfg.gemm2().num_stages)
                    variants[f"precise p{s} s{stages}"] = ({**precise, STEPS_ENV: str(s)}, fewer)
                    variants[f"precise s{stages}"] = (precise, fewer)
            variants["fast"] = (fast, cfg_fast)
            if not args.no_tma:
                variants["fast tma"] = (fast, tma_fast)
        if args.ws:
            ws = {"MOEKIT_EXPERIMENT_WS": "1"}
            variants = {"precise": (precise, cfg), "precise tma": (precise, tma),
                        "precise ws": ({**precise, **ws}, cfg), "precise tma ws": ({**precise, **ws}, tma)}
            if scheme.weight != "block":
                variants.update({"fast": (fast, cfg_fast), "fast tma ws": ({**fast, **ws}, tma_fast),
                                 "fast unjoined ws": ({**fast, **ws}, dataclasses.replace(cfg_fast, JOIN=0))})
        fns, errors = {}, {}
        for label, (env, c) in variants.items():
            run = with_env(env, lambda c=c: backend.run(x, w, tw, ids, config=c))
            try:
                out = run()
            except Exception as e:  # noqa: BLE001 - a variant that cannot compile is reported, not fatal
                print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            fns[label] = run
            gran = with_env(env, lambda: intermediate_granularity("triton", scheme))()
            errors[label] = rel_l2(out, reference_moe(x, w, tw, ids, intermediate_granularity=gran))
        times = time_graphs(fns, reps=20, warmup=2, rounds=4)
        print(f"\n{name} tp{tp} M={M} ({scheme.name}) config {cfg}; fast {cfg_fast}  [{time.time() - t0:.0f} s]", flush=True)
        for label in fns:
            t = times[label]
            if isinstance(t, BaseException):
                print(f"  {label:18s} FAILED {str(t)[:200]}", flush=True)
                continue
            print(f"  {label:18s} {t.median_us:9.1f} us  (p20 {t.p20_us:.1f} p80 {t.p80_us:.1f})  rel L2 {errors[label]:.2e}",
                  flush=True)
            results.append({"point": point, "variant": label, "us": t.median_us, "p20": t.p20_us, "p80": t.p80_us,
                            "rel_l2": errors[label], "config": dataclasses.asdict(variants[label][1])})
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        del fns, times
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
