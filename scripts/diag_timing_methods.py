"""The timing harness's two ways of taking the L2 flush out of a sample, on the same closures in
the same rounds: each replay timed apart from its own flush by an event between them (what
moekit.timing does since the twenty-sixth session), and flush + replay less the median of
flushes timed apart (what it did before, and what the anchors' method describes). Is the event
between flush and replay worth a microsecond or two at decode sizes (at M = 1 the new harness read
0.7-1.9 µs more than the old, BENCHMARKS.md twenty-sixth session), and how far do the flushes
timed apart stray from the flushes before a replay?

Closures: an empty CUDA graph's worth of work (one tiny kernel) and moekit's whole layer at each
point (the triton backend, the tables of this GPU).

    PYTHONPATH=. python3 scripts/diag_timing_methods.py [--points glm-4.5v-fp8:2:1 deepseek-v3:8:1
        mixtral-8x7b:1:8 glm-4.5v-fp8:2:1024] [--repeats 5] [--json FILE]
"""
import argparse
import json

import numpy as np
import torch

import moekit
from moekit import timing
from diag_points import layer_points

DEFAULT_POINTS = ["glm-4.5v-fp8:2:1", "deepseek-v3:8:1", "mixtral-8x7b:1:8", "glm-4.5v-fp8:2:1024"]


def both_ways(run, reps: int) -> dict:
    """One round of each method on the captured `run`: µs medians."""
    flush = timing.flush_buffer().zero_
    replays, flushes_before = timing._flushed_event_times(flush, run, reps)

    def flush_then_run():
        flush()
        run()

    together = timing._event_times(flush_then_run, reps)
    flush_alone = timing._event_times(flush, reps)
    apart = float(np.median(flush_alone))
    return {"event_between_us": float(np.median(replays)), "flush_before_replay_us": float(np.median(flushes_before)),
            "subtracted_us": float(np.median(together)) - apart, "flush_alone_us": apart}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", nargs="+", default=DEFAULT_POINTS, help="model:tp:M[:scheme]")
    p.add_argument("--repeats", type=int, default=5, help="rounds of both methods per closure")
    p.add_argument("--reps", type=int, default=30, help="timed calls per method and round")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev = torch.device("cuda")
    closures = {"tiny kernel": (lambda buf=torch.zeros(1, device=dev): buf.add_(1))}
    for pt in layer_points(args.points, dev):
        closures[f"{pt.model}:{pt.tp}:{pt.M} layer"] = (
            lambda pt=pt: moekit.fused_moe(pt.x, pt.w, pt.tw, pt.ids, backend="triton"))
        rows = []
        for name, fn in list(closures.items()):
            run, method, _, graph = timing._prepare_cuda(fn, 3, True)
            rounds = [both_ways(run, args.reps) for _ in range(args.repeats)]
            row = {"closure": name, "method": method,
                   **{k: [round(r[k], 2) for r in rounds] for k in rounds[0]}}
            rows.append(row)
            print(f"{name:32s} event between {np.median(row['event_between_us']):8.2f} µs   "
                  f"flush subtracted {np.median(row['subtracted_us']):8.2f} µs   "
                  f"flush before a replay {np.median(row['flush_before_replay_us']):6.1f}   "
                  f"flush alone {min(row['flush_alone_us']):6.1f}-{max(row['flush_alone_us']):6.1f}", flush=True)
            del graph
        closures.clear()
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
