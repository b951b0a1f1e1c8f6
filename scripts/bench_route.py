"""`moekit.route` on a GPU: the routing kernel (routing/fused.py) against route()'s torch ops, per
model preset and batch size, in the same rounds.

Two numbers each: the device time of one call inside a CUDA graph (moekit.timing, L2 flushed,
median and p20-p80), and the wall time per call of back-to-back eager calls (host launch cost
included: what an eager decode step pays), over --eager-calls calls after a warm-up. The
outputs of the two paths are compared first (moekit.routing.agreement, as `moekit check` does;
a disagreement stops the script).

    PYTHONPATH=. python3 scripts/bench_route.py [--models glm-4.5v-fp8 deepseek-v3 mixtral-8x7b
        qwen3-30b-a3b-fp8 llama-4-maverick-fp8] [--batch-sizes 1 8 64 1024 8192] [--json FILE]
"""
import argparse

import torch

import moekit.routing as routing
from moekit.routing import agreement
from moekit.models import get_model
from moekit.timing import describe_graph_and_eager as describe, graph_and_eager

from diag_points import write_json  # scripts/ is on the path when a script runs

DEFAULT_MODELS = ["glm-4.5v-fp8", "deepseek-v3", "mixtral-8x7b", "qwen3-30b-a3b-fp8", "llama-4-maverick-fp8"]


def run_path(kernel: bool, logits, cfg, bias):
    saved = routing._use_kernel
    routing._use_kernel = lambda _logits: kernel
    try:
        return routing.route(logits, config=cfg, correction_bias=bias)
    finally:
        routing._use_kernel = saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="model presets (their routing rule and E)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64, 1024, 8192])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--eager-calls", type=int, default=500)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev = torch.device("cuda")
    rows = []
    for name in args.models:
        spec = get_model(name)
        cfg, E = spec.routing, spec.shape.num_experts
        g = torch.Generator().manual_seed(0)
        bias = (torch.rand(E, generator=g) * 0.1 - 0.05).to(dev) if cfg.use_correction_bias else None
        for M in args.batch_sizes:
            logits = (torch.randn(M, E, generator=g) * 1.5).to(dev, torch.bfloat16)
            verdict = agreement.compare(run_path(True, logits, cfg, bias), run_path(False, logits, cfg, bias),
                                        logits, cfg, bias)
            agree = f"{verdict.same}/{M} alike, {verdict.near_ties} near-ties"
            if not verdict.passed:
                raise SystemExit(f"{name} M={M}: the kernel and the torch ops disagree: {verdict}")
            fns = {"kernel": lambda: run_path(True, logits, cfg, bias),
                   "torch ops": lambda: run_path(False, logits, cfg, bias)}
            for label, r in graph_and_eager(fns, rounds=args.rounds, eager_calls=args.eager_calls).items():
                rows.append({"model": name, "E": E, "top_k": cfg.top_k, "M": M, "path": label, **r, "agreement": agree})
                print(f"{name:>22} M={M:<5} {label:>9}: {describe(r)}  [{agree}]", flush=True)
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
