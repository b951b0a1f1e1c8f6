"""x's quantization in chunks of columns (launch.QUANTIZE_CHUNK: one program per row and chunk where
the row's scale needs no more than the chunk) against one program per row (0), at decode and
small prefill sizes: the quantize launch alone (quantize_input) and the whole layer on the table's
config, in the same rounds. Every chunk size must give the layer's bits of a whole row per
program, which the script asserts before timing. DeepSeek-V3's 1x128 groups are chunked; GLM-4.5V's
per-token scales keep whole rows (a control: its times should not move).

    PYTHONPATH=. python3 scripts/diag_quantize_chunks.py [--points deepseek-v3:8:1 ...] [--chunks 0 512 1024 2048]
        [--json FILE]
"""

import torch

from moekit.backends.triton import launch
from moekit.timing import time_graphs

# scripts/ is on the path when a script runs
from diag_points import cuda_triton, layer_points, points_parser, print_gemm_times, write_json


def with_chunk(chunk, fn):
    """`fn` run with QUANTIZE_CHUNK = chunk (set inside, so a CUDA graph captures that launch)."""
    def run():
        before = launch.QUANTIZE_CHUNK
        launch.QUANTIZE_CHUNK = chunk
        try:
            return fn()
        finally:
            launch.QUANTIZE_CHUNK = before
    return run


def main():
    ap = points_parser(["deepseek-v3:8:1", "deepseek-v3:8:2", "deepseek-v3:8:8",
                        "deepseek-v3:8:64", "glm-4.5v-fp8:2:1", "glm-4.5v-fp8:2:8"])
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 1024, 2048])
    args = ap.parse_args()
    dev, backend = cuda_triton()
    results = []
    for p in layer_points(args.points, dev):
        cfg = backend.config_for(p.w, p.shape.top_k, p.M, dev)
        fns, first = {}, None
        for chunk in args.chunks:
            layer = with_chunk(chunk, lambda: backend.run(p.x, p.w, p.tw, p.ids, config=cfg))
            out = layer()
            first = out if first is None else first
            assert torch.equal(out, first), f"{p.model} M={p.M}: chunks of {chunk} changed the layer's bits"
            fns[f"quantize chunk {chunk}"] = with_chunk(chunk, lambda: launch.quantize_input(p.x, p.w))
            fns[f"layer chunk {chunk}"] = layer
        times = time_graphs(fns, reps=20, warmup=2, rounds=6)
        print(f"\n{p.model} tp{p.tp} M={p.M}: {cfg}", flush=True)
        for label, us in print_gemm_times(times, 0, 0):
            results.append({"model": p.model, "tp": p.tp, "M": p.M, "what": label, "us": us, "config": str(cfg)})
        torch.cuda.empty_cache()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
