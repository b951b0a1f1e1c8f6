"""Compile the overlapped GEMMs (moekit/backends/triton/_gluon_kernels.py: GEMM1 on 64 and on 128
rows, the latter with and without its half-height tile, GEMM2 on its tile) for sm_90a with the installed triton, without a GPU, and read ptxas's report: the overlap exists only if ptxas keeps
each product in flight while the one before it is added. Where it cannot prove that safe (a
product copied while in flight, a loop form it does not follow, register pressure) it waits after
every wgmma and says so (warnings C7514 / C7517, seen with the chunked variants of the fourteenth
session, BENCHMARKS.md). Also checks, in the PTX, that every refill after a wgmma wait comes
after a CTA barrier (unbarriered_refills), and that the kernel's shared memory fits a Hopper
block (a kernel asking for more compiles and fails only at launch; a lower bound: the GPU's own
compile can ask for more, the 128-row GEMM1 with 5 stages 208 KiB here and 240 KiB on an H200).
Exit status 1 on any of these.

    python3 scripts/check_overlap_ptxas.py [--stages 4] [--keep DIR]

Run without TRITON_INTERPRET (under it Triton defines no compilable kernels).
"""
import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from moekit.backends.triton._gluon_kernels import (gemm1_overlap_kernel, gemm1_overlap_tall_kernel,  # noqa: E402
                                                   gemm2_overlap_kernel)
from moekit.backends.triton_options import compile_options  # noqa: E402 - the launches' options
from moekit import env  # noqa: E402


# (kernel, pointer arguments, integer arguments): every pointer and row stride of these kernels is
# 16-byte aligned (launch.py checks), which a launch specializes on by itself
GEMM1 = (gemm1_overlap_kernel,
         {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
          "out_ptr": "*fp8e4nv", "out_scale_ptr": "*fp32", "sorted_ptr": "*i32", "count_ptr": "*i32",
          "start_ptr": "*i32"},
         ["E", "N", "H", "K_TOP", "stride_am", "stride_as", "stride_we", "stride_wn", "stride_wse", "stride_wsn",
          "stride_om", "stride_os"])
GEMM1_TALL = (gemm1_overlap_tall_kernel, *GEMM1[1:])
GEMM2 = (gemm2_overlap_kernel,
         {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
          "topk_weights_ptr": "*fp32", "out_ptr": "*bf16", "sorted_ptr": "*i32", "count_ptr": "*i32",
          "start_ptr": "*i32"},
         ["E", "N", "H", "stride_am", "stride_as", "stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_om"])
ALIGNED_INTS = ["N", "H", "stride_am", "stride_we", "stride_wn", "stride_om"]
# name: (kernel, constexpr arguments); fp8-channel-token's scales (per token / per channel) and
# fp8-block128's (1x128 groups / 128x128 blocks)
CASES = {
    "gemm1 per-token": (GEMM1, dict(A_SCALE=2, B_SCALE=2, ACT_DTYPE=tl.bfloat16, BLOCK_M=64, BLOCK_N=128)),
    "gemm1 block": (GEMM1, dict(A_SCALE=3, B_SCALE=3, ACT_DTYPE=tl.bfloat16, BLOCK_M=64, BLOCK_N=128)),
    "gemm1 tall per-token": (GEMM1_TALL, dict(A_SCALE=2, B_SCALE=2, ACT_DTYPE=tl.bfloat16, BLOCK_M=128, BLOCK_N=128,
                                              HALF_HEIGHT=0)),
    "gemm1 tall block": (GEMM1_TALL, dict(A_SCALE=3, B_SCALE=3, ACT_DTYPE=tl.bfloat16, BLOCK_M=128, BLOCK_N=128,
                                          HALF_HEIGHT=0)),
    # with the 64-row tile of an expert's last block compiled into the same kernel (one register
    # allocation for both)
    "gemm1 tall half-height per-token": (GEMM1_TALL, dict(A_SCALE=2, B_SCALE=2, ACT_DTYPE=tl.bfloat16, BLOCK_M=128,
                                                          BLOCK_N=128, HALF_HEIGHT=1)),
    "gemm1 tall half-height block": (GEMM1_TALL, dict(A_SCALE=3, B_SCALE=3, ACT_DTYPE=tl.bfloat16, BLOCK_M=128,
                                                      BLOCK_N=128, HALF_HEIGHT=1)),
    "gemm2 128x128 per-channel": (GEMM2, dict(B_SCALE=2, BLOCK_M=128, BLOCK_N=128)),
    "gemm2 128x128 block": (GEMM2, dict(B_SCALE=3, BLOCK_M=128, BLOCK_N=128)),
}


_LABEL = re.compile(r"^\s*(\$?[\w.$]+):")
_BRANCH = re.compile(r"^\s*(@!?%\w+\s+)?bra(\.uni)?\s+(\$?[\w.$]+);")
_COPY = re.compile(r"\bcp\.async\.c[ag]\.")  # a copy (cp.async.ca / .cg), not commit_group
_BARRIER = re.compile(r"\b(bar|barrier)\.sync\b")
_END = re.compile(r"^\s*(ret|exit)\b")


def unbarriered_refills(ptx: str) -> int:
    """cp.async copies that some path through the kernel reaches after a wgmma wait with no CTA
    barrier between them. A refill overwrites the stage the previous product read; wgmma.wait_group
    waits for this warpgroup's products only, so the other warpgroup may still be reading that
    stage until a barrier. The kernel relies on Triton's barrier-insertion pass for it (_refill's
    docstring). Paths, not program text: the PTX is cut into basic blocks at labels and branches,
    and "a wait with no barrier since" flows along branches and fall-throughs to a fixed point (a
    branch into another block's text is not a path; a loop's back edge is)."""
    blocks, labels = [[]], {}
    for line in ptx.splitlines():
        label = _LABEL.match(line)
        if label:
            if blocks[-1]:
                blocks.append([])
            labels[label.group(1)] = len(blocks) - 1
            continue
        blocks[-1].append(line)
        if _BRANCH.match(line) or _END.match(line):
            blocks.append([])

    def successors(i: int) -> list[int]:
        last = blocks[i][-1] if blocks[i] else ""
        branch = _BRANCH.match(last)
        fall = [i + 1] if i + 1 < len(blocks) else []
        if _END.match(last):
            return []
        if branch:
            target = [labels[branch.group(3)]] if branch.group(3) in labels else []
            return target if not branch.group(1) else target + fall  # unpredicated: no fall-through
        return fall

    def run(i: int, waited: bool, flagged: set) -> bool:
        for j, line in enumerate(blocks[i]):
            if "wgmma.wait_group" in line:
                waited = True
            elif _BARRIER.search(line):
                waited = False
            elif _COPY.search(line) and waited:
                flagged.add((i, j))
        return waited

    entered = [False] * len(blocks)  # entered with a wait pending, on some path
    work, flagged = list(range(len(blocks))), set()
    while work:
        i = work.pop()
        out = run(i, entered[i], flagged)
        for k in successors(i):
            if out and not entered[k]:
                entered[k] = True
                work.append(k)
    return len(flagged)


def spilled(report: str) -> bool:
    """Whether ptxas's report names any spill store or load (or a stack frame) other than 0 bytes."""
    return bool(re.search(r"\b[1-9]\d* bytes (stack frame|spill stores|spill loads)", report))


# Hopper's shared memory per block (227 KiB): a kernel asking for more compiles, and fails to launch
HOPPER_SHARED_MEMORY = 232448


def ptxas_report(name: str, stages: int, folder: Path) -> tuple[str, str, int]:
    (kernel, pointers, ints), tile = CASES[name]
    constants = dict(tile, E_POW2=8, BLOCK_K=128, GROUP_M=8, STAGES=stages, num_warps=8)
    kinds = dict(pointers, **dict.fromkeys(ints, "i32"), **dict.fromkeys(constants, "constexpr"))
    names = list(kernel.arg_names)  # positions are the kernel's own
    signature = {n: kinds[n] for n in names}
    source = GluonASTSource(kernel, signature, {(names.index(n), ): v for n, v in constants.items()},
                            {(names.index(n), ): [["tt.divisibility", 16]] for n in [*pointers, *ALIGNED_INTS]})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, **compile_options(False)})
    ptx = folder / f"{name.replace(' ', '_')}_s{stages}.ptx"
    ptx.write_text(compiled.asm["ptx"])
    ptxas = get_ptxas(90).path  # the one triton itself compiles sm_90 code with
    done = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                          capture_output=True, text=True, check=True)
    return done.stderr, compiled.asm["ptx"], compiled.metadata.shared


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--keep", help="write the PTX and cubins into this folder")
    args = ap.parse_args()
    if env.interpreting():
        sys.exit("unset TRITON_INTERPRET: under it Triton compiles nothing")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name in CASES:
            report, ptx, shared = ptxas_report(name, args.stages, folder)
            lines = [line.strip() for line in report.splitlines() if "C75" in line or "registers" in line or "spill" in line]
            unbarriered = unbarriered_refills(ptx)
            lines.append(f"cp.async after a wgmma wait without a CTA barrier between: {unbarriered}")
            lines.append(f"shared memory: {shared // 1024} KiB of {HOPPER_SHARED_MEMORY // 1024}")
            bad = ("C7514" in report or "C7517" in report or spilled(report) or unbarriered
                   or shared > HOPPER_SHARED_MEMORY)
            failed |= bool(bad)
            print(f"{name}: {'SERIALIZED, SPILLING, UNBARRIERED OR TOO MUCH SHARED MEMORY' if bad else 'ok'}\n  "
                  + "\n  ".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
