"""Time moekit's MoE layer under tensor or expert parallelism, communication included.

    torchrun --nproc-per-node 2 scripts/bench_distributed.py --model glm-4.5v-fp8 --tp 2
    torchrun --nproc-per-node 8 scripts/bench_distributed.py --model deepseek-v3 --ep 8 --batch-sizes 1,64,1024

--tp N: every rank holds 1/N of every expert's intermediate size and the whole batch
        (moekit.distributed.tp_fused_moe: local experts, then a float32 all-reduce).
--ep N: every rank holds E/N whole experts and its OWN batch of --batch-sizes tokens (so the
        layer processes N times that many tokens; moekit.distributed.ep_fused_moe: count exchange,
        dispatch, local experts, return, combine).
N must equal the number of processes (WORLD_SIZE).

Two measurements per batch size, each the median over --reps back-to-back calls after --warmup
(CUDA events on GPUs, perf_counter on CPUs), each rank timing itself; the reported value is the
slowest rank's median (all-reduce MAX):
  layer_us  the whole distributed layer: local experts and every collective;
  comm_us   the collectives alone, run on buffers of the same sizes with nothing else
            (TP: the all-reduce; EP: count exchange with its host sync, dispatch, return);
  comm_share = comm_us / layer_us. Measured apart, communication cannot overlap or wait on
  compute, so the share is an estimate of what the layer spends communicating.
Without a CUDA GPU the run uses gloo and a scaled-down shape (hidden <= 256, N per rank <= 128,
experts <= 16): its numbers say nothing about GPUs, it checks the script end to end.
--check compares each rank's output with single-process fused_moe on the full weights (rel_l2).
Rank 0 prints a table and, with --out, writes {"meta": ..., "rows": [...]} as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

import moekit
import moekit.distributed as md
from moekit import bench, inputs
from moekit.backends import get_backend
from moekit.cli import TP_FLAGS
from moekit.models import get_model
from moekit.spec import BLOCK, MoEShape, get_scheme

CPU_HIDDEN, CPU_N_PER_RANK, CPU_MAX_EXPERTS = 256, 128, 16
GPU_BATCH_SIZES = (1, 8, 64, 256, 1024, 4096)
CPU_BATCH_SIZES = (1, 16)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """Every rank parses the same command line: only rank 0 prints the usage error (torchrun's
    own report of the failed ranks follows), every rank exits with status 2."""

    def error(self, message):
        if os.environ.get("RANK", "0") == "0":
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked before any process group is joined: a bad model, scheme or
    backend name is one line from rank 0 and exit status 2 (not a traceback from every rank)."""
    p = _Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(*TP_FLAGS, dest="tp", type=_positive, help="tensor parallel over this many ranks (= WORLD_SIZE)")
    mode.add_argument("--ep", type=_positive, help="expert parallel over this many ranks (= WORLD_SIZE)")
    p.add_argument("--model", default="glm-4.5v-fp8", help="a preset name or a config.json path")
    p.add_argument("--scheme", help="override the model's quantization scheme")
    p.add_argument("--backend", default="auto", help="single-device backend of the local experts (default: auto)")
    p.add_argument("--batch-sizes", "--batch-size", dest="batch_sizes", nargs="+", action="extend", metavar="M",
                   help="tokens (TP: the batch; EP: each rank's tokens), space- or comma-separated; repeatable")
    p.add_argument("--routing", choices=bench.ROUTINGS, default="uniform")
    p.add_argument("--reps", type=_positive, help="timed calls (default 50 on GPUs, 5 on CPUs)")
    p.add_argument("--warmup", type=_positive, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare with single-process fused_moe (rel_l2)")
    p.add_argument("--out", help="write the rows as JSON here (rank 0)")
    a = p.parse_args(argv)
    a.mode, a.size = ("tp", a.tp) if a.tp is not None else ("ep", a.ep)
    try:
        a.batch_sizes = bench.parse_batch_sizes(a.batch_sizes, ()) if a.batch_sizes else None
    except bench.BenchInputError as e:
        p.error(str(e))
    for flag, check in (("--model", lambda: get_model(a.model)), ("--scheme", lambda: a.scheme and get_scheme(a.scheme)),
                        ("--backend", lambda: a.backend == "auto" or get_backend(a.backend))):
        try:
            check()
        except ValueError as e:
            p.error(f"{flag}: {e}")
    world = os.environ.get("WORLD_SIZE")  # torchrun's; checked again after joining the group
    if world is not None and world.isdigit() and int(world) != a.size:
        p.error(f"--{a.mode} {a.size} must equal the number of processes (WORLD_SIZE={world})")
    try:  # the shape's conditions on --tp / --ep, on the device the run will take
        layer_shape(a, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    except ValueError as e:
        p.error(str(e))
    return a


def layer_shape(a: argparse.Namespace, device: torch.device) -> tuple[MoEShape, object, bool]:
    """(the FULL layer's shape (tp=1), scheme, scaled_down) for this run; ValueError where --tp
    or --ep does not suit the model (parse_args refuses it before the group forms)."""
    spec = get_model(a.model)
    scheme = get_scheme(a.scheme) if a.scheme else spec.scheme
    s = spec.shape
    E, H, inter, K = s.num_experts, s.hidden, s.intermediate, s.top_k
    scaled = device.type != "cuda"
    if scaled:
        per_rank_n = BLOCK if scheme.weight == "block" else min(inter // (a.size if a.mode == "tp" else 1), CPU_N_PER_RANK)
        E, H = min(E, max(CPU_MAX_EXPERTS, a.size if a.mode == "ep" else 1)), min(H, CPU_HIDDEN)
        inter = per_rank_n * (a.size if a.mode == "tp" else 1)
        K = min(K, E)
    if a.mode == "tp":
        if inter % a.size:
            raise ValueError(f"--tp {a.size}: the intermediate size {inter} is not divisible by {a.size}")
        if scheme.weight == "block" and (inter // a.size) % BLOCK:
            raise ValueError(f"--tp {a.size}: {scheme.name} needs intermediate/tp = {inter // a.size} to be a multiple of {BLOCK}")
    elif E < a.size:
        raise ValueError(f"--ep {a.size}: the model has only {E} experts")
    return MoEShape(E, H, inter, K), scheme, scaled


def time_it(fn, reps: int, warmup: int, device: torch.device) -> float:
    """This rank's median µs of back-to-back calls, then the slowest rank's median."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    else:
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    med = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med)


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


@torch.no_grad()
def main(argv=None) -> int:
    a = parse_args(argv)
    env = md.init_from_env()
    rank, world, device = env.rank, env.world_size, env.device
    if a.size != world:
        raise SystemExit(f"--{a.mode} {a.size} must equal the number of processes (WORLD_SIZE={world})")
    shape, scheme, scaled = layer_shape(a, device)
    spec = get_model(a.model)
    on_input = spec.routing.apply_on_input
    batch_sizes = a.batch_sizes or list(CPU_BATCH_SIZES if scaled else GPU_BATCH_SIZES)
    reps = a.reps or (5 if scaled else 50)
    E, H, K = shape.num_experts, shape.hidden, shape.top_k

    full = inputs.make_weights(shape, scheme, device, seed=a.seed)  # the same on every rank (seeded)
    if a.mode == "tp":
        local = md.shard_weights_tp(full, rank, world)
    else:
        local = md.shard_weights_ep(full, rank, world)
    if not a.check:
        del full

    if rank == 0:
        where = "EP: tokens per rank" if a.mode == "ep" else "TP: tokens of the batch"
        print(f"{spec.name} {scheme.name} {a.mode}{world} on {env.backend} ({device.type}), local backend "
              f"{a.backend}: full layer {shape.describe()}, this rank {local.num_experts} experts x N={local.n}; "
              f"batch sizes = {where}")
        if scaled:
            print("No CUDA GPU: gloo on a scaled-down shape; the timings say nothing about GPUs")
    rows = []
    for M in batch_sizes:
        seed = a.seed + M + (1000 * rank if a.mode == "ep" else 0)  # EP: every rank its own tokens
        x = inputs.make_x(M, H, device, seed=seed)
        tw, ids = inputs.make_routing(a.routing, M, shape, seed=seed)
        tw, ids = tw.to(device), ids.to(device)
        if a.mode == "tp":
            def layer(x=x, tw=tw, ids=ids):
                return md.tp_fused_moe(x, local, tw, ids, backend=a.backend, apply_router_weight_on_input=on_input)

            buf = torch.zeros(M, H, dtype=torch.float32, device=device)  # tp_fused_moe's all-reduce

            def comm(buf=buf):
                dist.all_reduce(buf)
        else:
            def layer(x=x, tw=tw, ids=ids):
                return md.ep_fused_moe(x, local, tw, ids, E, backend=a.backend, apply_router_weight_on_input=on_input)

            comm = md.ep_comm_only(x, ids, E)
        check = None
        if a.check:
            ref = moekit.fused_moe(x, full, tw, ids, a.backend, apply_router_weight_on_input=on_input)
            check = _max_over_ranks(bench.rel_l2(layer(), ref), device)
        layer_us = time_it(layer, reps, a.warmup, device)
        comm_us = time_it(comm, reps, a.warmup, device)
        rows.append({
            "model": spec.name, "scheme": scheme.name, "mode": a.mode, "world_size": world,
            "backend": a.backend, "batch_size": M, "tokens_total": M * world if a.mode == "ep" else M,
            "experts": E, "hidden": H, "intermediate": shape.intermediate, "top_k": K,
            "n_per_rank": local.n, "experts_per_rank": local.num_experts,
            "layer_us": round(layer_us, 2), "comm_us": round(comm_us, 2),
            "comm_share": round(comm_us / layer_us, 4) if layer_us > 0 else None,
            "check_rel_l2": check, "scaled_down": scaled, "device": str(device),
            "process_group": env.backend,
        })

    if rank == 0:
        print(f"{'M':>6} {'tokens':>7} {'layer µs':>10} {'comm µs':>9} {'comm share':>10}" + ("  rel_l2" if a.check else ""))
        for r in rows:
            line = f"{r['batch_size']:>6} {r['tokens_total']:>7} {r['layer_us']:>10.1f} {r['comm_us']:>9.1f} {r['comm_share']:>10.1%}"
            print(line + (f"  {r['check_rel_l2']:.2e}" if a.check else ""))
        if a.out:
            args = list(sys.argv[1:] if argv is None else argv)
            meta = bench.environment(device, args)
            meta["command"] = shlex.join(
                ["torchrun", "--nproc-per-node", str(world), "scripts/bench_distributed.py", *args]
            )
            Path(a.out).write_text(json.dumps({"meta": bench.json_safe(meta), "rows": rows}, indent=1))
            print(f"wrote {a.out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
