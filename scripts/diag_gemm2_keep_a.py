"""Does GEMM2 gain from keeping its row block's activations across a run of column tiles
(KernelConfig.KEEP_A2, _kernels._gemm2_resident_run)? At prefill GEMM2 reads each tile's A and B
from the L2 (DeepSeek-V3 TP8 M = 8192: about 3 GB of L2 reads beside 1.4 GB of HBM traffic, and
GEMM2 alone took 851 µs, BENCHMARKS.md thirty-third session). Where the intermediate is at most
six K steps long (DeepSeek-V3 at TP8: 2; GLM-4.5V at TP2 and Qwen3-30B-A3B: 6), a run can load A
once and pipeline its tiles.

At each point, with the table's config: GEMM2 alone with the table's launch and with KEEP_A2 over
GEMM2 widths, warps, stages and run lengths (each KEEP_A2 output checked bitwise equal to the
table's; the shared memory, registers and spills each compiled to printed; a launch that fails to
compile or run is reported and left out), in the same rounds; then the whole layer with the
table's config and with the fastest KEEP_A2 launches. Not part of the package: a measurement
(BENCHMARKS.md).

    PYTHONPATH=. python3 scripts/diag_gemm2_keep_a.py [--points glm-4.5v-fp8:2:4096 ...] [--runs 8 16] [--json FILE]
"""
import contextlib
import itertools

import torch

from moekit.backends.triton import _kernels, launch
from moekit.backends.triton.config import tuned_configs
from moekit.select import device_name
from moekit.tables import normalize_device_name
from moekit.timing import time_graphs
from moekit.tune.space import HOPPER_SHARED_MEMORY, config_key, kept_a_shared_memory_bytes

# scripts/ is on the path when a script runs
from diag_points import cuda_triton, points_parser, tiled_intermediate, tiled_points, write_json

DEFAULT_POINTS = ["glm-4.5v-fp8:2:1024", "glm-4.5v-fp8:2:4096", "glm-4.5v-fp8:2:8192"]
LAYER_BEST = 3  # KEEP_A2 launches timed in the whole layer, fastest GEMM2 alone first


def keep_a_variants(cfg, scheme, n, runs):
    """cfg's GEMM1 with GEMM2 launches keeping A: the table's own GEMM2 launch with KEEP_A2, then
    widths (block scales: dividing 128), warps, stages and `runs` (run lengths); beyond two K
    steps, where every pipeline stage holds each step's weights, narrower widths. Those whose kept
    A, weight stages and output tile exceed the shared memory (kept_a_shared_memory_bytes) are left out."""
    g2 = cfg.gemm2()
    deep = n > 2 * g2.BLOCK_K
    widths = (32, 64, 128) if deep else (64, 128) if scheme.weight == "block" else (128, 256)
    seen = []
    first = cfg.with_gemm2(N_TILES=g2.gemm2_tiles if g2.gemm2_tiles > 1 else runs[0], KEEP_A=1)
    for v in [first] + [cfg.gemm1().with_gemm2(BLOCK_N=bn, num_warps=w, num_stages=s, GROUP_M=g2.GROUP_M,
                                               BLOCK_K=g2.BLOCK_K, N_TILES=r, KEEP_A=1)
                        for bn, w, s, r in itertools.product(widths, (4, 8), (2, 3, 4), runs)]:
        if v in seen or v.problems(scheme):
            continue
        if kept_a_shared_memory_bytes(v.gemm2(), scheme, n) > HOPPER_SHARED_MEMORY:
            continue
        seen.append(v)
    return seen


@contextlib.contextmanager
def gemm2_resources(record: list):
    """Append (shared memory bytes, registers, spills) of each gemm2_kernel launched inside."""
    real = launch.launch_or_compile

    def launch_and_record(kernel, grid, *args, **kwargs):
        compiled = kernel[grid](*args, **kwargs)
        if kernel is _kernels.gemm2_kernel and compiled is not None:
            record.append((compiled.metadata.shared, getattr(compiled, "n_regs", -1), getattr(compiled, "n_spills", -1)))

    launch.launch_or_compile = launch_and_record
    try:
        yield record
    finally:
        launch.launch_or_compile = real


def gemm2_closure(p, cfg, align, act):
    return lambda: launch.gemm2(act, p.w, align, p.tw, p.x.dtype, cfg)


def main():
    ap = points_parser(DEFAULT_POINTS)
    ap.add_argument("--runs", type=int, nargs="+", default=[16], help="run lengths (column tiles per program)")
    args = ap.parse_args()
    dev, backend = cuda_triton()
    results = []
    for p, cfg in tiled_points(args.points, dev, backend):
        if not cfg.keep_a2_fits(p.shape.n):
            print(f"\n{p.model} M={p.M}: an intermediate of {p.shape.n} columns, more than "
                  f"{cfg.KEEP_A2_STEPS} K steps: skipped")
            continue
        # what ship_keepa.py checks before it edits a table: the GPU, the table file and its config here
        found = tuned_configs(p.w.shape(p.shape.top_k), p.scheme, device_name(dev))
        provenance = {"device_name": normalize_device_name(device_name(dev)), "table_config": config_key(cfg),
                      "table_file": found[1].name if found else None}
        align, a, a_scale, act = tiled_intermediate(p, cfg)
        expected = launch.gemm2(act, p.w, align, p.tw, p.x.dtype, cfg)
        variants = keep_a_variants(cfg, p.scheme, p.shape.n, args.runs)
        closures = {"table": gemm2_closure(p, cfg, align, act)}
        ran = []
        for v in variants:
            try:
                with gemm2_resources([]) as used:
                    got = launch.gemm2(act, p.w, align, p.tw, p.x.dtype, v)
                    torch.cuda.synchronize()
            except Exception as exc:  # a launch that cannot compile here (resources): reported, left out
                print(f"  {config_key(v)}: FAILED {str(exc)[:160]}", flush=True)
                continue
            equal = torch.equal(got, expected)
            smem, regs, spills = used[0] if used else (-1, -1, -1)
            print(f"  {config_key(v)}: bitwise equal to the table's GEMM2: {equal}; shared {smem // 1024} KiB, "
                  f"{regs} registers, {spills} spills", flush=True)
            if not equal:
                raise SystemExit("KEEP_A2 changed GEMM2's output")
            closures[config_key(v)] = gemm2_closure(p, v, align, act)
            ran.append(v)
        del expected
        times = time_graphs(closures, reps=20, warmup=2, rounds=4)
        print(f"\n{p.model} tp{p.tp} M={p.M}: table {config_key(cfg)}; GEMM2 alone", flush=True)
        ranked = sorted((t.median_us, name) for name, t in times.items() if not isinstance(t, BaseException))
        for us, name in ranked:
            print(f"  {us:9.1f} us  {name}")
            results.append({"model": p.model, "tp": p.tp, "M": p.M, "what": "gemm2", "config": name, "us": us})
        for name, t in times.items():
            if isinstance(t, BaseException):
                print(f"  FAILED {name}: {str(t)[:160]}")
        best = [name for _, name in ranked if name != "table"][:LAYER_BEST]
        by_name = {config_key(v): v for v in ran}
        layer = {"table": lambda: backend.run(p.x, p.w, p.tw, p.ids, config=cfg)}
        layer.update({name: (lambda v=by_name[name]: backend.run(p.x, p.w, p.tw, p.ids, config=v)) for name in best})
        times = time_graphs(layer, reps=20, warmup=2, rounds=4)
        print(f"{p.model} tp{p.tp} M={p.M}: whole layer", flush=True)
        for name, t in times.items():
            if isinstance(t, BaseException):
                print(f"  FAILED {name}: {str(t)[:160]}")
                continue
            print(f"  {t.median_us:9.1f} us (p20 {t.p20_us:.1f} p80 {t.p80_us:.1f})  {name}")
            results.append({"model": p.model, "tp": p.tp, "M": p.M, "what": "layer", "config": name,
                            "us": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us, **provenance})
        del act, align, a, a_scale
        torch.cuda.empty_cache()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
