"""Diagnose the triton backend stage by stage: each kernel's output against float64 computed from
that kernel's own inputs, so an error is pinned to one kernel. Also runs each stage again with
every scale forced equal (weight scales 1, x with the same amax in each 128-column group): an
error that disappears then is a scale applied to the wrong rows/columns/blocks.

    PYTHONPATH=. python3 scripts/diag_triton_stages.py [--device cuda]
(TRITON_INTERPRET=1 with --device cpu and --small runs it on the CPU.)
"""
import argparse
import sys

import torch

sys.path.insert(0, "tests")
from helpers import random_routing, random_weights, random_x  # noqa: E402

import moekit  # noqa: E402
from moekit import quant  # noqa: E402
from moekit.backends.triton import launch  # noqa: E402
from moekit.backends.triton.config import KernelConfig  # noqa: E402
from moekit.check import _expert_weights64  # noqa: E402


def stages(x, w, tw, ids, cfg):
    M, K = ids.shape
    N, E = w.n, w.num_experts
    gran = w.scheme.activation
    align = launch.align_pairs(ids, E, cfg.BLOCK_M)
    a, a_scale = launch.quantize_input(x, w)
    res = {}
    # 1. input quantization against moekit.quant (the reference's rule)
    q_ref, s_ref = quant.quantize_activation(x, gran, w.a13_scale if w.scheme.static_activation else None)
    res["x scales differ"] = int((a_scale.reshape(s_ref.shape) != s_ref).sum())
    res["x fp8 differ"] = int((a.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
    a64 = quant.dequantize_activation(a, a_scale.reshape(s_ref.shape), gran).double()
    # 2. GEMM1 (+ SiLU * up, + the intermediate's quantization when fused) from the kernel's own a
    act = launch.gemm1(a, a_scale, w, align, K, x.dtype, cfg)
    start, count = align.start.tolist(), align.count.tolist()
    sorted_pairs = align.sorted_pairs.long()
    g1_err_num = g1_err_den = 0.0
    inter64 = {}
    for e in range(E):
        if count[e] == 0:
            continue
        rows = torch.arange(start[e], start[e] + count[e], device=x.device)
        pairs = sorted_pairs[rows]
        w13, _ = _expert_weights64(w, e)
        h = a64[pairs // K] @ w13.T
        # the kernel's own rounding points: x's dtype, then the intermediate's FP8 rule if fused
        want = (torch.nn.functional.silu(h[:, :N]) * h[:, N:]).to(x.dtype)
        if act.a_mode == 4:
            want = quant.fake_quantize_activation(want, "group")
        elif act.a_mode == 1:
            want = quant.fake_quantize_activation(want, "tensor", w.a2_scale)
        want = want.double()
        vals = act.values[rows]
        if act.a_mode == 4:  # fp8 with 1x128 group scales
            got = vals.double() * quant._expand_groups(act.scale[rows].double(), N, 1)
        elif act.a_mode == 1:
            got = vals.double() * act.scale.double()
        else:
            got = vals.double()
        g1_err_num += float((got - want).norm() ** 2)
        g1_err_den += float(want.norm() ** 2)
        inter64[e] = (rows, pairs, got, vals)
    # against float64 rounded at the same points: ~0 unless a rounding boundary flips (float32
    # accumulation), so anything near 1e-3 or above is a kernel error
    res["gemm1 rel"] = (g1_err_num / max(g1_err_den, 1e-300)) ** 0.5
    # 3. GEMM2 from the kernel's own intermediate (quantized as GEMM2 quantizes it, when it does)
    pairs_out = launch.gemm2(act, w, align, tw.float(), x.dtype, cfg)
    g2_num = g2_den = 0.0
    for e, (rows, pairs, got, vals) in inter64.items():
        if act.a_mode == 2:
            got = quant.fake_quantize_activation(vals, "group").double()
        elif act.a_mode == 3:
            got = quant.fake_quantize_activation(vals, "tensor").double()  # close enough for a diagnosis
        _, w2 = _expert_weights64(w, e)
        want = ((got @ w2.T) * tw.reshape(-1)[pairs].double()[:, None]).to(x.dtype).double()
        err = pairs_out[pairs].double() - want
        g2_num += float(err.norm() ** 2)
        g2_den += float(want.norm() ** 2)
    res["gemm2 rel"] = (g2_num / max(g2_den, 1e-300)) ** 0.5
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true")
    args = p.parse_args()
    # the presets' H and N, fewer experts (quicker to build; the kernels see the same tiles)
    cases = [("deepseek-tp8", 32, 7168, 256, 8, "fp8-block128"), ("qwen3", 16, 2048, 768, 8, "fp8-block128"),
             ("glm-tp2", 16, 4096, 704, 8, "fp8-channel-token")]
    if args.small:
        cases = [("small", 4, 512, 256, 2, "fp8-block128"), ("small", 4, 512, 256, 2, "fp8-channel-token")]
    configs = [KernelConfig(16, 64, 128, 1, 4, 4), KernelConfig(64, 128, 128, 8, 8, 4), KernelConfig(16, 64, 128, 1, 4, 1)]
    for name, E, H, N, K, scheme in cases:
        w = random_weights(E, H, N, scheme, device=args.device)
        flat = moekit.MoEWeights(**{**w.__dict__})
        for t in ("w13_scale", "w2_scale"):
            if getattr(w, t) is not None:
                setattr(flat, t, torch.full_like(getattr(w, t), 1e-3))
        for M in (7, 300):
            tw, ids = random_routing(M, E, K, device=args.device, seed=M)
            x = random_x(M, H, device=args.device)
            x_flat = x.clone()
            x_flat[:, ::128] = 5.0  # every 128-group (and every row) has amax 5
            for cfg in configs:
                for label, xx, ww in (("random", x, w), ("flat scales", x_flat, flat)):
                    try:
                        r = stages(xx, ww, tw, ids, cfg)
                        print(f"{name} {scheme} M={M} {cfg} {label}: " + ", ".join(
                            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)
                    except Exception as exc:  # noqa: BLE001 - a diagnosis prints and goes on
                        print(f"{name} M={M} {cfg} {label}: ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    main()
