"""Probe: what GEMM2 of the GEMV path spends on quantizing its input. It reads the bf16
intermediate GEMM1 wrote and quantizes it per 1x128 group while loading (A_MODE 2, the precise
rule of per-token and block schemes), and every one of a token's programs (one per column block of
the hidden size: 512 at GLM-4.5V with blocks of 8) quantizes the same values again. GEMM2 alone
ran at 1.0-1.45 TB/s at decode sizes (BENCHMARKS.md, thirty-first session), GEMM1 at 1.7-2.6.
Timed in the same rounds, on the intermediate of the table's GEMM1, each at the table's GEMM2
launch and over column blocks and warps:

- `group`: the backend's own GEMM2 (A_MODE 2 for these schemes in precise mode);
- `row`: one scale per row from the row's |max| first (A_MODE 5, fast mode's rule);
- `bf16`: the same bf16 values unquantized (A_MODE 0): the same bytes read, no quantization, so
  `group` minus `bf16` is what quantizing costs;
- `fp8`: the intermediate already FP8 with one per-tensor scale (A_MODE 1): half the
  intermediate's bytes and no quantization, near what the weights' reads alone allow.

Only `group` is the layer's numerics; the others are checked against it loosely (5e-2 relative L2:
other quantizations of the same values). Not part of the package: a measurement to decide what to
build (BENCHMARKS.md).

    PYTHONPATH=. python3 scripts/diag_gemv2_input.py [--points glm-4.5v-fp8:2:1 ...] [--json FILE]
"""
import itertools

import torch

from moekit.backends.triton import gemv
from moekit.spec import FP8_MAX
from moekit.timing import time_graphs

# scripts/ is on the path when a script runs
from diag_points import (cuda_triton, gemv_config, gemv_intermediate, layer_points, points_parser,
                         print_gemm_times, write_json)

A_MODES = {"group": 2, "row": 5, "bf16": 0, "fp8": 1}  # gemv2_kernel's A_MODE of each input


def inputs(act: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(intermediate, the scale tensor gemv2 reads with it) of each kind."""
    scale = (act.float().abs().amax() / FP8_MAX).clamp_min(1e-12).reshape(1)
    fp8 = (act.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    unused = torch.ones(1, dtype=torch.float32, device=act.device)  # A_MODE 0, 2 and 5 read no scale
    return {"group": (act, unused), "row": (act, unused), "bf16": (act, unused), "fp8": (fp8, scale)}


def main():
    ap = points_parser(["glm-4.5v-fp8:2:1", "glm-4.5v-fp8:2:2", "deepseek-v3:8:1",
                        "deepseek-v3:8:2", "mixtral-8x7b:1:1:fp8-channel-token"])
    ap.add_argument("--block-n", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    dev, backend = cuda_triton()
    results = []
    for p in layer_points(args.points, dev):
        cfg = gemv_config(backend, p, dev)
        _, _, act, act_scale, a_mode = gemv_intermediate(p, cfg)
        if a_mode != A_MODES["group"]:
            raise SystemExit(f"{p.model}: its intermediate is quantized with A_MODE {a_mode}, not per 1x128 group")
        expected = gemv.gemv2(act, act_scale, a_mode, p.w, p.tw, p.ids, p.x.dtype, cfg)
        launches = {"table": cfg}
        launches.update({f"N{n} w{w}": cfg.with_gemm2(BLOCK_N=n, num_warps=w, num_stages=1)
                         for n, w in itertools.product(args.block_n, args.warps)})
        fns = {}
        for (kind, (act_in, scale)), (where, launch) in itertools.product(inputs(act).items(), launches.items()):
            tag = f"gemm2 {kind} {where}"

            def fn(act_in=act_in, scale=scale, mode=A_MODES[kind], launch=launch, p=p):
                return gemv.gemv2(act_in, scale, mode, p.w, p.tw, p.ids, p.x.dtype, launch)
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # out of registers, say: reported, not timed
                print(f"  {tag}: cannot run: {str(exc)[:160]}")
                continue
            rel = float((out.float() - expected.float()).norm() / expected.float().norm())
            if rel > 5e-2:
                print(f"  {tag}: differs from the table's GEMM2, rel L2 {rel:.1e}: not timed")
                continue
            fns[tag] = fn
        times = time_graphs(fns, reps=20, warmup=2, rounds=4)
        g2 = cfg.gemm2()
        print(f"\n{p.model} tp{p.tp} M={p.M}: table GEMM2 N{g2.BLOCK_N} w{g2.num_warps} s{g2.num_stages}", flush=True)
        nbytes = int(torch.unique(p.ids).numel()) * p.w.hidden * p.w.n
        for kind in A_MODES:  # per input: the table's launch and the three fastest
            mine = {k: v for k, v in times.items() if k.startswith(f"gemm2 {kind} ") and not isinstance(v, BaseException)}
            ranked = sorted(mine, key=lambda k: mine[k].median_us)[:3]
            shown = [f"gemm2 {kind} table"] + [k for k in ranked if k != f"gemm2 {kind} table"]
            for label, us in print_gemm_times({k: times[k] for k in shown if k in times}, 0, nbytes, width=26):
                results.append({"model": p.model, "tp": p.tp, "M": p.M, "what": label, "us": us})
        torch.cuda.empty_cache()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
