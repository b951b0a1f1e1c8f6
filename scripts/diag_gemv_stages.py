"""The GEMV path with its K loops pipelined (tl.range(num_stages=STAGES): Triton then moves the
weight and activation loads of the next steps into shared memory while a step is reduced) against
unpipelined loops (num_stages = 1, every table's GEMV config before the twenty-ninth session): at each point, the table's GEMV
config (GEMV_START where the table runs the tiled path there) over K steps of 256 / 512 / 1024 and
1-4 stages, the whole layer and each GEMM alone (GEMM2 on the config's own launch). Every
pipelined variant must give the same bits as its unpipelined twin (the sums are the same, in the
same order), which the script asserts before timing.

    PYTHONPATH=. python3 scripts/diag_gemv_stages.py [--points glm-4.5v-fp8:2:1 deepseek-v3:8:2]
        [--stages 1 2 3 4] [--json FILE]
"""
import dataclasses
import itertools

import torch

from moekit.backends.triton import gemv
from moekit.timing import time_graphs
from moekit.tune.space import GEMV_LATE_MAX_VALUES_PER_THREAD

# scripts/ is on the path when a script runs
from diag_points import cuda_triton, gemv_config, layer_points, points_parser, print_gemm_times, write_json


def variants(base, stages):
    """`base` at each K step the tuner's space allows its tile (space.gemv_space: at most 8192
    weights per gate or up tile; reducing late, GEMV=2, at most GEMV_LATE_MAX_VALUES_PER_THREAD
    per thread in each sum) and at each of `stages`."""
    for block_k, s in itertools.product((256, 512, 1024), stages):
        values = base.BLOCK_N * block_k
        if values <= 8192 and (base.GEMV != 2 or values <= GEMV_LATE_MAX_VALUES_PER_THREAD * 32 * base.num_warps):
            yield dataclasses.replace(base, BLOCK_K=block_k, num_stages=s)


def main():
    ap = points_parser([f"{m}:{M}{s}" for (m, s), M in itertools.product(
        (("glm-4.5v-fp8:2", ""), ("deepseek-v3:8", ""), ("mixtral-8x7b:1", ":fp8-channel-token")), (1, 2, 4, 8))],
        help="model:tp:M[:scheme] points (default: GLM-4.5V TP2, DeepSeek-V3 TP8, Mixtral at M = 1, 2, 4, 8)")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    args = ap.parse_args()
    dev, backend = cuda_triton()
    results = []
    for p in layer_points(args.points, dev):
        x, w, tw, ids = p.x, p.w, p.tw, p.ids
        used = int(torch.unique(ids).numel())
        base = gemv_config(backend, p, dev)
        a, a_scale = gemv.quantize_input(x, w)
        fns, unpipelined = {}, {}
        for c in variants(base, args.stages):
            tag = f"K{c.BLOCK_K}-s{c.num_stages}"
            try:
                out = backend.run(x, w, tw, ids, config=c)
                torch.cuda.synchronize()
            except Exception as exc:  # a variant past the shared memory, say: reported, not timed
                print(f"  {p.model} M={p.M} {tag}: cannot run: {str(exc)[:160]}")
                continue
            if c.BLOCK_K not in unpipelined:
                twin = dataclasses.replace(c, num_stages=1, num_stages2=0)  # the same launch, loops unpipelined
                unpipelined[c.BLOCK_K] = backend.run(x, w, tw, ids, config=twin)
            assert torch.equal(out, unpipelined[c.BLOCK_K]), f"{p.model} M={p.M} {tag} differs from its unpipelined twin"
            act, act_scale, a_mode = gemv.gemv1(a, a_scale, w, ids, x.dtype, c, False)
            fns[f"layer {tag}"] = lambda c=c: backend.run(x, w, tw, ids, config=c)
            fns[f"gemm1 {tag}"] = lambda c=c: gemv.gemv1(a, a_scale, w, ids, x.dtype, c, False)
            fns[f"gemm2 {tag}"] = lambda c=c, act=act, s=act_scale, m=a_mode: gemv.gemv2(
                act, s, m, w, tw, ids, x.dtype, c)
        times = time_graphs(fns, reps=20, warmup=2, rounds=4)
        bytes1, bytes2 = used * 2 * w.n * w.hidden, used * w.hidden * w.n
        print(f"\n{p.model} tp{p.tp} M={p.M}: {used} experts used; base {base}", flush=True)
        for label, us in print_gemm_times(times, bytes1, bytes2):
            results.append({"model": p.model, "tp": p.tp, "M": p.M, "what": label, "us": us, "config": str(base)})
        del fns, times
        torch.cuda.empty_cache()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
