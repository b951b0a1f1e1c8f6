"""Diagnose triton accuracy on a GPU: error against the reference and a float64 computation at
preset shapes, for several tile configs (MOEKIT_FP8_ACCUMULATION=fast: the tensor cores' own accumulation).

    PYTHONPATH=. python3 scripts/diag_triton_accuracy.py
"""
import sys
sys.path.insert(0, "tests")
from helpers import random_routing, random_x, random_weights, rel_l2, max_rel
import moekit
from moekit.backends.triton import launch
from moekit.backends.triton.config import KernelConfig
from moekit.backends.reference import reference_moe
from moekit.check import float64_moe
print('FP8 accumulation:', launch.fp8_accumulation())
cases = [("deepseek", (256, 7168, 256, 8, "fp8-block128"), 7), ("deepseek", (256, 7168, 256, 8, "fp8-block128"), 300),
         ("qwen3", (128, 2048, 768, 8, "fp8-block128"), 1), ("mixtral", (8, 4096, 14336, 2, "fp8-channel-token"), 300),
         ("glm", (128, 4096, 704, 8, "fp8-channel-token"), 7), ("qwen3-bf16", (128, 2048, 768, 8, "bf16"), 7)]
tb = moekit.get_backend("triton")
for name, (E, H, N, K, scheme), M in cases:
    w = random_weights(E, H, N, scheme, device="cuda")
    tw, ids = random_routing(M, E, K, device="cuda", seed=M)
    x = random_x(M, H, device="cuda")
    g = "group" if scheme == "fp8-channel-token" else None
    ref = reference_moe(x, w, tw, ids, intermediate_granularity=g)
    ref_tok = reference_moe(x, w, tw, ids)
    out = tb.run(x, w, tw.float(), ids.int())
    f64 = float64_moe(x, w, tw, ids, intermediate_granularity=g)
    print(name, M, "vs float64: triton", round(rel_l2(out, f64), 5), "reference", round(rel_l2(ref, f64), 5), "bf16(f64)", round(rel_l2(f64.bfloat16(), f64), 5))
    if scheme != "bf16":  # which quantization rules does the kernel really apply? (the smallest error wins)
        for xg in ("token", "group"):
            for ig in ("token", "group"):
                alt = float64_moe(x, w, tw, ids, intermediate_granularity=ig, input_granularity=xg)
                print(f"    x per {xg}, intermediate per {ig}: triton {rel_l2(out, alt):.5f}")
    print(name, M, "default", tb.config_for(w, K, M, x.device), "rel", round(rel_l2(out, ref), 5), "max", round(max_rel(out, ref), 5), "vs token-ref", round(rel_l2(out, ref_tok), 5))
    for cfg in [KernelConfig(16, 64, 128, 1, 4, 4), KernelConfig(64, 128, 128, 8, 8, 4)]:
        try:
            o = tb.run(x, w, tw.float(), ids.int(), config=cfg)
            print("   ", cfg, round(rel_l2(o, ref), 5), round(max_rel(o, ref), 5))
        except Exception as e:
            print("   ", cfg, "ERR", str(e)[:100])
    orig = launch._row_quant_mode
    launch._row_quant_mode = lambda s: None
    o = tb.run(x, w, tw.float(), ids.int())
    launch._row_quant_mode = orig
    print("    no prologue", round(rel_l2(o, ref), 5))
    # reference in fp64 with different granularities
    r2 = reference_moe(x.double().bfloat16(), w, tw, ids, intermediate_granularity=g)
    print("    ref vs itself", rel_l2(r2, ref))
