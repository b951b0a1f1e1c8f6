"""The triton backend's launch configs that `moekit tune` searches, and the pruning that keeps the
search short without discarding anything that could win.

Two kinds of pruning:

* Static, per batch size (`static_prune`), from the config alone:
    - cannot run: `KernelConfig.problems` (scheme rules: FP8 group tiles, and GEMM2's of token schemes, need BLOCK_K 128,
      128x128 weight blocks need BLOCK_N dividing 128), or the operand tiles that Triton's software
      pipeline keeps in shared memory exceed the device's limit;
    - never run: the GEMV path (KernelConfig.GEMV) beyond one token where the pairs outnumber half
      the experts (`config.gemv_may_win`): the backend's table lookup never runs a GEMV entry there
      (it takes the nearest tiled one), so a timing there would only put in the table a config
      that does not run. The bound is why: the GEMV path reads an expert's weights once per pair,
      the tiled path once per expert. On an H200 (BENCHMARKS.md, seventh session) its tuned configs
      won at 1-32 pairs (GLM-4.5V M = 1-2, DeepSeek-V3 M = 1-4, Mixtral M = 1-2: 3-28% per layer)
      and lost at GLM M = 4-8 and DeepSeek M = 8 (32-64 pairs), inside the bound: the bound keeps
      what can win, the measurement decides;
  and, in the `pruned` search only,
    - spills registers: GEMM1's two float32 accumulators alone need more than 255 registers per
      thread;
    - dominated by a smaller tile with the same work: BLOCK_M above the most rows any expert can
      receive (M: each token picks distinct experts), BLOCK_N / BLOCK_K above every dimension they
      tile; GROUP_M values at least as large as the number of row blocks give the same tile order
      as the smallest of them.
* By measurement (`neighbour_prune`, `pruned` search only): a config slower than NEIGHBOUR_MARGIN
  times the best triton config at the neighbouring (next smaller) batch size, or that failed there,
  is not timed again; a config dropped at the neighbour stays dropped.

`full` (`--search-space full`) keeps only the first two rules (configs that cannot run would only
fail, GEMV configs beyond the bound would never run):
it is the exhaustive search the pruned one is compared against. `none` searches nothing: only the
default config and the other backends are timed (and the sizes between, see moekit.tune.plan),
with the configs an earlier search left in the same output folder.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Iterable, Sequence

import torch

from ..backends.triton import launch
from ..backends.sizes import next_pow2
from ..backends.triton.config import KernelConfig, gemv_may_win, gluon_scheme
from ..backends.triton.gemv import gemm2_groups
from ..spec import MoEShape, QuantScheme

SEARCH_SPACES = ("pruned", "full", "none")

# Between adjacent batch sizes (2x apart) the rows per tile change by at most 2x, and so does how
# well a tile shape fits the work; a config 50% slower than the best has, in our measurements, not
# become the best at the next size. `--search-space full` measures whether this margin loses
# anything (the lead's pruned-vs-exhaustive comparison).
NEIGHBOUR_MARGIN = 1.5

MAX_REGISTERS_PER_THREAD = 255  # a hard limit of every NVIDIA GPU since Kepler

# Opt-in shared memory per block (what Triton checks its kernels against), by compute capability,
# for torch versions whose device properties do not report it.
SHARED_MEMORY_BY_CAPABILITY = {
    (9, 0): 227 * 1024,  # Hopper: 232448 bytes
    (8, 0): 163 * 1024,  # A100
    (8, 6): 99 * 1024,
    (8, 7): 163 * 1024,
    (8, 9): 99 * 1024,  # Ada
}
HOPPER_SHARED_MEMORY = SHARED_MEMORY_BY_CAPABILITY[(9, 0)]

# A search space: the configs to try for a scheme (before any pruning).
SpaceFn = Callable[[QuantScheme], Sequence[KernelConfig]]


def config_key(cfg: KernelConfig) -> str:
    """A short, stable name for a config: the journal's and the summary's key."""
    if cfg.GEMV:  # BLOCK_M and GROUP_M mean nothing to the GEMV path
        key = f"gemv-N{cfg.BLOCK_N}-K{cfg.BLOCK_K}-w{cfg.num_warps}-s{cfg.num_stages}" + ("-late" if cfg.GEMV == 2 else "")
        if cfg.has_gemm2:  # GEMM2's own column block and warps, and depth where its own (gemv_gemm2_variants)
            g2 = cfg.gemm2()
            key += f"+N{g2.BLOCK_N}-w{g2.num_warps}" + (f"-s{g2.num_stages}" if cfg.num_stages2 else "")
        return key
    key = f"M{cfg.BLOCK_M}-N{cfg.BLOCK_N}-K{cfg.BLOCK_K}-G{cfg.GROUP_M}-w{cfg.num_warps}-s{cfg.num_stages}"
    if cfg.OVERLAP:  # GEMM1 in Gluon with the promotion overlapped (KernelConfig.OVERLAP)
        key += "-ov"
    if cfg.JOIN:  # never in a search space, but a table's config may have it (runner.Worker._incumbents)
        key += "-join"
    if cfg.has_gemm2:  # GEMM2's own launch (gemm2_variants): its whole launch, after a "+"
        g2 = cfg.gemm2()
        key += f"+N{g2.BLOCK_N}" + (f"-K{g2.BLOCK_K}" if cfg.BLOCK_K2 else "") + f"-G{g2.GROUP_M}-w{g2.num_warps}-s{g2.num_stages}"
        if g2.N_TILES2:
            key += f"-r{g2.N_TILES2}"
        if g2.OVERLAP2:  # GEMM2 in Gluon with the promotion overlapped (KernelConfig.OVERLAP2)
            key += "-ov"
        if g2.KEEP_A2:  # a run keeping its row block's activations (KernelConfig.KEEP_A2)
            key += "-ka"
    return key


_TILED_KEY = re.compile(r"M(?P<bm>\d+)-N(?P<bn>\d+)-K(?P<bk>\d+)-G(?P<g>\d+)-w(?P<w>\d+)-s(?P<s>\d+)(?P<ov>-ov)?(?P<join>-join)?"
                        r"(?:\+N(?P<bn2>\d+)(?:-K(?P<bk2>\d+))?-G(?P<g2>\d+)-w(?P<w2>\d+)-s(?P<s2>\d+)(?:-r(?P<r2>\d+))?(?P<ov2>-ov)?(?P<ka2>-ka)?)?")
_GEMV_KEY = re.compile(r"gemv-N(?P<bn>\d+)-K(?P<bk>\d+)-w(?P<w>\d+)-s(?P<s>\d+)(?P<late>-late)?(?:\+N(?P<bn2>\d+)-w(?P<w2>\d+)(?:-s(?P<s2>\d+))?)?")
_KEY_FORMS = ("M<rows>-N<cols>-K<k>-G<group>-w<warps>-s<stages>[-ov][-join] (optionally +N<cols>[-K<k>]-G<group>-w<warps>-s<stages>"
              "[-r<runs>][-ov][-ka] for GEMM2's own launch, runs 2 or more) or gemv-N<cols>-K<k>-w<warps>-s<stages>[-late] "
              "(optionally +N<cols>-w<warps>[-s<stages>] for GEMM2's own), "
              "every number positive")


def config_from_key(key: str) -> KernelConfig:
    """The config `config_key` names (its inverse for every config the tuner times), for scripts
    and journals that name configs by key; ValueError, naming the expected forms, for anything
    else."""
    m = _GEMV_KEY.fullmatch(key) or _TILED_KEY.fullmatch(key)
    if m is None:
        raise ValueError(f"config key {key!r}: expected {_KEY_FORMS}")
    n = {name: int(v) for name, v in m.groupdict().items() if v is not None and name not in ("ov", "ov2", "ka2", "join", "late")}
    if 0 in n.values() or n.get("r2", 2) < 2:  # a run of one is written without -r
        raise ValueError(f"config key {key!r}: expected {_KEY_FORMS}")
    if m.re is _GEMV_KEY:
        cfg = KernelConfig(BLOCK_M=16, BLOCK_N=n["bn"], BLOCK_K=n["bk"], GROUP_M=1, num_warps=n["w"],
                           num_stages=n["s"], GEMV=2 if m.group("late") else 1)
        if "bn2" not in n:
            return cfg
        return cfg.with_gemm2(BLOCK_N=n["bn2"], num_warps=n["w2"], num_stages=n.get("s2", n["s"]))
    cfg = KernelConfig(BLOCK_M=n["bm"], BLOCK_N=n["bn"], BLOCK_K=n["bk"], GROUP_M=n["g"], num_warps=n["w"],
                       num_stages=n["s"], OVERLAP=int(m.group("ov") is not None), JOIN=int(m.group("join") is not None))
    if "bn2" in n:  # GEMM2's own launch
        cfg = cfg.with_gemm2(BLOCK_N=n["bn2"], BLOCK_K=n.get("bk2", n["bk"]), GROUP_M=n["g2"], num_warps=n["w2"], num_stages=n["s2"],
                             N_TILES=n.get("r2", 0), OVERLAP=int(m.group("ov2") is not None),
                             KEEP_A=int(m.group("ka2") is not None))
    return cfg


# ------------------------------------------------------------------------------- the spaces


# Four warpgroups on a 128x128 tile: while one waits for its tensor-core product and adds it into
# float32 (per-block scales, or the FP8 promotion), the others' products run. On an H200
# (BENCHMARKS.md, thirteenth session), whole layer, precise mode: DeepSeek-V3 TP8 M = 8192
# 2000-2013 us against the table's 2065 (64-row tiles on 8 warps), in three calls, with GEMM2 on
# its own 4- or 8-warp launch (GEMM2 launched on 16 warps too: 2353; runner.WIDE_BASE_MARGIN);
# 1-7% slower at DeepSeek M = 2048-5792, within 1% at GLM-4.5V M = 4096-8192, 1.6-2.5% faster
# at Mixtral-8x7B M = 1024 (GROUP_M 8, three calls), not at 1448-8192. The tuner decides per size.
# (64-row tiles on 16 warps lost at DeepSeek M = 2048-8192, 128x256 tiles were 3-4x slower at
# Mixtral and 256x128 2-3x slower everywhere: only 128x128 tiles get 16 warps.)
WIDE_TILE_WARPS = 16

# GEMM1 in Gluon with the FP8 promotion overlapped (KernelConfig.OVERLAP): its 64-row tile, every
# grouping and 3-5 stages (5 fill 200 of the 227 KiB). On an H200 (BENCHMARKS.md, fourteenth
# session), whole layer, precise mode, against the tables' configs: 1-6% faster at 64-row sizes
# (DeepSeek-V3 M = 1024-8192, GLM-4.5V 1448-2896, Qwen3-30B-A3B 1024-2048, Mixtral 512-728) and
# Mixtral M = 4096, 2-6% slower than GLM-4.5V's 128-row tiles at M = 4096 / 8192, 1.3% slower at
# Qwen3 M = 512: the tuner decides per size. Where it would run as its Triton twin (fast mode's
# per-row intermediate, K not in whole 128-long steps) static_prune drops it as equivalent.
OVERLAP_SEARCH_STAGES = (3, 4, 5)
# ... and on 128 rows (gemm1_overlap_tall_kernel), with the most stages it runs: 3 stages took
# 8-15% more time than 4 at Mixtral-8x7B M = 1024-8192 and GLM-4.5V M = 4096 / 8192 (BENCHMARKS.md,
# sixteenth session), 5 do not fit in shared memory
OVERLAP_TALL_SEARCH_STAGES = (4,)


# GEMM1 of FP8 per-token / per-tensor schemes in K steps of 256, GEMM2 in 128 (KernelConfig.BLOCK_K2),
# as vLLM's H100 tables do at decode sizes. The whole layer, precise mode, H100 (BENCHMARKS.md,
# forty-first session), against the tables' 128-long steps in the same rounds: 128-wide tiles on
# 3 stages took 1.1% less time at GLM-4.5V TP2 M = 64 and Mixtral-8x7B M = 8 (0.4% at GLM M = 8),
# bitwise the same output; 64- and 32-wide tiles on 4-5 stages were 1-7% slower, steps of 512
# 2-5% slower, and 64-row tiles far slower (the tables' 16 rows at those sizes). So only these.
# Retimed with them (same session), the tuner chose them at GLM-4.5V TP2 M = 6-192 and Mixtral
# M = 6-64, and issue 3's anchors moved 4-6% at those decode sizes (GLM M = 64 GEMMs 407.6 ->
# 385.8 µs, Mixtral M = 8 506.3 -> 473.5: the tables' GEMM2 launches changed with them).
GEMM1_WIDE_K_STEP = 256
GEMM1_WIDE_K_TILE_N = 128
GEMM1_WIDE_K_STAGES = 3
GEMM1_WIDE_K_ROWS = (16, 32)


def hopper_space(scheme: QuantScheme, full: bool = False, overlap: bool = True) -> list[KernelConfig]:
    """The GPU search space, restricted to configs that can run `scheme` (KernelConfig.problems).

    Tiled configs: BLOCK_K 256 for unquantized weights, and for FP8 GEMM1 of per-token or
    per-tensor schemes on decode tiles alone (GEMM1_WIDE_K_*, with BLOCK_K2 128: FP8 group tiles
    and GEMM2's of token schemes are tied to 128-wide groups; the GEMV path's K steps of 256, 512
    and 1024 hold whole groups);
    GROUP_M 32 only in the full search (beyond 16 the L2 reuse it buys is rarely measurable);
    16 warps only on 128x128 tiles (WIDE_TILE_WARPS); the overlapped GEMM1 (OVERLAP_SEARCH_STAGES,
    OVERLAP_TALL_SEARCH_STAGES) on
    FP8 schemes with per-token or 1x128-group activations, unless `overlap` is False (a GPU where
    it would run as its Triton twin: default_space)."""
    block_k = (64, 128) if scheme.is_fp8 else (64, 128, 256)
    group_m = (1, 8, 16, 32) if full else (1, 8, 16)
    configs = [
        KernelConfig(bm, bn, bk, g, w, s)
        for bm, bn, bk, g, w, s in itertools.product(
            (16, 32, 64, 128), (32, 64, 128, 256), block_k, group_m, (4, 8), (2, 3, 4, 5)
        )
    ]
    configs += [
        KernelConfig(128, 128, bk, g, WIDE_TILE_WARPS, s)
        for bk, g, s in itertools.product(block_k, group_m, (2, 3, 4, 5))
    ]
    if scheme.is_fp8:  # GEMM1 in wider K steps (refused by problems() where the scales change every 128)
        configs += [
            KernelConfig(bm, GEMM1_WIDE_K_TILE_N, GEMM1_WIDE_K_STEP, g, w, GEMM1_WIDE_K_STAGES).with_gemm2(BLOCK_K=128)
            for bm, g, w in itertools.product(GEMM1_WIDE_K_ROWS, group_m, (4, 8))
        ]
    if overlap:
        for rows, stages in ((64, OVERLAP_SEARCH_STAGES), (128, OVERLAP_TALL_SEARCH_STAGES)):
            tile = KernelConfig(BLOCK_M=rows, OVERLAP=1, **KernelConfig.OVERLAP_TILE)
            configs += [dataclasses.replace(tile, GROUP_M=g, num_stages=s) for g, s in itertools.product(group_m, stages)]
    configs += gemv_space()
    return [c for c in configs if not c.problems(scheme)]


def gemv_space() -> list[KernelConfig]:
    """The GEMV path's configs (backends/triton/gemv.py), GEMM1 reducing each step (GEMV=1) and
    once after its K loop (GEMV=2, gemv_late_space). GEMV=1: narrow column blocks and wide K steps,
    which put the most bytes in flight in its probe (BENCHMARKS.md, sixth session), each with its
    K loops unpipelined and pipelined (GEMV_STAGES). Steps of 1024 (twenty-sixth session; 2.6-2.7% per layer at
    DeepSeek-V3 M = 1 on an H200 and an H100, twenty-eighth) halve the sequential steps of each program again (GLM-4.5V at M = 1: GEMM1 8 steps
    of 512, GEMM2 6 steps of one 128-group per pair); with at most 8192 weights per gate or up
    tile (16 x 1024 would hold 256 per thread on 4 warps)."""
    return [
        KernelConfig(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=w, num_stages=s, GEMV=1)
        for bn, bk, w, s in itertools.product((4, 8, 16), (256, 512, 1024), (2, 4), GEMV_STAGES) if bn * bk <= 8192
    ] + gemv_late_space()


# The most float32 values one thread holds in each of GEMM1's two accumulators on the GEMV path
# with its late reduction (GEMV=2: BLOCK_N x BLOCK_K per program). Its probe (BENCHMARKS.md,
# thirty-second session) ran up to 128 (8 x 1024 or 4 x 2048 on 2 warps); none of those was among
# the eight fastest at any point, and 64 (4 x 1024 on 2 warps) was, at GLM-4.5V M = 4.
GEMV_LATE_MAX_VALUES_PER_THREAD = 64


def gemv_late_space() -> list[KernelConfig]:
    """GEMV=2 configs: the column blocks and K steps of the probe's winners (4 and 8 columns, steps
    of 256-1024; 1 and 2 columns were no faster there, and would leave GEMM2, which shares the
    column block unless tuned apart, far too narrow), 2 or 4 warps, and the pipelined depths alone:
    every one of the probe's eight fastest late configs at each point ran 3 stages, none unpipelined."""
    return [
        KernelConfig(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=w, num_stages=s, GEMV=2)
        for bn, bk, w, s in itertools.product((4, 8), (256, 512, 1024), (2, 4), GEMV_STAGES[1:])
        if bn * bk <= GEMV_LATE_MAX_VALUES_PER_THREAD * 32 * w
    ]


# Pipeline depths of the GEMV path's K loops (tl.range(num_stages=...) in _gemv_kernels.py; 1: none).
# Measured on an H100 (BENCHMARKS.md, twenty-ninth session): 3 or 4 stages won the decision timing at
# every decode size of GLM-4.5V, DeepSeek-V3 and Mixtral where the GEMV path won (DeepSeek-V3 M = 1
# 36.8 against 41.8 µs per layer, Mixtral M = 1 138.4 against 144.9), while 2 never did and was
# the layer's slowest depth in 27 of the sweep's 36 (point, K step) pairs (scripts/diag_gemv_stages.py),
# so it is not searched.
GEMV_STAGES = (1, 3, 4)


# Where the tuner starts among GEMV configs when it has no measurement (runner.order_candidates):
# 8 columns, K steps of 512 and 2 warps were best or within 3% of the best at most points measured
# (BENCHMARKS.md, sixth session); 3 stages since the H100 retimes (twenty-ninth and thirtieth
# sessions) chose 2 warps with 3 or 4 stages at 7 of the 8 tuned decode sizes where the GEMV path
# won in the H100 tables (GLM-4.5V M = 4: 4 warps unpipelined, GEMM2 on 3 stages), and at all 4
# sizes of the H200's decode tune (GLM-4.5V and DeepSeek-V3 at M = 1 and 2, thirtieth session).
GEMV_START = KernelConfig(BLOCK_M=16, BLOCK_N=8, BLOCK_K=512, GROUP_M=1, num_warps=2, num_stages=3, GEMV=1)


def interpreter_space(scheme: QuantScheme) -> list[KernelConfig]:
    """Two configs for the CPU, where the Triton interpreter takes ~0.3 s per layer call and the
    times say nothing about a GPU: enough to run the whole pipeline, not a search."""
    block_k = 128 if scheme.is_fp8 else 64
    configs = (KernelConfig(16, 32, block_k, 1, 4, 2), KernelConfig(16, 64, block_k, 8, 4, 3))
    return [c for c in configs if not c.problems(scheme)]


@dataclasses.dataclass(frozen=True)
class HopperSpace:
    """hopper_space as a picklable callable (worker processes receive it)."""

    full: bool = False
    overlap: bool = True  # search the overlapped GEMM1 (it runs on Hopper only)

    def __call__(self, scheme: QuantScheme) -> list[KernelConfig]:
        return hopper_space(scheme, full=self.full, overlap=self.overlap)


def default_space(device: torch.device, search_space: str) -> SpaceFn:
    if device.type != "cuda":
        return interpreter_space
    return HopperSpace(full=search_space == "full", overlap=launch.overlap_available(device))


# ------------------------------------------------------------------- GEMM2's own launch

# After each batch size's search the tuner times the best tiled config again with GEMM2 launched
# differently (KernelConfig.BLOCK_N2 / num_warps2 / num_stages2 / N_TILES2): tile width x warps x
# stages x column tiles per program.
# GEMM2 alone on an H200 (BENCHMARKS.md, eighth session) was up to 1.39x faster with another
# width or stage count than GEMM1's (GLM-4.5V M = 8192, fast mode); GROUP_M moved it less.
GEMM2_GRID_GPU = tuple(itertools.product((64, 128, 256), (4, 8), (3, 4, 5)))
GEMM2_GRID_CPU = ((32, 4, 2), (64, 4, 3))  # the interpreter: enough to run the step, not a search
# Each of those launches also with runs of column tiles per program (KernelConfig.N_TILES2). GEMM2
# alone, precise mode, H200 (BENCHMARKS.md, eleventh session): runs of 8 took 6-10% less time at
# DeepSeek-V3 M = 1024-8192 (runs of 16 within 1% of 8, runs of 4 5-6% behind), runs of 4-8 of
# 128-wide tiles 9% less at GLM-4.5V M = 8192, and none gained at GLM M = 4096. Which launch gains
# depends on the launch (GLM's 64-wide tiles lost with runs), so every launch is timed with both.
GEMM2_RUNS_GPU = (1, 8)
GEMM2_RUNS_CPU = (1,)
# Where GEMM2's inner dimension fits GEMM2_KEEP_A_SEARCH_STEPS K steps (KernelConfig.KEEP_A2:
# DeepSeek-V3 at TP8), each launch also with runs of these lengths keeping their row block's
# activations (those whose kept A, weight stages and output tile fit: kept_a_shared_memory_bytes).
# GEMM2 alone, precise mode, H100 (BENCHMARKS.md, thirty-fourth session), DeepSeek-V3 TP8 M =
# 1024-8192: 64-wide tiles on 8 warps, 3 stages, runs of 16 took 12-22% less time than the table's
# launch (855 -> 671 µs at M = 8192); runs of 8 were within 0-3% of 16. The kernel holds up to six
# steps (KEEP_A2_STEPS), but at six every kept launch lost (thirty-fifth session, H100): GLM-4.5V TP2
# GEMM2 alone 477.5 -> 511.4 µs at best at M = 4096 and 194.7 -> 231.2 at 1024, Qwen3-30B-A3B
# 245.9 -> 254.8 at 4096; so the search tries them only at the two steps where they won.
GEMM2_KEEP_A_SEARCH_STEPS = 2
GEMM2_KEEP_A_RUNS_GPU = (8, 16)
GEMM2_KEEP_A_RUNS_CPU = ()  # the interpreter's grid stays GEMM2_GRID_CPU's (its tests patch this in)

# float32 registers per thread GEMM2's accumulators may take. Beyond 128 (counting the partial
# accumulator of a promoted FP8 sum twice) every variant measured collapsed to 3-10x slower:
# 64x256 tiles on 4 warps promoted, 128x128 on 4 warps promoted, 128x256 on 8 warps promoted,
# 128x256 on 4 warps; at exactly 128 none did (BENCHMARKS.md, eighth session).
GEMM2_MAX_ACCUMULATOR_REGISTERS = 128


def gemm2_grid(device: torch.device) -> tuple[tuple[int, int, int, int, int], ...]:
    """(BLOCK_N, num_warps, num_stages, N_TILES, KEEP_A) of GEMM2's launch variants on this device
    (those with KEEP_A 1 run only where the intermediate fits: gemm2_variants)."""
    gpu = device.type == "cuda"
    launches, runs = (GEMM2_GRID_GPU, GEMM2_RUNS_GPU) if gpu else (GEMM2_GRID_CPU, GEMM2_RUNS_CPU)
    keep_a_runs = GEMM2_KEEP_A_RUNS_GPU if gpu else GEMM2_KEEP_A_RUNS_CPU
    return (tuple(launch + (n_tiles, 0) for launch in launches for n_tiles in runs)
            + tuple(launch + (n_tiles, 1) for launch in launches for n_tiles in keep_a_runs))


# GEMM2 of the GEMV path on a launch of its own (KernelConfig.GEMV_GEMM2_FIELDS): column blocks x
# warps (x K-loop depths, GEMV_STAGES, in gemv_gemm2_variants). gemm2_groups gives its tile as many rows of 128 per step as GEMM1's, but the grids differ:
# GEMM1 runs a program per (pair, column block of N), GEMM2 one per (token, column block of the
# hidden size) with N as its short inner dimension (GLM-4.5V TP2 at M = 1 and blocks of 8: 704
# programs of 8 K steps of 512 against 512 programs of 6 steps; DeepSeek-V3 TP8 at blocks of 4: 512
# against 1792), so the block and warps that suit GEMM1 need not suit GEMM2. Measured (twenty-eighth
# session, BENCHMARKS.md): won at GLM-4.5V M = 2 on an H200 and an H100 and DeepSeek-V3 M = 2 on an H100.
GEMV_GEMM2_GRID = tuple(itertools.product((4, 8, 16, 32), (2, 4, 8)))
# The most weights one thread of it holds as float32 per step: GEMM1's GEMV space allows at most
# 8192 weights per gate or up tile, 256 per thread on 2 warps (gemv_space).
GEMV_MAX_VALUES_PER_THREAD = 256


def _gemv_gemm2_rows(cfg: KernelConfig, top_k: int) -> int:
    """Rows of one GEMV GEMM2 step (gemv2_kernel's ROWS): the token's pairs, padded to a power of
    two, times each pair's 128-groups (gemv.gemm2_groups)."""
    return next_pow2(top_k) * gemm2_groups(cfg, top_k)


def gemv_gemm2_variants(base: KernelConfig, scheme: QuantScheme, top_k: int,
                        shared_memory_limit: int = HOPPER_SHARED_MEMORY) -> tuple[list[KernelConfig], dict[str, str]]:
    """(variants of the GEMV config `base` with GEMM2 on its own column block, warps and K-loop
    depth, {key dropped: why}); GEMV_GEMM2_GRID x GEMV_STAGES, the launch equal to base's left
    out. The depth is GEMM2's own because the two GEMMs wanted different ones: on an H100
    (BENCHMARKS.md, twenty-ninth session) GEMM1 alone ran fastest pipelined at 11 of the sweep's
    12 points (DeepSeek-V3 M = 1: 20.1 µs with 3 stages against 24.5 unpipelined) where GEMM2
    alone ran fastest unpipelined at 6 (GLM-4.5V and DeepSeek-V3 at M <= 4; 14.3 µs there). In the
    layer it gained little: in a retime at M = 1-8 it won at 3 of 10 points, by at most 1.1%
    (thirtieth session). Variants whose pipeline passes the shared memory (bf16 weights, wide blocks) are dropped."""
    rows = _gemv_gemm2_rows(base, top_k)
    kept: list[KernelConfig] = []
    dropped: dict[str, str] = {}
    for (block_n, warps), stages in itertools.product(GEMV_GEMM2_GRID, GEMV_STAGES):
        cfg = base.with_gemm2(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        if not cfg.has_gemm2:
            continue
        key, values = config_key(cfg), rows * block_n * 128 // (32 * warps)
        problems = cfg.problems(scheme)
        if problems:
            dropped[key] = "cannot run: " + "; ".join(problems)
        elif values > GEMV_MAX_VALUES_PER_THREAD:
            dropped[key] = (f"registers: GEMM2's tile is {values} values per thread (at most "
                            f"{GEMV_MAX_VALUES_PER_THREAD}, as GEMM1's GEMV space)")
        elif (smem := gemv_shared_memory_bytes(cfg, scheme, top_k)) > shared_memory_limit:
            dropped[key] = f"shared memory: its pipeline needs {smem // 1024} KiB, the device has {shared_memory_limit // 1024} KiB"
        else:
            kept.append(cfg)
    return kept, dropped


def gemm2_partial_accumulator(scheme: QuantScheme, accumulation: str) -> bool:
    """Whether GEMM2 sums FP8 products into float32 step by step (a second accumulator of the
    tile's size): precise accumulation, or scales that change along K (1x128 groups, 128x128
    blocks), whatever the mode."""
    if not scheme.is_fp8:
        return False
    return accumulation == "precise" or scheme.activation == "group" or scheme.weight == "block"


# GEMM2 in Gluon with the FP8 promotion overlapped (KernelConfig.OVERLAP2): its one tile, after
# each 128-row base of GEMM1 (sharing its grouping), with these stages. On an H200 (BENCHMARKS.md,
# fifteenth session), whole layer, precise mode: Mixtral-8x7B M = 512-8192 2.3-10% faster than the
# tables' configs (4 and 5 stages within 1-2% of each other); Qwen3-30B-A3B M = 4096 / 8192, with
# 6 K steps of GEMM2, 1-6% slower. Where it would run as its Triton twin (intermediate not in
# whole 128-long steps, fast mode's per-row intermediate: overlap2_idle; fewer K steps than a
# stage count preloads: gemm2_variants) it is not tried.
OVERLAP2_SEARCH_STAGES = (4, 5)


def gemm2_variants(
    base: KernelConfig, scheme: QuantScheme, grid: Sequence[tuple[int, int, int, int, int]], smem_limit: int,
    partial_accumulator: bool, overlap_k_steps: int = 0, intermediate: int | None = None,
) -> tuple[list[KernelConfig], dict[str, str]]:
    """(variants of `base` with GEMM2's own launch, {key dropped: why}); the variant equal to base
    (GEMM2 launched as GEMM1) is not among them. The grid's launches keeping A (KEEP_A2) run only
    where the `intermediate` size per GPU fits GEMM2_KEEP_A_SEARCH_STEPS K steps (None: nowhere).
    `overlap_k_steps`: GEMM2's K steps where the
    overlapped GEMM2 runs on this problem (0 where it does not: overlap2_idle); then it is tried
    too, on its tile, with the OVERLAP2_SEARCH_STAGES whose preloaded steps (stages - 1) the K
    steps fill (launch._overlapped2; fewer run the Triton twin), after a base that
    writes the intermediate it reads (128x128 GEMM1 tiles: whole 1x128 groups)."""
    kept: list[KernelConfig] = []
    dropped: dict[str, str] = {}
    keep_a = (intermediate is not None and base.keep_a2_fits(intermediate)
              and intermediate <= GEMM2_KEEP_A_SEARCH_STEPS * base.gemm2().BLOCK_K)
    launches = [base.with_gemm2(BLOCK_N=block_n, num_warps=warps, num_stages=stages, N_TILES=n_tiles, KEEP_A=keeps)
                for block_n, warps, stages, n_tiles, keeps in grid if keep_a or not keeps]
    if overlap_k_steps and base.BLOCK_N == 128 and (base.BLOCK_M, 128) in KernelConfig.OVERLAP2_TILES:
        launches += [base.with_gemm2(BLOCK_N=128, num_warps=8, num_stages=stages, OVERLAP=1)
                     for stages in OVERLAP2_SEARCH_STAGES if overlap_k_steps >= stages - 1]
    for cfg in launches:
        if not cfg.is_gemm2_variant or cfg in kept:  # (the base itself, where only its K step is own)
            continue
        key, g2 = config_key(cfg), cfg.gemm2()
        registers = accumulator_registers(g2, 2 if partial_accumulator else 1)
        smem = (kept_a_shared_memory_bytes(g2, scheme, intermediate) if g2.KEEP_A2
                else shared_memory_bytes(g2, scheme, b_tiles=1))
        problems = cfg.problems(scheme)
        if problems:
            dropped[key] = "cannot run: " + "; ".join(problems)
        elif smem > smem_limit:
            need = "about" if g2.KEEP_A2 else "at least"  # kept A: the compiler's own figure, not a bound
            dropped[key] = f"shared memory: GEMM2 needs {need} {smem // 1024} KiB, the device has {smem_limit // 1024} KiB"
        elif registers > GEMM2_MAX_ACCUMULATOR_REGISTERS:
            dropped[key] = (f"registers: GEMM2's accumulators need {registers:.0f} per thread "
                            f"(more than {GEMM2_MAX_ACCUMULATOR_REGISTERS} collapsed when measured)")
        else:
            kept.append(cfg)
    return kept, dropped


# ------------------------------------------------------------------------- device limits


def shared_memory_limit(device: torch.device) -> tuple[int, str]:
    """(bytes of shared memory one block may use, where the number came from)."""
    if device.type != "cuda":
        return HOPPER_SHARED_MEMORY, "no GPU: assumed Hopper (sm90)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", None)  # torch >= 2.6 reports it
    if optin:
        return int(optin), "torch device properties"
    cap = (props.major, props.minor)
    known = SHARED_MEMORY_BY_CAPABILITY.get(cap, HOPPER_SHARED_MEMORY), f"table for sm{cap[0]}{cap[1]}"
    try:  # what Triton itself checks compiled kernels against
        import triton

        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]), "triton driver"
    except Exception:  # noqa: BLE001 - any failure falls back to the table
        return known


# ------------------------------------------------------------------------------ estimates


def _operand_bytes(scheme: QuantScheme) -> int:
    """Bytes per operand element in shared memory. For FP8 schemes GEMM2's A (the intermediate)
    may be loaded as bf16 and quantized in registers; counting 1 byte keeps the estimate a lower
    bound."""
    return 1 if scheme.is_fp8 else 2


def shared_memory_bytes(cfg: KernelConfig, scheme: QuantScheme, b_tiles: int = 2) -> int:
    """A lower bound of the shared memory a GEMM launched with `cfg` needs: the operand tiles (A,
    and `b_tiles` weight tiles: GEMM1's gate and up, GEMM2's one) of num_stages - 1 pipeline
    stages (Triton's pipeliner keeps at least that many in flight). A config over the device's
    limit by this bound cannot compile. GEMM1's bound covers GEMM2 launched as GEMM1 (the same
    tiles less one, and a K step no longer than GEMM1's: the search gives GEMM2 its own only in
    gemm2_variants, which checks it). GEMV-path configs:
    gemv_shared_memory_bytes."""
    per_stage = cfg.BLOCK_M * cfg.BLOCK_K + b_tiles * cfg.BLOCK_K * cfg.BLOCK_N
    return per_stage * _operand_bytes(scheme) * max(cfg.num_stages - 1, 1)


def kept_a_shared_memory_bytes(cfg: KernelConfig, scheme: QuantScheme, intermediate: int) -> int:
    """The shared memory of GEMM2's launch `cfg` keeping its row block's activations (KEEP_A2)
    over an intermediate of `intermediate` columns: the kept A, every K step of it, num_stages
    copies of a weight tile per K step (the loop Triton pipelines runs over column tiles, each
    reading the whole intermediate), and the epilogue's 16-bit output tile. Compiled for sm_90
    with Triton 3.9 (FP8, GLM-4.5V's six K steps), the kernel asked for exactly this: 200 KiB on
    64 rows 64 wide with 3 stages, 248 (more than Hopper's 227) with 4, 208 on 128 rows with 2,
    124 on 64 rows 32 wide with 3 and 176 on 128 rows likewise."""
    k_steps = -(-intermediate // cfg.BLOCK_K)
    a_kept = cfg.BLOCK_M * k_steps * cfg.BLOCK_K
    b_stage = k_steps * cfg.BLOCK_K * cfg.BLOCK_N
    epilogue = cfg.BLOCK_M * cfg.BLOCK_N * 2
    return (a_kept + b_stage * cfg.num_stages) * _operand_bytes(scheme) + epilogue


def gemv_shared_memory_bytes(cfg: KernelConfig, scheme: QuantScheme, top_k: int) -> int:
    """The shared memory of a GEMV-path config's pipelined K loops (the larger of its two kernels;
    none where neither is pipelined): num_stages - 1 copies of each step's tiles. GEMM1 reads one
    activation row and its gate and up tiles per step; GEMM2 reads ROWS (the token's pairs x
    their 128-groups, gemv.gemm2_groups) rows of the intermediate (bf16, or fp8 where its scale
    is static) and of w2 for its column block. Compiled for sm_90 (Triton 3.9), both kernels
    asked for exactly this (tests/test_triton_gemv.py); bf16 weights with wide GEMM2 blocks and 3
    or 4 stages pass Hopper's 227 KiB."""
    weight = _operand_bytes(scheme)
    gemm1 = (cfg.num_stages - 1) * (cfg.BLOCK_K * weight + 2 * cfg.BLOCK_N * cfg.BLOCK_K * weight)
    g2 = cfg.gemm2()
    rows = _gemv_gemm2_rows(cfg, top_k)
    intermediate = 1 if scheme.is_fp8 and scheme.static_activation else 2
    gemm2 = (g2.num_stages - 1) * rows * 128 * (intermediate + g2.BLOCK_N * weight)
    return max(gemm1, gemm2)


def accumulator_registers(cfg: KernelConfig, accumulators: int = 2) -> float:
    """float32 registers per thread that a GEMM's accumulators alone occupy: GEMM1's gate and up
    (2), GEMM2's one, or two where a promoted FP8 sum keeps a partial accumulator beside it."""
    return accumulators * cfg.BLOCK_M * cfg.BLOCK_N / (32 * cfg.num_warps)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# ------------------------------------------------------------------------------- pruning


def static_prune(
    configs: Iterable[KernelConfig],
    shape: MoEShape,
    scheme: QuantScheme,
    num_tokens: int,
    shared_memory_limit: int,
    search_space: str = "pruned",
) -> tuple[list[KernelConfig], dict[str, str]]:
    """(configs kept, {key of a config dropped: why}) for this batch size. See the module docstring."""
    kept: list[KernelConfig] = []
    dropped: dict[str, str] = {}
    pruned = search_space != "full"
    rows_max = max(16, _pow2_at_least(num_tokens))  # rows one expert can receive, as a tile size
    widest = _pow2_at_least(max(shape.n, shape.hidden))
    for cfg in dict.fromkeys(configs):  # keep the order, drop duplicates
        key = config_key(cfg)
        problems = cfg.problems(scheme)
        smem = gemv_shared_memory_bytes(cfg, scheme, shape.top_k) if cfg.GEMV else shared_memory_bytes(cfg, scheme)
        if problems:
            dropped[key] = "cannot run: " + "; ".join(problems)
        elif smem > shared_memory_limit:
            dropped[key] = f"shared memory: needs at least {smem // 1024} KiB, the device has {shared_memory_limit // 1024} KiB"
        elif pruned and accumulator_registers(cfg) > MAX_REGISTERS_PER_THREAD:
            dropped[key] = (
                f"registers: the accumulators alone need {accumulator_registers(cfg):.0f} per thread "
                f"(limit {MAX_REGISTERS_PER_THREAD})"
            )
        elif pruned and cfg.OVERLAP and _overlap_idle(shape, scheme):
            dropped[key] = f"equivalent: runs as its Triton twin here ({_overlap_idle(shape, scheme)})"
        elif cfg.GEMV and not gemv_may_win(shape, num_tokens):  # in every search: the backend never runs it here
            dropped[key] = (
                f"never run: the GEMV path reads an expert's weights once per pair, and {num_tokens * shape.top_k} "
                f"pairs on {shape.num_experts} experts repeat experts, so the backend runs a tiled config here"
            )
        elif pruned and cfg.BLOCK_M > rows_max and not cfg.GEMV:
            dropped[key] = f"dominated: BLOCK_M {cfg.BLOCK_M} > {rows_max}, the most rows an expert receives at M={num_tokens}"
        elif pruned and (cfg.BLOCK_N > widest or cfg.BLOCK_K > widest):
            dropped[key] = f"dominated: tile wider than every dimension it tiles (N {shape.n}, hidden {shape.hidden})"
        else:
            kept.append(cfg)
    if pruned:
        kept = _drop_equivalent_group_m(kept, shape, num_tokens, dropped)
    return kept, dropped


def _overlap_idle(shape: MoEShape, scheme: QuantScheme) -> str | None:
    """Why the overlapped GEMM1 would run as its Triton twin on this problem (launch._overlapped),
    or None where it runs."""
    return _gluon_idle(scheme, shape.hidden, "hidden")


def overlap2_idle(shape: MoEShape, scheme: QuantScheme) -> str | None:
    """Why the overlapped GEMM2 cannot run on this problem, or would run as its Triton twin
    (launch._overlapped2), or None where it runs (given enough K steps for its stages:
    gemm2_variants)."""
    return _gluon_idle(scheme, shape.n, "intermediate")


def _gluon_idle(scheme: QuantScheme, inner: int, name: str) -> str | None:
    """What keeps a Gluon GEMM whose inner dimension (`name`) is `inner` long from running: a
    scheme whose intermediate is not FP8 in 1x128 groups (config.gluon_scheme), K not in whole
    128-long steps, or fast mode's per-row intermediate (no promotion to overlap); None if nothing."""
    if not gluon_scheme(scheme):
        return f"{scheme.name}'s intermediate is not FP8 with 1x128 group scales"
    if inner % 128:
        return f"{name} {inner} is not a whole number of 128-long K steps"
    if launch._row_intermediate(scheme):
        return "fast mode quantizes this scheme's intermediate per row: no promotion to overlap"
    return None


def _max_row_blocks(shape: MoEShape, num_tokens: int, block_m: int) -> int:
    """Row blocks of the alignment in the worst routing (launch.py's `_empty_alignment` bound)."""
    pairs = num_tokens * shape.top_k
    max_rows = pairs + min(shape.num_experts, pairs) * (block_m - 1)
    return -(-max_rows // block_m)


def _drop_equivalent_group_m(configs, shape, num_tokens, dropped) -> list[KernelConfig]:
    """GROUP_M only reorders tiles in groups of GROUP_M row blocks; with at least as many as there
    are row blocks, every such value yields one group: the same order. Keep the smallest."""
    kept = []
    seen: set[KernelConfig] = set()
    for cfg in sorted(configs, key=lambda c: c.GROUP_M):
        blocks = _max_row_blocks(shape, num_tokens, cfg.BLOCK_M)
        if cfg.GROUP_M >= blocks:
            canonical = dataclasses.replace(cfg, GROUP_M=blocks)
            if canonical in seen:
                dropped[config_key(cfg)] = f"equivalent: same tile order as a smaller GROUP_M (at most {blocks} row blocks)"
                continue
            seen.add(canonical)
        kept.append(cfg)
    order = {c: i for i, c in enumerate(configs)}
    return sorted(kept, key=order.__getitem__)


@dataclasses.dataclass(frozen=True)
class NeighbourResult:
    """What happened at the neighbouring batch size: measured times, failures, margin drops."""

    batch_size: int
    us: dict[str, float]  # config key -> median µs (triton configs measured there)
    failed: dict[str, str]  # config key -> error
    dropped: set[str]  # keys dropped there by this same rule
    # the separate time of the config the triton table took there (output.chosen_config: the
    # decision timing's winner), when known
    chosen_us: float | None = None

    @property
    def best(self) -> float | None:
        """The time the margin is taken from: the fastest separate time, or the chosen config's
        where that is slower. A separate time the decision timing did not bear out is no evidence
        against the others: on an H100 one config read 222 µs where every other read ~370 and
        it took 374 in the decision timing (GLM-4.5V M = 32, BENCHMARKS.md twenty-fifth session),
        and with the fastest as reference 12 configs were dropped at the next size as 1.68-1.85x it."""
        if not self.us:
            return None
        fastest = min(self.us.values())
        return fastest if self.chosen_us is None else max(fastest, self.chosen_us)


def neighbour_prune(
    configs: Sequence[KernelConfig], neighbour: NeighbourResult | None, margin: float = NEIGHBOUR_MARGIN
) -> tuple[list[KernelConfig], dict[str, str]]:
    """(configs kept, {key dropped: why}) by the results at the neighbouring batch size. A config
    that was not a candidate there (a larger BLOCK_M, say) is kept: there is no evidence against it."""
    if neighbour is None:
        return list(configs), {}
    kept, dropped = [], {}
    best = neighbour.best
    m = neighbour.batch_size
    for cfg in configs:
        key = config_key(cfg)
        if key in neighbour.failed:
            dropped[key] = f"failed at M={m}"
        elif key in neighbour.dropped:
            dropped[key] = f"dropped at M={m}"
        elif best is not None and key in neighbour.us and neighbour.us[key] > margin * best:
            dropped[key] = f"lost at M={m}: {neighbour.us[key] / best:.2f}x the best there (margin {margin}x)"
        else:
            kept.append(cfg)
    return kept, dropped


__all__ = [
    "NEIGHBOUR_MARGIN",
    "SEARCH_SPACES",
    "HopperSpace",
    "NeighbourResult",
    "SpaceFn",
    "accumulator_registers",
    "config_key",
    "default_space",
    "gemm2_grid",
    "gemm2_partial_accumulator",
    "gemm2_variants",
    "gemv_gemm2_variants",
    "hopper_space",
    "interpreter_space",
    "neighbour_prune",
    "overlap2_idle",
    "shared_memory_bytes",
    "shared_memory_limit",
    "static_prune",
]
