"""transformers' routers against the same routers fused by moekit.hf.fuse_routers (their linear,
then moekit.route's one kernel), per family at its real router size and per batch size.

Two numbers each, as scripts/bench_route.py: the device time of one call inside a CUDA graph
(moekit.timing, L2 flushed, median) and the wall time per call of back-to-back eager calls (host
launch cost included: what an eager transformers decode step pays per MoE layer). Each router is
checked against its fused form first (routers.check_router; a disagreement stops the script).

    PYTHONPATH=. python3 scripts/bench_hf_router.py [--families glm4_moe deepseek_v3 qwen3_moe mixtral llama4]
        [--batch-sizes 1 8 64 1024] [--json FILE]
"""
import argparse
import copy

import torch

from moekit.hf import routers as R
from moekit.hf.families import family_of
from moekit.timing import describe_graph_and_eager as describe, graph_and_eager

from diag_points import write_json  # scripts/ is on the path when a script runs

# (config class, its router-size keywords): GLM-4.5V, DeepSeek-V3, Qwen3-30B-A3B, Mixtral-8x7B, Llama-4-Maverick
SHAPES = {
    "glm4_moe": ("Glm4MoeConfig", dict(hidden_size=4096, n_routed_experts=128, num_experts_per_tok=8, n_group=1,
                                       topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True)),
    "deepseek_v3": ("DeepseekV3Config", dict(hidden_size=7168, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                                             topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(hidden_size=4096, num_local_experts=8, num_experts_per_tok=2)),
    "llama4": ("Llama4TextConfig", dict(hidden_size=5120, num_local_experts=128, num_experts_per_tok=1)),
}


def make_router(family_name: str, dev):
    import transformers

    cls_name, kwargs = SHAPES[family_name]
    config = getattr(transformers, cls_name)(**kwargs)
    family = family_of(family_name)
    router = family.original_class(family.router_class)(config).to(dev)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) / router.weight.shape[-1] ** 0.5)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.rand(router.weight.shape[0], generator=g) * 0.1 - 0.05)
    if R.RULES[family_name].float32_logits:
        router.float()  # transformers keeps these routers in float32 (_keep_in_fp32_modules_strict)
    else:
        router.to(torch.bfloat16)
    return router, family


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64, 1024])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--eager-calls", type=int, default=300)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev = torch.device("cuda")
    rows = []
    for name in args.families:
        router, family = make_router(name, dev)
        problem = R.check_router(router, family, torch.bfloat16)
        if problem is not None:
            raise SystemExit(f"{name}: the fused router differs from transformers': {problem}")
        fused_router = copy.deepcopy(router)  # the same weights, its class swapped as fuse_routers does
        fused_router.__class__ = R._fused_class(family.original_class(family.router_class), family)
        H = router.weight.shape[-1]
        probe = torch.randn(4, H, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():  # int32 ids: the fused forward ran, not transformers' (int64)
            out = fused_router(probe)
        ids = out[0].ids if R.RULES[name].dense_scores else out[2]
        if ids.dtype != torch.int32:
            raise SystemExit(f"{name}: the fused router ran transformers' forward (ids {ids.dtype})")
        for M in args.batch_sizes:
            hidden = torch.randn(M, H, device=dev, dtype=torch.bfloat16)

            def run(module, hidden=hidden):
                with torch.no_grad():
                    return module(hidden)

            fns = {"transformers": lambda: run(router), "fused": lambda: run(fused_router)}
            for label, r in graph_and_eager(fns, rounds=args.rounds, eager_calls=args.eager_calls).items():
                rows.append({"family": name, "E": router.weight.shape[0], "H": H, "M": M, "router": label, **r})
                print(f"{name:>12} M={M:<5} {label:>12}: {describe(r)}", flush=True)
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
