"""GEMM2 of the GEMV path alone with a K step of its own: today its step is tied to GEMM1's
(gemv.gemm2_groups: one 128-group per pair at top-8), and its column block is 4 or 8. Here the
step runs from one group to the whole intermediate (GLM-4.5V TP2: 704 = 6 groups, in a step of
8; DeepSeek-V3 TP8: 256 = 2) with column blocks down to 1, so that a program may issue all its
loads at once, each pair's rows read end to end. Timed against the table's own GEMM2 launch on
the intermediate of the table's GEMM1, in the same rounds; every variant's output is compared
with the table launch's (the sums change order across groups, so within a few bf16 ulps).

    PYTHONPATH=. python3 scripts/diag_gemv_gemm2_steps.py [--points glm-4.5v-fp8:2:1 ...] [--json FILE]
"""
import itertools

import torch

from moekit.backends.sizes import cdiv, next_pow2
from moekit.backends.triton import gemv
from moekit.timing import time_graphs

# scripts/ is on the path when a script runs
from diag_points import (cuda_triton, gemv_config, gemv_intermediate, layer_points, points_parser,
                         print_gemm_times, write_json)


def main():
    ap = points_parser(["glm-4.5v-fp8:2:1", "glm-4.5v-fp8:2:2", "deepseek-v3:8:1",
                        "deepseek-v3:8:2"])
    ap.add_argument("--block-n", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    dev, backend = cuda_triton()
    results = []
    for p in layer_points(args.points, dev):
        cfg = gemv_config(backend, p, dev)
        _, _, act, act_scale, a_mode = gemv_intermediate(p, cfg)
        expected = gemv.gemv2(act, act_scale, a_mode, p.w, p.tw, p.ids, p.x.dtype, cfg)
        whole = next_pow2(cdiv(p.w.n, 128))  # the whole intermediate in one step
        group_counts = sorted({g for g in (1, 2, 4, 8) if g <= whole})
        fns = {"gemm2 table": lambda: gemv.gemv2(act, act_scale, a_mode, p.w, p.tw, p.ids, p.x.dtype, cfg)}
        for block_n, groups, warps, stages in itertools.product(args.block_n, group_counts, args.warps, args.stages):
            tag = f"gemm2 N{block_n} G{groups} w{warps} s{stages}"
            def fn(launch=cfg.with_gemm2(BLOCK_N=block_n, num_warps=warps, num_stages=stages), g=groups, act=act,
                   act_scale=act_scale, a_mode=a_mode, p=p):
                return gemv.gemv2(act, act_scale, a_mode, p.w, p.tw, p.ids, p.x.dtype, launch, groups=g)
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # out of registers or shared memory, say: reported, not timed
                print(f"  {tag}: cannot run: {str(exc)[:160]}")
                continue
            rel = float((out.float() - expected.float()).norm() / expected.float().norm())
            if rel > 5e-3:
                print(f"  {tag}: differs from the table's GEMM2, rel L2 {rel:.1e}: not timed")
                continue
            fns[tag] = fn
        times = time_graphs(fns, reps=20, warmup=2, rounds=4)
        print(f"\n{p.model} tp{p.tp} M={p.M}: GEMM1 {cfg}", flush=True)
        nbytes = int(torch.unique(p.ids).numel()) * p.w.hidden * p.w.n
        ranked = dict(sorted(((k, v) for k, v in times.items() if not isinstance(v, BaseException)),
                             key=lambda kv: kv[1].median_us)[:12])
        for label, us in print_gemm_times(ranked, 0, nbytes, width=26):
            results.append({"model": p.model, "tp": p.tp, "M": p.M, "what": label, "us": us})
        if "gemm2 table" not in ranked:  # slower than the twelve fastest: its time all the same
            print(f"  gemm2 table {times['gemm2 table'].median_us:.1f} us")
            results.append({"model": p.model, "tp": p.tp, "M": p.M, "what": "gemm2 table",
                            "us": times["gemm2 table"].median_us})
        torch.cuda.empty_cache()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
