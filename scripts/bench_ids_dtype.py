"""The whole layer through `moekit.fused_moe` with int32 and with int64 expert ids, in the same
rounds: transformers' routers give int64 ids (torch.topk's), which fused_moe narrowed to int32
in a launch of its own before every backend; the triton, cutlass and torch backends now read them
as they are (Backend.reads_int64_ids; cutlass and torch also no longer launch fused_moe's own id
check: their glue's first kernel asserts the ids). `--narrow` times int64 ids narrowed first as
well (what every call from transformers paid before, less cutlass's and torch's former check), so
one run shows the launch saved.

    PYTHONPATH=. python3 scripts/bench_ids_dtype.py [--models glm-4.5v-fp8:2 deepseek-v3:8]
        [--batch-sizes 1 2 8 64] [--backend triton] [--narrow] [--json FILE]
"""
import argparse

import torch

import moekit
from moekit.backends.glue.ops import narrow_ids
from moekit.inputs import make_weights, make_x, uniform_routing
from moekit.timing import time_graphs

from diag_points import parse_model, write_json  # scripts/ is on the path when a script runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["glm-4.5v-fp8:2", "deepseek-v3:8"], help="model:tp[:scheme]")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 8, 64])
    p.add_argument("--backend", default="triton")
    p.add_argument("--narrow", action="store_true", help="also int64 ids narrowed by glue.narrow_ids first")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev = torch.device("cuda")
    rows = []
    for item in args.models:
        _, _, spec, scheme = parse_model(item)
        shape = spec.shape
        w = make_weights(shape, scheme, dev)
        for M in args.batch_sizes:
            tw, ids32 = (t.to(dev) for t in uniform_routing(M, shape.num_experts, shape.top_k))
            ids32 = ids32.to(torch.int32)
            ids64 = ids32.long()
            x = make_x(M, shape.hidden, dev)
            fns = {
                "int32": lambda: moekit.fused_moe(x, w, tw, ids32, backend=args.backend),
                "int64": lambda: moekit.fused_moe(x, w, tw, ids64, backend=args.backend),
            }
            if args.narrow:
                fns["int64 narrowed"] = lambda: moekit.fused_moe(x, w, tw, narrow_ids(ids64, shape.num_experts),
                                                                 backend=args.backend)
            assert torch.equal(fns["int32"](), fns["int64"]()), "int64 ids changed the output"
            timings = time_graphs(fns, rounds=args.rounds)
            for label, t in timings.items():
                if isinstance(t, BaseException):
                    raise t
                rows.append({"model": item, "M": M, "ids": label, "median_us": t.median_us,
                             "p20_us": t.p20_us, "p80_us": t.p80_us})
                print(f"{item:>22} M={M:<5} {label:>15}: {t.median_us:8.1f} us  ({t.p20_us:.1f}-{t.p80_us:.1f})",
                      flush=True)
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
