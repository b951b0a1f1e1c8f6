"""Probe: what GEMM2 of the GEMV path spends on quantizing its input. It reads the bf16
intermediate GEMM1 wrote and quantizes it per 1x128 group while loading (A_MODE 2, the precise
rule of per-token and block schemes), and every one of a token's programs (one per column block of
the hidden size: 512 at GLM-4.5V with blocks of 8) quantizes the same values again. GEMM2 alone
ran at 1.0-1.45 TB/s at decode sizes (BENCHMARKS.md, thirty-first session), GEMM1 at 1.7-2.6.
Timed in the same rounds, on the intermediate of the table's GEMM1, each at the table's GEMM2
launch and over column blocks and warps:

- `group`: GEMM2 reducing each group itself (A_MODE 2, the backend's own before the thirty-second
  session);
- `recorded`: the same scales from group maxima recorded beforehand (A_MODE 6, what GEMM1 records
  for it since: gemv.RECORD_GROUP_MAXIMA; here computed by torch), bitwise `group`'s output;
- `row`: one scale per row from the row's |max| first (A_MODE 5, fast mode's rule);
- `bf16`: the same bf16 values unquantized (A_MODE 0): the same bytes read, no quantization, so
  `group` minus `bf16` is what quantizing costs;
- `fp8`: the intermediate already FP8 with one per-tensor scale (A_MODE 1): half the
  intermediate's bytes and no quantization, near what the weights' reads alone allow.

and the whole layer (its config) with GEMM1 recording the group maxima and without
(`layer recorded`, `layer group`: the zeroing in x's quantize launch and GEMM1's atomics included).

Only `group` and `recorded` are the layer's numerics; the others are checked against it loosely (5e-2 relative L2:
other quantizations of the same values). Not part of the package: a measurement to decide what to
build (BENCHMARKS.md).

    PYTHONPATH=. python3 scripts/diag_gemv2_input.py [--points glm-4.5v-fp8:2:1 ...] [--json FILE]
"""
import argparse
import itertools

import torch

import moekit
from moekit.backends.triton import gemv
from moekit.spec import FP8_MAX
from moekit.timing import time_graphs
from moekit.tune.space import GEMV_START

from diag_points import layer_points, print_gemm_times, write_json  # scripts/ is on the path when a script runs

A_MODES = {"group": 2, "recorded": 6, "row": 5, "bf16": 0, "fp8": 1}  # gemv2_kernel's A_MODE of each input


def group_maxima(act: torch.Tensor) -> torch.Tensor:
    """Each row's 1x128-group maxima of |act| (pairs, groups), as GEMM1 records them."""
    padded = torch.nn.functional.pad(act.float().abs(), (0, -act.shape[1] % 128))
    return padded.reshape(act.shape[0], -1, 128).amax(dim=2).contiguous()


def inputs(act: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(intermediate, the scale tensor gemv2 reads with it) of each kind."""
    scale = (act.float().abs().amax() / FP8_MAX).clamp_min(1e-12).reshape(1)
    fp8 = (act.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    unused = torch.ones(1, dtype=torch.float32, device=act.device)  # A_MODE 0, 2 and 5 read no scale
    return {"group": (act, unused), "recorded": (act, group_maxima(act)), "row": (act, unused), "bf16": (act, unused),
            "fp8": (fp8, scale)}


def recording(on: bool, fn):
    """`fn` run with gemv.RECORD_GROUP_MAXIMA = on (set inside, so a CUDA graph captures those launches)."""
    def run():
        before = gemv.RECORD_GROUP_MAXIMA
        gemv.RECORD_GROUP_MAXIMA = on
        try:
            return fn()
        finally:
            gemv.RECORD_GROUP_MAXIMA = before
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", default=["glm-4.5v-fp8:2:1", "glm-4.5v-fp8:2:2", "glm-4.5v-fp8:2:4",
                                                    "deepseek-v3:8:1", "deepseek-v3:8:2", "deepseek-v3:8:8",
                                                    "mixtral-8x7b:1:1:fp8-channel-token", "mixtral-8x7b:1:2:fp8-channel-token"])
    ap.add_argument("--block-n", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    backend = moekit.get_backend("triton")
    results = []
    for p in layer_points(args.points, dev):
        table = backend.config_for(p.w, p.shape.top_k, p.M, dev)
        cfg = table if table.GEMV else GEMV_START
        a, a_scale = gemv.quantize_input(p.x, p.w)
        act, act_scale, a_mode = gemv.gemv1(a, a_scale, p.w, p.ids, p.x.dtype, cfg, False)
        if a_mode not in (A_MODES["group"], A_MODES["recorded"]):
            raise SystemExit(f"{p.model}: its intermediate is quantized with A_MODE {a_mode}, not per 1x128 group")
        expected = gemv.gemv2(act, act_scale, a_mode, p.w, p.tw, p.ids, p.x.dtype, cfg)
        launches = {"table": cfg}
        launches.update({f"N{n} w{w}": cfg.with_gemm2(BLOCK_N=n, num_warps=w, num_stages=1)
                         for n, w in itertools.product(args.block_n, args.warps)})
        layer = lambda cfg=cfg, p=p: backend.run(p.x, p.w, p.tw, p.ids, config=cfg)  # noqa: E731
        fns = {"layer recorded": recording(True, layer), "layer group": recording(False, layer)}
        if not torch.equal(fns["layer recorded"](), fns["layer group"]()):
            raise SystemExit(f"{p.model} M={p.M}: the layer with recorded group maxima is not bitwise the other")
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
        for label, us in print_gemm_times({k: times[k] for k in ("layer recorded", "layer group")}, 0, 0, width=26):
            results.append({"model": p.model, "tp": p.tp, "M": p.M, "what": label, "us": us})
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
