"""The triton layer at decode sizes: the tiled path (the table's config, or the default one where
the table runs the GEMV path) against the GEMV path
(KernelConfig.GEMV) over the tuner's GEMV configs (tune.space.gemv_space: K steps to 1024, pipelined
K loops; those that fit the device's shared memory) and the table's own where it runs that path; with --parts also each launch of the layer timed alone (the
prologue, GEMM1, GEMM2, the combine), an empty graph as the floor of what one replay costs, and
GEMM1 and GEMM2 each over a sweep of tile widths, warps and stages (the tuner times them only
together, with one config for both). Bandwidth = the expert weights a GEMM must read / its time.
With --pdl, the tiled layer and every GEMV config also with programmatic dependent launch off
(MOEKIT_PDL=0), in the same rounds.

    PYTHONPATH=. python3 scripts/diag_decode.py [--models glm-4.5v-fp8:2 mixtral-8x7b:1:fp8-channel-token]
        [--batch-sizes 1 2 4 8 16] [--parts] [--pdl] [--json FILE]
"""
import argparse
import dataclasses
import itertools
import os
from unittest import mock

import torch

import moekit
from moekit.backends.triton import launch
from moekit.backends.triton.config import default_config
from moekit.backends.triton.launch import PDL_ENV
from moekit.inputs import make_weights, make_x, uniform_routing
from moekit.timing import time_graphs
from moekit.tune import space

from diag_points import parse_model, print_gemm_times, write_json  # scripts/ is on the path when a script runs


def gemv_sweep(scheme, top_k, device):
    """The GEMV configs the tuner searches (GEMM2 on GEMM1's launch; the table's own config, GEMM2
    launch and all, is timed besides), those that fit the device's shared memory. Not
    space.static_prune: it also drops the GEMV path beyond config.gemv_may_win's bound, where a
    diagnosis still wants to see by how much it loses."""
    limit, _ = space.shared_memory_limit(device)
    return [c for c in space.gemv_space()
            if not c.problems(scheme) and space.gemv_shared_memory_bytes(c, scheme, top_k) <= limit]


def sweep(base):
    for bn, warps, stages in itertools.product((16, 32, 64, 128), (2, 4), (3, 4, 5, 6)):
        yield dataclasses.replace(base, BLOCK_N=bn, num_warps=warps, num_stages=stages, GROUP_M=1, JOIN=0)


def pdl_off(fn):
    """fn with programmatic dependent launch off while it runs (and so while a graph captures it)."""
    return mock.patch.dict(os.environ, {PDL_ENV: "0"})(fn)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["glm-4.5v-fp8:2", "mixtral-8x7b:1:fp8-channel-token", "deepseek-v3:8"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--parts", action="store_true", help="also each launch alone and the GEMM sweeps")
    ap.add_argument("--pdl", action="store_true", help="also everything with programmatic dependent launch off")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    backend = moekit.get_backend("triton")
    results = []
    for spec in args.models:
        name, tp, model, scheme = parse_model(spec)
        shape = model.shape
        w = make_weights(shape, scheme, dev)
        E, K, H, N = shape.num_experts, shape.top_k, shape.hidden, w.n
        for M in args.batch_sizes:
            x = make_x(M, H, dev)
            tw, ids = (t.to(dev) for t in uniform_routing(M, E, K))
            tw = tw.float()
            used = int(torch.unique(ids).numel())
            cfg = backend.config_for(w, K, M, dev)
            table_gemv = cfg if cfg.GEMV else None
            if cfg.GEMV:  # the table runs the GEMV path here: the tiled baseline is the default config
                cfg = default_config(shape, scheme, M)
            align, a, a_scale = launch.align_and_quantize(x, w, ids, cfg.BLOCK_M)
            act = launch.gemm1(a, a_scale, w, align, K, x.dtype, cfg)
            pairs = launch.gemm2(act, w, align, tw, x.dtype, cfg)
            one = torch.zeros(1, device=dev)
            fns = {
                "empty graph": lambda: one.add_(1),
                "layer": lambda: backend.run(x, w, tw, ids, config=cfg),
            }
            tiled = backend.run(x, w, tw, ids, config=cfg).float()
            for c in gemv_sweep(scheme, K, dev):
                diff = float((backend.run(x, w, tw, ids, config=c).float() - tiled).norm() / tiled.norm())
                assert diff < 1e-2, f"GEMV {c} differs from the tiled path by {diff:.2e} (relative L2)"
                fns[f"layer {space.config_key(c)}"] = lambda c=c: backend.run(x, w, tw, ids, config=c)
            if table_gemv is not None:
                fns[f"layer table {space.config_key(table_gemv)}"] = lambda: backend.run(x, w, tw, ids, config=table_gemv)
            if args.pdl:
                fns.update({f"{label} (PDL off)": pdl_off(fn) for label, fn in fns.items() if label.startswith("layer")})
            parts = {
                "prologue": lambda: launch.align_and_quantize(x, w, ids, cfg.BLOCK_M),
                "gemm1": lambda: launch.gemm1(a, a_scale, w, align, K, x.dtype, cfg),
                "gemm2": lambda: launch.gemm2(act, w, align, tw, x.dtype, cfg),
                "combine": lambda: launch.combine(pairs, M, K),
            }
            for c in sweep(cfg) if args.parts else ():
                tag = f"N{c.BLOCK_N}-w{c.num_warps}-s{c.num_stages}"
                act_c = launch.gemm1(a, a_scale, w, align, K, x.dtype, c)
                parts[f"gemm1 {tag}"] = lambda c=c: launch.gemm1(a, a_scale, w, align, K, x.dtype, c)
                parts[f"gemm2 {tag}"] = lambda c=c, act_c=act_c: launch.gemm2(act_c, w, align, tw, x.dtype, c)
            if args.parts:
                fns.update(parts)
            times = time_graphs(fns, reps=20, warmup=2, rounds=4)
            bytes1, bytes2 = used * 2 * N * H, used * H * N
            print(f"\n{name} tp{tp} M={M}: {used} experts used, GEMM1 reads {bytes1 / 1e6:.1f} MB, "
                  f"GEMM2 {bytes2 / 1e6:.1f} MB; tiled config {cfg}", flush=True)
            for label, us in print_gemm_times(times, bytes1, bytes2, width=50):
                results.append({"model": name, "tp": int(tp), "M": M, "what": label, "us": us})
            del fns, times
            torch.cuda.empty_cache()
        w = None
        torch.cuda.empty_cache()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
