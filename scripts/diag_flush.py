"""Probe: does the harness's L2 flush slow down the decode reads it times? The harness zeroes a
512 MiB buffer before every replay (moekit/timing.py), which leaves the L2 full of dirty lines:
a replay's first reads must evict them, writing back about as many bytes as they read. Even a
bare read of GLM-4.5V's GEMM1 weights (46 MB) topped out near 1.8 TB/s on an H100 (BENCHMARKS.md,
thirty-second session). `flush_with="read"` reads the buffer instead, leaving clean lines.

At each point, in the same call and alternating flush methods (zero, read, zero, read):
- `layer`: the triton backend's whole layer with its table's config;
- `gemm1`, `gemm2`: the GEMV path's GEMMs alone, where the table runs that path;
- `read w13`, `read w2`: torch.amax over as many bytes of contiguous expert weights as the pairs'
  experts hold: a plain streaming read of the bytes each GEMM must read.

The reference points (vLLM's kernel, torch's grouped GEMM) were measured with the zeroing, so
every comparison with them stays with it; this tells how far the absolute decode efficiencies
understate the kernels. Not part of the package: a measurement (BENCHMARKS.md).

    PYTHONPATH=. python3 scripts/diag_flush.py [--points glm-4.5v-fp8:2:1 ...] [--json FILE]
"""

import torch

from moekit.backends.triton import gemv
from moekit.timing import FLUSH_WITH, time_graphs
from moekit.tune.space import config_key

# scripts/ is on the path when a script runs
from diag_points import cuda_triton, gemv_intermediate, layer_points, points_parser, print_gemm_times, write_json

DEFAULT_POINTS = ["glm-4.5v-fp8:2:1", "glm-4.5v-fp8:2:8", "mixtral-8x7b:1:1:fp8-channel-token",
                  "mixtral-8x7b:1:8:fp8-channel-token", "deepseek-v3:8:1", "deepseek-v3:8:8"]


def closures(backend, p, dev) -> tuple[dict, int, int]:
    """The point's closures, and the bytes of expert weights GEMM1 and GEMM2 read."""
    used = int(torch.unique(p.ids).numel())
    bytes1 = used * p.w.w13[0].numel() * p.w.w13.element_size()
    bytes2 = used * p.w.w2[0].numel() * p.w.w2.element_size()
    w13_words = p.w.w13[:used].view(torch.int32)  # the first `used` experts: the same bytes, contiguous
    w2_words = p.w.w2[:used].view(torch.int32)
    cfg = backend.config_for(p.w, p.shape.top_k, p.M, dev)
    fns = {"layer": lambda: backend.run(p.x, p.w, p.tw, p.ids, config=cfg),
           "read w13": lambda: torch.amax(w13_words), "read w2": lambda: torch.amax(w2_words)}
    if cfg.GEMV:
        a, a_scale, act, act_scale, a_mode = gemv_intermediate(p, cfg)
        fns["gemm1"] = lambda: gemv.gemv1(a, a_scale, p.w, p.ids, p.x.dtype, cfg, False)
        fns["gemm2"] = lambda: gemv.gemv2(act, act_scale, a_mode, p.w, p.tw, p.ids, p.x.dtype, cfg)
    return fns, bytes1, bytes2


def main():
    ap = points_parser(DEFAULT_POINTS)
    ap.add_argument("--passes", type=int, default=2, help="passes over the flush methods, alternating")
    args = ap.parse_args()
    dev, backend = cuda_triton()
    results = []
    for p in layer_points(args.points, dev):
        fns, bytes1, bytes2 = closures(backend, p, dev)
        print(f"\n{p.model} tp{p.tp} M={p.M}: {config_key(backend.config_for(p.w, p.shape.top_k, p.M, dev))}", flush=True)
        for n in range(args.passes):
            for flush_with in FLUSH_WITH:
                times = time_graphs(fns, reps=20, warmup=2, rounds=4, flush_with=flush_with)
                labels = {f"{name} ({flush_with})": t for name, t in times.items()}
                # the bare reads are GEMM1's and GEMM2's bytes: named so, print_gemm_times gives their TB/s
                labels = {k.replace("read w13", "gemm1 bytes read").replace("read w2", "gemm2 bytes read"): v
                          for k, v in labels.items()}
                for label, us in print_gemm_times(labels, bytes1, bytes2, width=30):
                    results.append({"model": p.model, "tp": p.tp, "M": p.M, "pass": n, "flush": flush_with,
                                    "what": label.rsplit(" (", 1)[0], "us": us})
        torch.cuda.empty_cache()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
