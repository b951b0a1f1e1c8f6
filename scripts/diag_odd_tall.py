"""Why does the 128-row GEMM1 miss the max-error bound at E=5, H=640, N=160 fp8-channel-token on a
GPU (test_gpu_tall_overlapped_gemm1_odd_shapes, max rel 2.1e-2 against 2e-2) while the interpreter
gives 4e-3? Prints, per routing of that test, the error of the 128-row and 64-row Triton tiles
against the reference and float64, whether the two tiles agree bitwise, and where the largest error
sits (row, column, value).

    PYTHONPATH=. python3 scripts/diag_odd_tall.py
"""
import dataclasses
import sys

sys.path.insert(0, "tests")
import torch  # noqa: E402

import moekit  # noqa: E402
from helpers import max_rel, random_routing, random_weights, random_x, rel_l2  # noqa: E402
from moekit.backends.triton import KernelConfig  # noqa: E402
from moekit.check import float64_moe  # noqa: E402
from test_triton_backend import reference_for  # noqa: E402

TILE = KernelConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
TALL = dataclasses.replace(TILE, BLOCK_M=128)
tb = moekit.get_backend("triton")
for N in (160, 192, 208):
    E, H, K = 5, 640, 2
    w = random_weights(E, H, N, "fp8-channel-token", device="cuda")
    for M, experts in ((1, None), (300, None), (300, [0, 2, 4]), (252, [0, 2, 4])):
        tw, ids = random_routing(M, E, K, device="cuda", experts=experts)
        x = random_x(M, H, device="cuda")
        ref = reference_for(x, w, tw, ids)
        f64 = float64_moe(x, w, tw, ids, intermediate_granularity="group")
        outs = {name: tb.run(x, w, tw.float(), ids, config=cfg) for name, cfg in (("tall", TALL), ("tile", TILE))}
        line = [f"N={N} M={M} experts={experts}", f"ref-vs-f64 {rel_l2(ref, f64):.2e}/{max_rel(ref, f64):.2e}"]
        for name, out in outs.items():
            d = (out.double() - ref.double()).abs()
            r, c = divmod(int(d.argmax()), d.shape[1])
            line.append(f"{name}: rel {rel_l2(out, ref):.2e} max {max_rel(out, ref):.2e} f64 {max_rel(out, f64):.2e} "
                        f"at ({r},{c}) out {float(out[r, c]):.4f} ref {float(ref[r, c]):.4f} f64 {float(f64[r, c]):.4f}")
        line.append(f"tall==tile {torch.equal(outs['tall'], outs['tile'])}")
        print(" | ".join(line), flush=True)
