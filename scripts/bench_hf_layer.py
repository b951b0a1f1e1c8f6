"""One GLM-4.5V-size MoE layer: moekit's FP8 experts vs transformers' grouped_mm on the same
weights dequantized to bf16 (what transformers runs for a compressed-tensors FP8 checkpoint).

    python scripts/bench_hf_layer.py [--tp 1|2] [--scheme fp8-channel-token] [--backends auto triton cutlass]
                                     [--batch-sizes 1 8 64 512 4096] [--out results.json]

Layer: 128 experts, hidden 4096, expert intermediate 1408 (704 per GPU at --tp 2), top-8,
bf16 activations; routing uniform random top-8 (seeded). Both sides get the same FP8 weights:
moekit runs them as FP8 (`MoekitExperts`, the module moekit.hf puts in a model), transformers'
`Glm4MoeExperts` (experts_implementation="grouped_mm") runs their bf16 dequantization. Timed
with moekit.timing.time_graph (CUDA graphs where they capture, L2 flushed before each replay).
Also reports each side's relative error against moekit's `reference` backend at M=64.
Needs a CUDA GPU (SM90 for grouped_mm's fast path and the FP8 kernels).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--scheme", default="fp8-channel-token")
    p.add_argument("--backends", nargs="+", default=["auto", "triton", "cutlass"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32, 128, 512, 2048, 8192])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2

    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeExperts

    import moekit
    import moekit.hf as mh
    from moekit.backends.reference import reference_moe
    from moekit.timing import time_graph

    E, H, K = 128, 4096, 8
    N = 1408 // args.tp
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    w13 = torch.randn(E, 2 * N, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, N, generator=g) / N**0.5
    weights = moekit.quantize_weights(w13, w2, args.scheme).to(dev)
    del w13, w2

    moekit_experts = mh.MoekitExperts(E, H, N, family="glm4_moe").to(dev)
    moekit_experts.load(weights)

    config = Glm4MoeConfig(hidden_size=H, moe_intermediate_size=N, n_routed_experts=E, num_experts_per_tok=K)
    config._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        hf = Glm4MoeExperts(config)
    d13, d2 = weights.dequantize()
    hf.gate_up_proj = torch.nn.Parameter(d13.to(dev, torch.bfloat16), requires_grad=False)
    hf.down_proj = torch.nn.Parameter(d2.to(dev, torch.bfloat16), requires_grad=False)
    del d13, d2
    hf.config = config

    def problem(M):
        x = torch.randn(M, H, generator=g).to(dev, torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(dev)
        w = torch.rand(M, K, generator=g).to(dev)
        return x, ids, w / w.sum(1, keepdim=True)

    results = {"layer": {"E": E, "H": H, "N": N, "top_k": K, "tp": args.tp, "scheme": args.scheme},
               "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    x, ids, w = problem(64)
    with torch.no_grad():
        ref = reference_moe(x, weights, w, ids.int()).float()
        errs = {"transformers grouped_mm (bf16 dequantized)": hf(x, ids, w).float()}
        for b in args.backends:
            moekit_experts.backend = b
            errs[f"moekit {b}"] = moekit_experts(x, ids, w).float()
    results["rel_err_vs_reference_M64"] = {k: float((v - ref).norm() / ref.norm()) for k, v in errs.items()}
    for k, v in results["rel_err_vs_reference_M64"].items():
        print(f"rel err vs reference at M=64: {k}: {v:.4f}")

    print(f"{'M':>6} {'transformers grouped_mm us':>28} " + " ".join(f"{'moekit ' + b + ' us':>20}" for b in args.backends))
    for M in args.batch_sizes:
        x, ids, w = problem(M)
        row = {"M": M}
        with torch.no_grad():
            row["transformers_grouped_mm_us"] = time_graph(lambda: hf(x, ids, w), reps=args.reps).median_us
            for b in args.backends:
                moekit_experts.backend = b
                try:
                    row[f"moekit_{b}_us"] = time_graph(lambda: moekit_experts(x, ids, w), reps=args.reps).median_us
                except Exception as e:  # a backend that cannot run this shape here
                    row[f"moekit_{b}_us"] = None
                    row[f"moekit_{b}_error"] = f"{type(e).__name__}: {e}"
        results["rows"].append(row)
        cells = " ".join(f"{row[f'moekit_{b}_us']:>20.1f}" if row[f"moekit_{b}_us"] else f"{'-':>20}" for b in args.backends)
        print(f"{M:>6} {row['transformers_grouped_mm_us']:>28.1f} {cells}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
