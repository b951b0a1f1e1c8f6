"""Would GEMM2 gain from a launch config of its own? At prefill the tuned config serves both GEMMs
(KernelConfig), chosen by the whole layer's time; GEMM2 has a short inner dimension (704 for
GLM-4.5V at TP2, 256 for DeepSeek-V3 at TP8), so its tiles may want other widths, warps or
stages than GEMM1's. Times GEMM2 alone, on the rows and the intermediate of the table's config,
with the table's config and with variants that keep its BLOCK_M (one alignment serves both GEMMs,
so only BLOCK_M must agree), in both accumulation modes (each with its own table's config: a fast-mode table first in fast
mode); also the combine pass alone.

With --runs, instead of those variants: the table's GEMM2 launch and 128-wide tiles on 8 warps,
each with programs running that many column tiles in turn (KernelConfig.N_TILES2), checked
bitwise equal to one tile per program. With --layer as well, each of those launches is timed in the
whole layer (the triton backend with that config) rather than GEMM2 alone: what a table entry
with runs would give.

    PYTHONPATH=. python3 scripts/diag_gemm2.py [--points glm-4.5v-fp8:2:4096 ...] [--runs 4 8 0 [--layer]] [--json FILE]
"""
import argparse
import itertools

import torch

import moekit
from diag_fast import in_mode  # scripts/ is on the path when a script runs
from diag_points import parse_point, write_json
from moekit.backends.triton import launch
from moekit.backends.triton.config import get_config
from moekit.inputs import make_weights, make_x, uniform_routing
from moekit.timing import time_graphs

POINTS = ["mixtral-8x7b:1:1024:fp8-channel-token", "mixtral-8x7b:1:4096:fp8-channel-token", "glm-4.5v-fp8:2:4096", "glm-4.5v-fp8:2:8192",
          "deepseek-v3:8:4096", "deepseek-v3:8:8192"]


def variants(cfg, scheme):
    """GEMM2 launches of cfg's GEMM1 launch (KernelConfig.with_gemm2), the table's own included."""
    widths = (64, 128) if scheme.weight == "block" else (128, 256)  # block scales: BLOCK_N divides 128
    for bn, warps, stages, group in itertools.product(widths, (4, 8), (3, 4), (1, 8)):
        v = cfg.gemm1().with_gemm2(BLOCK_N=bn, num_warps=warps, num_stages=stages, GROUP_M=group, BLOCK_K=cfg.gemm2().BLOCK_K)
        if not v.problems(scheme):
            yield v


def tag(c):
    """GEMM2's launch of config c."""
    g2 = c.gemm2()
    return f"N{g2.BLOCK_N} w{g2.num_warps} s{g2.num_stages} G{g2.GROUP_M} run{g2.gemm2_tiles}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", default=POINTS, help="model:tp:M[:scheme]")
    ap.add_argument("--modes", nargs="+", default=["precise", "fast"], choices=["precise", "fast"])
    ap.add_argument("--runs", type=int, nargs="+",
                    help="time the table's GEMM2 launch and N128 w8 s3 with programs running this many column "
                         "tiles each (0: all), instead of the launch variants")
    ap.add_argument("--layer", action="store_true",
                    help="with --runs: time the whole layer with each GEMM2 launch instead of GEMM2 alone")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.layer and not args.runs:
        ap.error("--layer times the launches of --runs; give --runs too")
    triton_backend = moekit.get_backend("triton")
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    results, weights_of = [], {}
    for point in args.points:
        (model, tp, preset, scheme), M = parse_point(point)
        shape = preset.shape
        key = (model, tp, scheme.name)
        if key not in weights_of:
            weights_of.clear()
            torch.cuda.empty_cache()
            weights_of[key] = make_weights(shape, scheme, dev)  # one model's weights at a time
        w = weights_of[key]
        M = int(M)
        E, K, N, H = shape.num_experts, shape.top_k, shape.n, shape.hidden
        x = make_x(M, H, dev)
        tw, ids = uniform_routing(M, E, K)
        tw, ids = tw.to(dev).float(), ids.to(dev)
        a, a_scale = launch.quantize_input(x, w)
        flops2 = 2 * M * K * N * H
        fns = {}
        for mode in args.modes:
            cfg = in_mode(mode, lambda: get_config(shape, scheme, M, name))()  # the mode's own table first
            align = launch.align_pairs(ids, E, cfg.BLOCK_M)
            # the intermediate as the backend hands it over in this mode (fast: one scale per row)
            act = in_mode(mode, lambda: launch.gemm1(a, a_scale, w, align, K, x.dtype, cfg))()
            if args.runs:  # runs of column tiles per program (KernelConfig.N_TILES2)
                alt = cfg.gemm1().with_gemm2(BLOCK_N=128, num_warps=8, num_stages=3, BLOCK_K=cfg.gemm2().BLOCK_K)
                for launch_cfg in [cfg] + ([alt] if alt != cfg and not alt.problems(scheme) else []):
                    n_blocks = -(-H // launch_cfg.gemm2().BLOCK_N)
                    runs = [1] + [r or n_blocks for r in args.runs]
                    if launch_cfg is cfg and cfg.gemm2_tiles not in runs:
                        runs.append(cfg.gemm2_tiles)  # the table's own runs are always timed
                    for n_tiles in runs:
                        v = launch_cfg.with_gemm2(N_TILES=n_tiles)
                        label = f"{mode} {'TABLE ' if v == cfg else ''}{tag(v)}"
                        if args.layer:  # the whole layer with this config: alignment, both GEMMs, combine
                            fns[label] = in_mode(mode, lambda v=v, x=x, w=w, tw=tw, ids=ids: triton_backend.run(x, w, tw, ids, config=v))
                        else:
                            fns[label] = in_mode(mode, lambda act=act, v=v, align=align: launch.gemm2(act, w, align, tw, x.dtype, v))
                        if n_tiles == 1:
                            first = fns[label]()
                        elif not torch.equal(fns[label](), first):  # the same tiles, the same sums
                            print(f"  {label}: OUTPUT DIFFERS from run1", flush=True)
                continue
            for v in [cfg] + [v for v in variants(cfg, scheme) if v != cfg]:
                label = f"{mode} {'TABLE ' if v == cfg else ''}{tag(v)}"
                fns[label] = in_mode(mode, lambda act=act, v=v, align=align: launch.gemm2(act, w, align, tw, x.dtype, v))
        pairs = in_mode(mode, lambda: launch.gemm2(act, w, align, tw, x.dtype, cfg))()
        fns["combine alone"] = lambda pairs=pairs: launch.combine(pairs, M, K)
        times = time_graphs(fns, reps=20, warmup=2, rounds=3)
        print(f"\n{model} tp{tp} M={M} table config ({args.modes[-1]}) {cfg} (E={E} K={K} N={N} H={H})", flush=True)
        best = {}
        for label, t in times.items():
            if isinstance(t, BaseException):
                print(f"  {label:40s} FAILED {str(t)[:100]}")
                continue
            us = t.median_us
            mode = label.split()[0]
            if label != "combine alone" and (mode not in best or us < best[mode][1]):
                best[mode] = (label, us)
            rate = "" if args.layer else f"  {flops2 / us / 1e6:7.1f} TFLOP/s (GEMM2)"
            print(f"  {label:40s} {us:9.1f} us (p20 {t.p20_us:.1f} p80 {t.p80_us:.1f}){rate}")
            results.append({"model": model, "tp": int(tp), "M": M, "what": label, "us": us})
        for mode, (label, us) in best.items():
            table = next(t.median_us for lab, t in times.items() if lab.startswith(f"{mode} TABLE"))
            print(f"  best {mode}: {label} {us:.1f} us, table's {table:.1f} us ({table / us:.2f}x)")
        del fns, times
    write_json(args.json, results)


if __name__ == "__main__":
    main()
