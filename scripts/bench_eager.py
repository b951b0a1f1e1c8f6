"""Eager host cost of one layer call: wall time per call of back-to-back eager calls against the
same layer replayed from a CUDA graph, and where the host's time goes.

    python scripts/bench_eager.py [--model glm-4.5v-fp8 --tp 2] [--batch-sizes 1 8 64] [--profile]

Per batch size prints µs per call of:
  - eager: `fused_moe(x, weights, tw, ids, backend=...)` called n times, one synchronize at the end
    (when the host is slower than the GPU, this is the host path: checks, selection, launches);
  - graph: the same call captured once and replayed n times (the GPU's time, no host path);
  - host: 64 eager calls with the GPU kept busy ahead of them (a sleep kernel queued first), so
    the wall time of the calls is the host's alone; nan where the sleep had ended by the last
    call (the calls waited for the GPU somewhere, and the reading would include that).
`--profile` prints cProfile's top functions of the host path (cumulative) at each size where an
eager call took over 1.5x its replay (where the GPU is the slower side, a profile would count the
wait for it as launch time). M = 1 runs the GEMV path's three launches, M = 8-64 the tiled path's
four or five, whose eager calls took about twice as long per call on an H200 (BENCHMARKS.md,
thirty-seventh session).
No L2 flush: this measures the host, not the kernels (moekit bench does those).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moekit  # noqa: E402
from moekit.models import get_model  # noqa: E402


def per_call_us(fn, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


HOST_CALLS = 64  # few enough that their launches fit CUDA's queue of pending launches (about 1024)


def host_us(fn, n: int = HOST_CALLS) -> float:
    """Wall time of n calls issued while the GPU is still busy with a sleep: the host's time. More
    pending launches than the queue holds would make the host wait for the GPU (500 calls did)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time at Hopper clocks: longer than n calls
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - t0
    still_busy = not torch.cuda.current_stream().query()  # else the calls waited for the GPU: no reading
    torch.cuda.synchronize()
    return elapsed / n * 1e6 if still_busy else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="glm-4.5v-fp8")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_eager needs a GPU")
    spec = get_model(args.model, tp=args.tp)
    shape, scheme = spec.shape, spec.scheme
    device = torch.device("cuda")
    torch.manual_seed(0)
    w13 = torch.randn(shape.num_experts, 2 * shape.n, shape.hidden, device=device) / shape.hidden**0.5
    w2 = torch.randn(shape.num_experts, shape.hidden, shape.n, device=device) / shape.n**0.5
    weights = moekit.quantize_weights(w13, w2, scheme)
    del w13, w2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {spec.name} {shape.describe()} "
          f"{scheme.name}, backend {args.backend}")
    print(f"{'M':>6} {'eager us/call':>14} {'host us/call':>13} {'graph us/call':>14}")
    for M in args.batch_sizes:
        x = torch.randn(M, shape.hidden, device=device, dtype=torch.bfloat16)
        tw, ids = moekit.route(torch.randn(M, shape.num_experts, device=device), shape.top_k)

        def call():
            return moekit.fused_moe(x, weights, tw, ids, backend=args.backend)

        for _ in range(20):
            call()
        eager = per_call_us(call, args.calls)
        host = host_us(call)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        replay = per_call_us(graph.replay, args.calls)
        print(f"{M:>6} {eager:>14.1f} {host:>13.1f} {replay:>14.1f}")
        if args.profile and eager > 1.5 * replay:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                call()
            profile.disable()
            torch.cuda.synchronize()
            pstats.Stats(profile).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
