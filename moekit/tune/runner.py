"""Measuring for `moekit tune`: per problem and batch size, the default config, the config the
backend ran there before this run (the incumbent, where a table gave one) and the other backends
first (so that a budget cut leaves the decision table decided wherever this step finished: a size
it cut short is left out of that table, output.backend_table; and a table no slower than the one
it replaces), then the search and GEMM2's own launch.

Every measurement is the whole layer through the shared harness (`moekit.timing.time_graph`:
CUDA graph replays, L2 flushed before each), triton with the config forced
(`TritonBackend.run(..., config=)`), on inputs made once per batch size from the run's seed.
Weights are made once per problem and freed before the next.

A config that fails (does not compile, runs out of shared memory or registers, produces NaN or an
output far from the default config's) is recorded with its reason and skipped. A config timed
below the roofline floor of its inputs (roofline.floor_us with the device's ceilings: physically
impossible, a misread) is timed once more and the second reading kept, the first beside it
(journal "first_us", "floor_us"): on an H100 such readings ranked configs first that were not. After a failure on
a GPU the device is synchronised: an error that broke the CUDA context stops the run
(`DeviceBroken`), the config recorded as failed, so a rerun continues past it.

Between the tuned sizes (plan.between): every backend is timed again, triton with the config
chosen at each of the two searched sizes around it and the incumbent there; the decision timing
then picks the triton table's config there too, so that the config auto's table timed is the config the backend runs.
A size between two others is measured as soon as both are searched (so a budget cut leaves the
ones before it done); a last pass after all workers covers the rest (sizes between two workers'
runs, and every one with --search-space none). A later search that finds a better config for a
neighbour makes the next pass time that config there too.

Decision timing (`_decide`), after the search at each size and after the neighbours' configs at
each size between: triton with each of its fastest configs (output.decision_candidates: the
CONFIRMED_CONFIGS fastest separately timed, and the incumbent) and every other backend again, in
the same interleaved rounds (one GPU clock state for all), the replays cycling through
plan.routings routings of the size. The triton table takes the fastest config there
(output.chosen_config), and the decision table is built from it: with few experts a size lies near a
multiple of a kernel's row tile, and one routing can push an expert over it or not (a 12% swing
of one triton point, Mixtral-8x7B, H200); auto chooses per size, so it is judged on several.
Redone when a later search changes the candidates, or with another --routings.

GEMM2's own launch (`_search_gemm2`), after the search at each size (and under --search-space
none, on the configs found before): the best config of the search space (and its best 16-warp
config, when close: WIDE_BASE_MARGIN) timed again with GEMM2
launched with other tile widths, warps and stages (space.gemm2_variants), each variant a config of
its own in the journal, so the fastest of all makes the table; variants never count as a
neighbour's result for the next size's pruning.

Budget: a deadline for the whole run; each remaining (problem, batch size) search, with its GEMM2
step, gets an equal share of the time left, its most promising configs first, so a short budget
still searches every batch size a little instead of the first ones fully. The search stops at
1 - GEMM2_RESERVE of its share, so that the GEMM2 step always gets the rest.

Several GPUs: the batch sizes are split into contiguous runs, one worker process per GPU
(torch.multiprocessing, spawn); each worker journals its own batch sizes, tables are rebuilt from
all journals. One GPU or the CPU: the same worker, in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from .. import __version__ as moekit_version
from .. import roofline, select
from ..accumulation import table_accumulation
from ..api import validate_inputs
from ..backends import get_backend
from ..backends.triton import launch
from ..backends.triton.config import KernelConfig, ProblemConfigs, default_config, gemv_may_win, problem_configs
from ..backends.triton.launch import fp8_accumulation, pdl_wanted
from ..bench import rel_l2
from ..inputs import input_seed, make_routing, make_routings, make_weights, make_x
from ..spec import QuantScheme
from ..tables import table_name
from ..timing import FLUSH_METHOD, Timing, time_graph, time_graphs
from .journal import MAX_DEATHS, PROGRESS_DIR, Journal, journal_dir, journal_path, load_journals
from .output import (GEMM2_FIELDS, chosen_config, decision_candidates, decision_is_current, is_between, neighbour_configs,
                     runnable_timings, write_tables)
from .plan import TuneInputError, TunePlan, TuneProblem
from .precompile import Precompiler
from .space import (
    GEMV_START,
    WIDE_TILE_WARPS,
    NeighbourResult,
    config_key,
    gemm2_partial_accumulator,
    gemm2_variants,
    gemv_gemm2_variants,
    neighbour_prune,
    overlap2_idle,
    shared_memory_limit,
    static_prune,
)

# A config whose output differs from the default config's by more than this (relative L2) is
# wrong, not slower: configs change only the accumulation order (~1e-6) and, for FP8 schemes,
# where the intermediate is quantized (the same 1x128 groups), measured at < 1e-3.
OUTPUT_TOLERANCE = 1e-2
# With MOEKIT_FP8_ACCUMULATION=fast, tiles of 64+ rows sum FP8 products in the tensor cores' own
# accumulator: each such config lands 1.5-1.7e-2 from the exact sums (BENCHMARKS.md, fifth session),
# each in its own direction, so two correct configs (or a tiled one and the GEMV path, which sums
# exactly) can differ by up to about the sum, 3.4e-2; a wrong scale, row or expert is >= 1e-1.
OUTPUT_TOLERANCE_FAST = 4e-2


# The part of each size's share of the budget kept for the GEMM2 step: without it a search that
# fills its share leaves the step nothing. The ninth session's 200 s fast-mode tune of
# Mixtral-8x7B gave M = 4096 and 8192 no GEMM2 launch, where a 256-wide one was 1.16x and 1.15x
# faster on GEMM2 and 4% on the layer at 4096 (BENCHMARKS.md, tenth session; that run's journals
# are gone, so a filled share is the likely cause, not a recorded one); the eighth session's
# GEMM2 launches (1.14-1.39x on GEMM2) came from a later run of the step alone.
GEMM2_RESERVE = 0.25

# A GEMM1 on 16 warps (space.WIDE_TILE_WARPS) wins only with GEMM2 on a launch of its own: at
# DeepSeek-V3 M = 8192 (H200, BENCHMARKS.md thirteenth session) GEMM2 on 16 warps as well made the
# layer 14% slower than the table's config, and a 4-warp GEMM2 made it 3% faster. So the GEMM2
# step also starts from the fastest plain 16-warp config when it is within this factor of the
# fastest plain config (journal "gemm2_wide"), not only from the fastest ("gemm2").
WIDE_BASE_MARGIN = 1.25

# At decode sizes GEMM1 and GEMM2 want different column blocks: GEMM1's N (the intermediate,
# twice) is short, so narrow blocks give it programs enough to fill the SMs, while GEMM2 (N = the
# hidden size) does best on wide ones. At GLM-4.5V TP2 M = 8 on an H200 (BENCHMARKS.md,
# twenty-eighth session), GEMM1 alone was 84 µs on 32- or 64-column blocks against 92 on the
# table's 128, and GEMM2 alone 54-55 µs on 128 against 66-69 on 64. A plain config runs both on
# one block, so the fastest plain one keeps 128 and the narrow GEMM1 is never tried with a wide
# GEMM2. The GEMM2 step therefore also starts from the fastest plain tiled config with a narrower
# column block than the fastest's, within WIDE_BASE_MARGIN of it (journal "gemm2_narrow").

# A separate timing that the size's decision timing contradicts by more than this factor, beyond
# what it does to the size's other decided configs, was misread, and is no base for the GEMM2
# step. The shipped H100 journals hold separate timings of the harness before the twenty-sixth
# session, which read some configs up to 60 µs too fast: at GLM-4.5V M = 8, 127.1 µs for a config
# the decision timing found at 194.7, 1.53x, where the others decided there read 1.04-1.05x
# (BENCHMARKS.md, twenty-eighth session). Ranked by that figure it was the step's base, and no
# narrower config was within WIDE_BASE_MARGIN of it. Why relative to the others: the decision
# timing's 4 routings move every config of a size together, by 1.19-1.27x at Mixtral-8x7B M = 4
# (8 pairs on 8 experts) in honest timings of the same run.
MISREAD_FACTOR = 1.25


def _misread(journal: dict) -> set[str]:
    """Keys whose decision time over separate time exceeds MISREAD_FACTOR times the median of
    that ratio over the size's decided keys (the lower median: with two keys, the other's ratio).
    Only a rerun has a decision timing to compare with (a fresh run's comes after its GEMM2 step)."""
    decided = (journal.get("decision") or {}).get("triton_us") or {}
    configs = journal["configs"]
    ratios = {k: us / configs[k]["us"] for k, us in decided.items() if configs.get(k, {}).get("us")}
    if not ratios:
        return set()
    median = statistics.median_low(ratios.values())
    return {k for k, ratio in ratios.items() if ratio > MISREAD_FACTOR * median}


def gemm2_bases(j: Journal, tall: bool = False) -> list[tuple[str, KernelConfig]]:
    """(journal field, config) of the configs the GEMM2 step starts from: the fastest measured
    config without a GEMM2 launch of its own ("gemm2"; where that is a GEMV config, it alone, with
    GEMM2's column block, warps and K-loop depth varied: space.gemv_gemm2_variants), the fastest such on 16 warps when it
    is another and within WIDE_BASE_MARGIN of it ("gemm2_wide"), with `tall` (the overlapped
    GEMM2 runs on this problem) the fastest 128x128 one on 8 warps likewise ("gemm2_tall", GEMM1
    in Triton or in Gluon): the overlapped GEMM2 follows only a 128-row GEMM1, and where the
    Gluon GEMM1's 64-row tile is the fastest alone, a 128-row GEMM1 with it was faster still
    (Mixtral-8x7B M = 512-4096, BENCHMARKS.md fifteenth session), and the fastest with a narrower
    column block than the fastest's likewise, where it is no base yet ("gemm2_narrow": a narrow
    GEMM1 with a wide GEMM2, see above). A timing the decision timing found misread
    (MISREAD_FACTOR) is left out, unless nothing else is left."""
    misread = _misread(j.data)
    timed = [(v["us"], k) for k, v in runnable_timings(j.data).items() if not _is_gemm2_variant(v)]  # no GEMV base beyond its bound
    plain = sorted([(us, k) for us, k in timed if k not in misread] or timed)
    configs = {k: KernelConfig.from_dict(j.config(k)["config"]) for _, k in plain}
    if not plain:
        return []
    best_us, best = plain[0]
    if configs[best].GEMV:  # GEMM2's own column block, warps and depth on the GEMV path (space.gemv_gemm2_variants)
        return [("gemm2", configs[best])]
    bases = [("gemm2", configs[best])]
    wide = [(us, k) for us, k in plain if configs[k].num_warps == WIDE_TILE_WARPS and not configs[k].GEMV]
    if wide and wide[0][1] != best and wide[0][0] <= WIDE_BASE_MARGIN * best_us:
        bases.append(("gemm2_wide", configs[wide[0][1]]))
    tall_tiles = [(us, k) for us, k in plain if (configs[k].BLOCK_M, configs[k].BLOCK_N, configs[k].num_warps) ==
                  (128, 128, 8) and not configs[k].GEMV]  # GEMM1 in Triton or in Gluon (OVERLAP on 128 rows)
    if tall and tall_tiles and tall_tiles[0][1] != best and tall_tiles[0][0] <= WIDE_BASE_MARGIN * best_us:
        bases.append(("gemm2_tall", configs[tall_tiles[0][1]]))
    narrow = [(us, k) for us, k in plain if not configs[k].GEMV and configs[k].BLOCK_N < configs[best].BLOCK_N]
    if narrow and narrow[0][0] <= WIDE_BASE_MARGIN * best_us and configs[narrow[0][1]] not in dict(bases).values():
        bases.append(("gemm2_narrow", configs[narrow[0][1]]))
    return bases


def output_tolerance() -> float:
    """How far a config's output may be from the default config's (relative L2) and be right."""
    return OUTPUT_TOLERANCE_FAST if fp8_accumulation() == "fast" else OUTPUT_TOLERANCE


def _clock() -> float:
    """Seconds on a clock shared by every process of the machine (deadlines cross processes)."""
    return time.monotonic()


def get_ceilings(device: torch.device) -> roofline.Ceilings | None:
    """The device's ceilings for the floor check of separate timings (roofline.get_ceilings:
    cached, measured once per device and versions; None on the CPU; tests replace it)."""
    return roofline.get_ceilings(device)


def measure_time(fn: Callable[[], object], *, reps: int, warmup: int, device: torch.device, what: str) -> Timing:
    """The tuner's one timing call (`what` names the measurement; tests replace this function)."""
    return time_graph(fn, reps=reps, warmup=warmup, device=device)


def measure_times(fns: dict[str, Callable[[], object]], *, reps: int, warmup: int, device: torch.device,
                  what: dict[str, str], before_each: Callable[[], object] | None = None) -> dict[str, Timing | Exception]:
    """The tuner's timing of several closures in the same interleaved rounds (`what` names each
    closure's measurement; tests replace this function)."""
    return time_graphs(fns, reps=reps, warmup=warmup, device=device, before_each=before_each)


class DeviceBroken(RuntimeError):
    """A failure left the CUDA context unusable: this process cannot measure anything more."""


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP during a run (stop_on_signals): a KeyboardInterrupt, so that it stops the
    run as Ctrl-C does."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(self.name)


# The signals that stop a run as Ctrl-C does: `timeout`, a batch scheduler, systemd and `kill`
# send SIGTERM; a closed terminal or ssh session SIGHUP. Left to their default action they end the
# process inside a measurement, which the journal then counts as a death (a crash): after two such
# stops a config, a backend or a decision timing that never failed was recorded as failed for good.
STOP_SIGNALS = ("SIGTERM", "SIGHUP")  # SIGHUP: POSIX only


@contextlib.contextmanager
def stop_on_signals():
    """While held, SIGTERM and SIGHUP raise `Stopped` (a KeyboardInterrupt) in this process, as
    SIGINT raises KeyboardInterrupt: the measurement in flight is un-marked rather than counted as
    a death, the compile helpers are shut down (Precompiler.close, in Worker.run's `finally`), the
    worker processes are stopped the same way (run_workers), the tables are rebuilt. A repeat
    while the run stops is ignored (a process-group kill and the parent's own terminate() of its
    workers both reach a worker): SIGKILL still ends a run stuck in a kernel. A signal ignored
    here (nohup ignores SIGHUP) stays ignored. Only in the main thread, where Python runs signal
    handlers (signal.signal refuses elsewhere): in another thread nothing changes. The handlers
    before are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping: list[int] = []

    def stop(signum, frame):
        if not stopping:
            stopping.append(signum)
            raise Stopped(signum)

    previous = {}
    for name in STOP_SIGNALS:
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():  # None: one not set from Python, taken as the default
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


class Reporter(Protocol):
    def device(self, name: str) -> None: ...
    def add_total(self, count: int) -> None: ...
    def describe(self, text: str) -> None: ...
    def advance(self) -> None: ...
    def log(self, text: str) -> None: ...


def one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or "(no message)"
    return f"{type(e).__name__}: {text}"[:limit]


def device_name(device: torch.device) -> str:
    """The name tables are filed under: torch.cuda.get_device_name() as is, or 'cpu'."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def fingerprint(plan: TunePlan, name: str, scheme: QuantScheme) -> dict:
    """What a measurement depends on besides the config: journals that differ are not reused."""
    import triton

    return {
        "device_name": name,
        "dtype": str(plan.dtype).removeprefix("torch."),
        **routing_fields(plan),
        "seed": plan.seed,
        "moekit": moekit_version,
        "torch": torch.__version__,
        "triton": triton.__version__,
        # only when not the default, so that journals measured before the option existed still match;
        # only for schemes the mode changes (moekit.accumulation), whose fast tables live apart
        **({"fp8_accumulation": "fast"} if table_accumulation(scheme) == "fast" else {}),
        **({} if pdl_wanted() else {"pdl": "off"}),
    }


def routing_fields(plan: TunePlan) -> dict:
    """The fingerprint's routing: "uniform" or "skewed"; a recorded one (--routing FILE) by its
    content (plan.routing_sha256), so that the same routing given by another path reuses the
    journals and another routing recorded at the same path does not; the file itself, resolved,
    is kept for messages and the tables' meta, and not compared (journal.NOT_COMPARED).
    A journal of an older moekit holds the file's path as typed under "routing", and nothing that
    tells whether the file still holds the routing it measured (the file may have been recorded
    anew, the path was relative to a folder not kept): taken as measured under other conditions,
    so the sizes are measured again (its journal set aside), which costs time but never mixes
    two routings in one table."""
    if plan.routing_sha256 is None:
        return {"routing": plan.routing}
    return {"routing": "file", "routing_file": plan.routing_file, "routing_sha256": plan.routing_sha256}


def problem_fields(problem: TuneProblem) -> dict:
    s = problem.shape
    return {"num_experts": s.num_experts, "hidden": s.hidden, "intermediate": s.n, "top_k": s.top_k,
            "scheme": problem.scheme.name}


class Deadline:
    def __init__(self, end: float | None):
        self.end = end

    def passed(self) -> bool:
        return self.end is not None and _clock() >= self.end

    def reached(self, share_end: float | None) -> bool:
        """Whether the deadline, or the end of a share of it (`share`), has passed."""
        return self.passed() or (share_end is not None and _clock() >= share_end)

    def share(self, slots_left: int) -> float | None:
        """The end of an equal share of the time left, for one of `slots_left` searches."""
        if self.end is None:
            return None
        now = _clock()
        return now + max(self.end - now, 0.0) / max(slots_left, 1)


@contextlib.contextmanager
def _table_lock(out_dir: Path):
    """Serialise table rebuilds of worker processes (each rebuild reads every journal)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the final rebuild in the parent is the one that counts
        yield
        return
    lock = Path(out_dir) / ".progress" / ".lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


RUN_LOCK = "run.lock"  # under OUT/.progress: held by the run writing into OUT (run_lock)


@contextlib.contextmanager
def run_lock(out_dir: Path):
    """Hold OUT/.progress/run.lock for a whole run; TuneInputError at once if another run holds it.
    Two runs into one --out time the same configs, each journal write replacing the other's, and
    both rebuild the tables from journals the other is rewriting. flock, not the file's existence:
    the OS releases it when the process ends, crash or kill -9 included, so a lock file left behind
    never blocks a later run. The holder's pid is written into the file, for the refusal to name."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock (as _table_lock)
        yield
        return
    path = Path(out_dir) / PROGRESS_DIR / RUN_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:  # "a+": opening must not erase the holder's pid
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip()
            who = f"another moekit tune (pid {pid})" if pid.isdigit() else "another moekit tune"
            raise TuneInputError(f"--out {out_dir}: {who} is writing into this folder; wait for it to end, "
                                 "or give another --out") from None
        except OSError:  # a file system without flock (ENOLCK on some network ones): unlocked, as off POSIX
            locked = False
        if locked:
            f.truncate(0)
            f.write(f"{os.getpid()}\n")
            f.flush()
        try:
            yield
        finally:
            if locked:
                fcntl.flock(f, fcntl.LOCK_UN)


def discard_run_lock(out_dir: Path) -> None:
    """Remove the lock file (and .progress, if nothing else is in it) of a run that is about to
    remove the --out folder it created and wrote nothing into: left there, it would keep the
    folder. Called with the lock still held, so no other run can be between its check and this."""
    path = Path(out_dir) / PROGRESS_DIR / RUN_LOCK
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        path.parent.rmdir()


def check_out_layout(plan: TunePlan, device_names: Sequence[str]) -> None:
    """TuneInputError where a path the run writes under --out or --export-vllm is taken by
    something of the other kind (a file where tune keeps a folder, a folder where it writes a
    file): checked before anything is measured, since the run would otherwise stop there with a
    traceback (at the lock, or at the first table written, after the first measurements)."""
    from .output import WRITTEN_RECORD, vllm_file_name

    out, export = plan.out_dir, plan.export_dir
    progress = out / PROGRESS_DIR
    folders = [(progress, "its journal"), (out / "triton", "the triton tables"),
               (out / "backends", "the decision tables")]
    files = [(progress / RUN_LOCK, "its lock"), (progress / ".lock", "its lock"),
             (progress / WRITTEN_RECORD, "its record of the files it wrote")]
    vllm_folders, vllm_files = [], []
    for p in plan.problems:
        fast = table_accumulation(p.scheme) == "fast"  # vLLM's names have no mode: fast/ (output.write_tables)
        for name in device_names:
            table = problem_table_name(p, name)
            folders.append((journal_dir(out, table), f"the journal of {table}"))
            files += [(out / "triton" / table, "a triton table"), (out / "backends" / table, "a decision table")]
            if export is not None:
                if fast:
                    vllm_folders.append((export / "fast", "the vLLM config files of fast mode"))
                name_there = vllm_file_name(p.shape.num_experts, p.shape.n, name, p.scheme)
                vllm_files.append((export / ("fast" if fast else "") / name_there, "a vLLM config file"))
    for option, folder, must_be_folders, must_be_files in (("--out", out, folders, files),
                                                           ("--export-vllm", export, vllm_folders, vllm_files)):
        problems = [(path, f"is not a folder, where tune keeps {what}") for path, what in must_be_folders
                    if (path.exists() or path.is_symlink()) and not path.is_dir()]  # in order: a parent first
        problems += [(path, f"is a folder, where tune writes {what}") for path, what in must_be_files if path.is_dir()]
        if problems:
            path, problem = problems[0]
            raise TuneInputError(f"{option} {folder}: {path} {problem}: move it away, or give another {option}")


def run_journals(plan: TunePlan, p: TuneProblem, name: str) -> tuple[list[dict], dict[int, str]]:
    """The journals of a problem's table on device `name` measured under this run's conditions,
    and {batch size: why} of the others (journal.load_journals): those never feed its tables."""
    return load_journals(plan.out_dir, problem_table_name(p, name), fingerprint(plan, name, p.scheme), problem_fields(p))


def write_problem_tables(plan: TunePlan, p: TuneProblem, name: str,
                         log: Callable[[str], None] | None = None) -> tuple[list[Path], list[str]]:
    """Rebuild a problem's tables on device `name` from the journals of this run's conditions:
    (files written, notes). `log` hears at once of an earlier file kept before it is replaced
    (output.write_tables)."""
    with _table_lock(plan.out_dir):
        journals, others = run_journals(plan, p, name)
        notes = _left_out(others)
        if not journals:
            return [], notes
        written, more = write_tables(plan.out_dir, problem_table_name(p, name), journals, plan.run_meta,
                                     plan.export_dir, log)
    select.clear_cache()  # lookups in this process (auto, the triton configs) now see these tables
    return written, notes + more


def _left_out(others: dict[int, str]) -> list[str]:
    """One line per reason: the journals of other conditions left out of the tables."""
    by_why: dict[str, list[int]] = {}
    for M, why in others.items():
        by_why.setdefault(why, []).append(M)
    return [f"left out of the tables: the journals of M={', '.join(map(str, sizes))}, {why}; "
            "a run measuring those sizes measures them again" for why, sizes in by_why.items()]


def order_candidates(configs: Sequence[KernelConfig], neighbour: NeighbourResult | None, default: KernelConfig):
    """Most promising first, so that a budget cut loses the least: configs by their time at the
    neighbouring batch size (a config new here by its half-height sibling's, or, for a 16-warp
    one, that of its half-height sibling on 8 warps: the same share per warpgroup, since 16-warp
    configs have no half-height sibling in the space; an overlapped GEMM1 (OVERLAP) by its Triton
    sibling's, the same tile; a GEMV config reducing late (GEMV=2) by its GEMV=1 sibling's), then the unmeasured ones by how few fields they change from the
    default config (GEMV-path configs: from space.GEMV_START, so that they are interleaved with
    the tiled ones rather than all last)."""
    measured = neighbour.us if neighbour else {}

    def prior(cfg: KernelConfig):
        half = dataclasses.replace(cfg, BLOCK_M=max(cfg.BLOCK_M // 2, 16))
        guesses = [cfg, half]
        if cfg.OVERLAP:
            guesses.insert(1, dataclasses.replace(cfg, OVERLAP=0))
        if cfg.GEMV == 2:  # GEMM1 reducing once after its K loop: by its sibling reducing each step
            guesses.insert(1, dataclasses.replace(cfg, GEMV=1))
        if cfg.num_warps == WIDE_TILE_WARPS:
            guesses.append(dataclasses.replace(half, num_warps=WIDE_TILE_WARPS // 2))
        for guess in guesses:
            if config_key(guess) in measured:
                return (0, measured[config_key(guess)])
        start = GEMV_START if cfg.GEMV else default
        changed = sum(a != b for a, b in zip(dataclasses.astuple(cfg), dataclasses.astuple(start)))
        return (1, changed)

    return sorted(configs, key=prior)


def problem_table_name(p: TuneProblem, device: str) -> str:
    """The file name of a tune problem's tables on `device`, in the current accumulation mode."""
    return table_name(p.shape, p.scheme, device, table_accumulation(p.scheme))


def _is_gemm2_variant(entry: dict | None) -> bool:
    """Whether a journal entry's config is one of the GEMM2 step's variants (KernelConfig.is_gemm2_variant)."""
    return entry is not None and KernelConfig.from_dict(entry["config"]).is_gemm2_variant


def _kinds(dropped: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for why in dropped.values():
        kind = why.split(":", 1)[0]
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _died(reporter: Reporter, p: TuneProblem, j: Journal, what: str) -> str:
    """The error recorded for a measurement during which the process died MAX_DEATHS times (a
    segfault, the OOM killer, kill -9; not a Ctrl-C, SIGTERM or SIGHUP: stop_on_signals), said
    as it is recorded: a rerun does not try it again."""
    error = f"the process died {MAX_DEATHS} times while measuring it"
    reporter.log(f"{p.label} M={j.batch_size}: {what} recorded as failed: {error}")
    return error


class Inputs:
    def __init__(self, x, weights, topk_weights, topk_ids):
        self.x, self.weights, self.topk_weights, self.topk_ids = x, weights, topk_weights, topk_ids


class Worker:
    """Tunes every problem of the plan at `batch_sizes` on one device."""

    def __init__(self, plan: TunePlan, device: torch.device, batch_sizes: Sequence[int], reporter: Reporter,
                 deadline_end: float | None):
        self.plan, self.device, self.sizes = plan, device, sorted(batch_sizes)
        self.reporter, self.deadline = reporter, Deadline(deadline_end)
        self.triton = get_backend("triton")
        self._target: tuple[int, torch.Tensor | None] | None = None  # (M, default config's output)
        self.ceilings: roofline.Ceilings | None = None  # run(): the device's, for the floor check
        self._floors: dict[tuple[str, int], float | None] = {}
        self._before: dict[str, ProblemConfigs] = {}  # per problem: the tables before this run (_incumbents)
        self._weights = None
        self.precompiler = Precompiler(device, plan.dtype, 0)  # run() starts the helpers

    def run(self) -> None:
        self.name = device_name(self.device)
        self.reporter.device(self.name)
        self.ceilings = get_ceilings(self.device)
        self.shared_memory, source = shared_memory_limit(self.device)
        self.reporter.log(f"{self.name}: {self.shared_memory // 1024} KiB of shared memory per block ({source})")
        self.slots_left = len(self.plan.problems) * len(self.sizes)
        self.precompiler = Precompiler(self.device, self.plan.dtype, self.plan.compile_workers, self.reporter.log)
        try:
            for problem in self.plan.problems:
                if self.deadline.passed():
                    break
                self._problem(problem)
        finally:
            self.precompiler.close()

    # ------------------------------------------------------------------------------ phases

    def _problem(self, p: TuneProblem) -> None:
        table_file = problem_table_name(p, self.name)
        fp = fingerprint(self.plan, self.name, p.scheme)
        journals = {M: Journal.open(journal_path(self.plan.out_dir, table_file, M), fp, problem_fields(p), M,
                                    self.reporter.log) for M in self.sizes}
        for j in journals.values():  # a size between the tuned ones in an earlier run, tuned now
            if "between_configs" in j.data or "between_config" in j.data:
                j.data.pop("between_configs", None)
                j.data.pop("between_config", None)
                j.save()
        for M, cfg in self._incumbents(p, self.sizes).items():
            journals[M].set_incumbent(config_key(cfg), cfg.to_dict())  # saved with the first measurement
        searching = self.plan.search_space != "none"
        estimate = {M: self._static_candidates(p, M, journals[M]) if searching else 0 for M in self.sizes}
        self.reporter.add_total(sum(estimate.values()) + sum(len(self._baseline_todo(p, j)) for j in journals.values()))
        self._weights = None  # made at the first measurement: a finished journal needs none
        try:
            for M in self.sizes:
                if self.deadline.passed():
                    break
                self._baseline(p, journals[M])
            self._write_tables(p)
            previous = None
            for M in self.sizes if searching else []:
                if self.deadline.passed():
                    break
                share_end = self.deadline.share(self.slots_left)  # this size's search and its GEMM2 step
                self._search(p, journals[M], previous, estimate[M], self._search_end(share_end))
                self._search_gemm2(p, journals[M], share_end)
                self.slots_left -= 1
                # even past the deadline (seconds): without it this size's search cannot replace
                # the incumbent (output.chosen_config), and the last size's share ends at the deadline
                self._decide(p, journals[M])
                if previous is not None:
                    self._between(p, [b for b in self.plan.between if previous.batch_size < b < M])
                previous = journals[M]
                self._write_tables(p)
            for i, M in enumerate(self.sizes):  # what is left: --search-space none, or decisions of an older run
                if self.deadline.passed():
                    break
                self._search_gemm2(p, journals[M], self.deadline.share(len(self.sizes) - i))
                self._decide(p, journals[M])
            self._write_tables(p)
        finally:
            self._weights = self._target = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _write_tables(self, p: TuneProblem) -> None:
        write_problem_tables(self.plan, p, self.name, self.reporter.log)

    def run_between(self) -> None:
        """Every problem's between sizes not yet measured with the current configs (see the
        module docstring), after all searches."""
        self.name = device_name(self.device)
        self.ceilings = get_ceilings(self.device)
        for problem in self.plan.problems:
            if self.deadline.passed():
                break
            try:
                self._between(problem, self.plan.between)
            finally:
                self._weights = self._target = None
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def _between(self, p: TuneProblem, sizes: list[int]) -> None:
        table_file = problem_table_name(p, self.name)
        tuned: dict[int, KernelConfig] = {}  # the best config of every searched size (this run's conditions)
        for data in run_journals(self.plan, p, self.name)[0]:
            best = chosen_config(data)
            if best is not None and not is_between(data):
                tuned[data["batch_size"]] = KernelConfig.from_dict(best[1]["config"])
        if not tuned or not sizes:
            return
        fp = fingerprint(self.plan, self.name, p.scheme)
        before = self._incumbents(p, sizes)
        todo: list[tuple[Journal, list[KernelConfig], list[str]]] = []
        opened: list[Journal] = []
        for M in sizes:
            j = Journal.open(journal_path(self.plan.out_dir, table_file, M), fp, problem_fields(p), M, self.reporter.log)
            opened.append(j)
            if M in before:
                j.set_incumbent(config_key(before[M]), before[M].to_dict())
            # the neighbours the backend's lookup would take here: tiled ones only beyond the GEMV
            # path's bound (config.ProblemConfigs), where a GEMV entry never runs
            cfgs = neighbour_configs(tuned if gemv_may_win(p.shape, M) else
                                     {s: c for s, c in tuned.items() if not c.GEMV}, M)
            keys = [config_key(c) for c in cfgs]
            if j.data.get("between_configs") != keys or "between_config" in j.data:
                # a search found a better neighbour config (or a journal of the older, single-config
                # rule): the new ones are timed, earlier timings of other configs stay as measured
                j.data.pop("between_config", None)
                j.data["backends"].pop("triton", None)
                j.data["between_configs"] = keys
                j.save()
            if M in before and before[M] not in cfgs:  # the config the backend ran here before
                cfgs.append(before[M])
            cfgs = [c for c in cfgs if j.config(config_key(c)) is None]
            names = [n for n in p.backends if j.backend(n) is None]
            if cfgs or names:
                todo.append((j, cfgs, names))
        self.reporter.add_total(sum(len(cfgs) + len(names) for _, cfgs, names in todo))
        for j, cfgs, names in todo:
            inputs = None
            if not self.deadline.passed():  # got to this size: decided once all of them are timed
                j.set_backends_asked(p.backends)
            for item in [*cfgs, *names]:
                if self.deadline.passed():
                    self.reporter.add_total(-1)
                    continue
                inputs = inputs or self._inputs(p, j.batch_size)
                what = f"triton {config_key(item)}" if isinstance(item, KernelConfig) else item
                self.reporter.describe(f"{p.label} M={j.batch_size} (between): {what}")
                if isinstance(item, KernelConfig):
                    self._measure_config(p, j, item, inputs)
                else:
                    self._measure_backend(p, j, item, inputs)
                self.reporter.advance()
        for j in opened:
            if self.deadline.passed():
                break
            self._decide(p, j)
        self._write_tables(p)

    def _incumbents(self, p: TuneProblem, sizes: Sequence[int]) -> dict[int, KernelConfig]:
        """{batch size: the config the triton backend runs there}, where a table other than the
        run's own gives one: the user's (MOEKIT_CONFIG_DIR), a shipped one, or one borrowed from
        another GPU model of the sharing group (moekit.tables.SHARING_GROUPS). The tuner times it
        beside the default config, so the table it writes is never slower at a size it measures
        than the one it replaces (up to the timing's spread), however short the budget: an H100
        tune replaces the H200 table it borrowed within the sizes it measured, and that table carries configs
        hand-timed over many sessions, which a short search may not reach. {} where no table is
        found. The run's own tables (of its accumulation mode, in its --out) are looked past, so
        that the answer is the same before and after the run writes them; in fast mode a precise
        table in --out, which the fast tables refine, is read as the backend reads it. The tables
        are looked up once per problem (every size between asks again)."""
        before = self._before.get(p.label)
        if before is None:
            before = self._before[p.label] = problem_configs(p.shape, p.scheme, self.name,
                                                             skip_own=(self.plan.out_dir,))
        return {M: before.get(M) for M in sizes} if before.table else {}

    def _baseline_todo(self, p: TuneProblem, j: Journal) -> list[tuple[str, object]]:
        default = default_config(p.shape, p.scheme, j.batch_size)
        todo: list[tuple[str, object]] = []
        if j.config(config_key(default)) is None:
            todo.append(("config", default))
        found = j.incumbent()
        incumbent = KernelConfig.from_dict(found) if found else None
        if incumbent is not None and incumbent != default and j.config(config_key(incumbent)) is None:
            todo.append(("incumbent", incumbent))
        todo += [("backend", name) for name in p.backends if j.backend(name) is None]
        return todo

    def _baseline(self, p: TuneProblem, j: Journal) -> None:
        """The default config, the incumbent and every other backend at this batch size."""
        M = j.batch_size
        default = default_config(p.shape, p.scheme, M)
        if j.data["default"] != config_key(default):
            j.data["default"] = config_key(default)
            j.save()
        # the run got to this size's step 1: the decision table decides it only once each of these
        # has a time or an error (output.undecided); a size a budget cut never reached keeps the
        # field of the run that last got to it
        j.set_backends_asked(p.backends)
        todo = self._baseline_todo(p, j)
        if not todo:
            return
        inputs = self._inputs(p, M)
        for kind, item in todo:
            if self.deadline.passed():
                self.reporter.add_total(-1)
                continue
            what = {"config": "default config", "incumbent": "the config used before"}.get(kind, item)
            self.reporter.describe(f"{p.label} M={M}: {what}")
            if kind in ("config", "incumbent"):
                self._measure_config(p, j, item, inputs, is_default=kind == "config")
            else:
                self._measure_backend(p, j, item, inputs)
            self.reporter.advance()

    def _search_end(self, share_end: float | None) -> float | None:
        """Where a size's search stops: GEMM2_RESERVE of its share before share_end when the
        GEMM2 step will run (the search may end sooner and leave the step more)."""
        if share_end is None or not self.plan.gemm2_grid:
            return share_end
        now = _clock()
        return now + max(share_end - now, 0.0) * (1.0 - GEMM2_RESERVE)

    def _static_candidates(self, p: TuneProblem, M: int, j: Journal) -> int:
        kept, _ = static_prune(self.plan.space(p.scheme), p.shape, p.scheme, M, self.shared_memory, self.plan.search_space)
        return sum(1 for c in kept if j.config(config_key(c)) is None)

    def _search(self, p: TuneProblem, j: Journal, previous: Journal | None, estimated: int,
                share_end: float | None) -> None:
        M = j.batch_size
        default = default_config(p.shape, p.scheme, M)
        kept, static = static_prune(self.plan.space(p.scheme), p.shape, p.scheme, M, self.shared_memory,
                                    self.plan.search_space)
        neighbour = None
        if previous is not None:
            search = previous.data.get("search") or {}
            # the search space's own configs only: a GEMM2 launch variant's time is no candidate's,
            # nor that of a GEMV config beyond its bound (older journals: output.runnable_timings)
            plain = {k: v["us"] for k, v in runnable_timings(previous.data).items() if not _is_gemm2_variant(v)}
            chosen = chosen_config(previous.data)
            neighbour = NeighbourResult(previous.batch_size, plain, previous.failed(), set(search.get("dropped", {})),
                                        chosen[1]["us"] if chosen else None)
        dropped: dict[str, str] = {}
        if self.plan.search_space != "full":
            kept, dropped = neighbour_prune(kept, neighbour)
        kept = order_candidates(kept, neighbour, default)
        todo = [c for c in kept if j.config(config_key(c)) is None]
        j.data["search"] = {"space": self.plan.search_space, "candidates": len(kept), "dropped": dropped,
                            "static": _kinds(static), "complete": not todo}
        j.save()
        self.reporter.add_total(len(todo) - estimated)
        if not todo:
            return
        compiles = self.precompiler.submit(p.shape, p.scheme, M, todo)
        inputs = self._inputs(p, M)
        done = 0
        try:
            for cfg in todo:
                if self.deadline.reached(share_end):
                    break
                self.reporter.describe(f"{p.label} M={M}: {len(todo) - done} configs left")
                self._measure_config(p, j, cfg, inputs)
                self.reporter.advance()
                done += 1
        finally:  # a search stopped by its share leaves no compiles queued ahead of the next size's
            self.precompiler.cancel(compiles)
        if done < len(todo):
            self.reporter.add_total(done - len(todo))
        j.data["search"]["complete"] = done == len(todo)
        j.save()

    def _search_gemm2(self, p: TuneProblem, j: Journal, share_end: float | None) -> None:
        """GEMM2's own launch (space.gemm2_variants; space.gemv_gemm2_variants where the best is
        a GEMV config) on this size's best config of the search space (no GEMM2 launch of its
        own), on its best 16-warp one where that is close (WIDE_BASE_MARGIN), on its best 128x128
        8-warp one where the overlapped GEMM2 runs, and on its best one with a narrower column
        block likewise (gemm2_bases): each variant is timed as a config of its own, so the fastest
        of all becomes the table's entry. Done once per such base (journal output.GEMM2_FIELDS),
        also under --search-space none on the configs found before; within the size's share of
        the budget, after its search."""
        if not self.plan.gemm2_grid:
            return
        bases = dict(gemm2_bases(j, tall=self._overlap2_k_steps(p) > 0))
        for field in GEMM2_FIELDS:  # a base no longer taken (a new search, a misread timing): its record goes
            if field not in bases:  # (its variants stay in the journal as configs measured)
                j.data.pop(field, None)
        for field, base in bases.items():
            if not self._gemm2_variants_of(p, j, field, base, share_end):
                return

    def _overlap2_k_steps(self, p: TuneProblem) -> int:
        """GEMM2's K steps where the overlapped GEMM2 runs on this problem here, else 0."""
        if launch.overlap_available(self.device) and overlap2_idle(p.shape, p.scheme) is None:
            return p.shape.n // 128
        return 0

    def _gemm2_variants_of(self, p: TuneProblem, j: Journal, field: str, base: KernelConfig,
                           share_end: float | None) -> bool:
        """Times `base`'s GEMM2 launch variants not yet measured, recorded under j.data[field];
        False when the share of the budget ran out first."""
        if base.GEMV:
            variants, dropped = gemv_gemm2_variants(base, p.scheme, p.shape.top_k, self.shared_memory)
        else:
            variants, dropped = gemm2_variants(base, p.scheme, self.plan.gemm2_grid, self.shared_memory,
                                               gemm2_partial_accumulator(p.scheme, fp8_accumulation()),
                                               self._overlap2_k_steps(p), intermediate=p.shape.n)
        todo = [c for c in variants if j.config(config_key(c)) is None]
        j.data[field] = {"base": config_key(base), "variants": len(variants), "dropped": dropped,
                         "complete": not todo}
        j.save()
        if not todo:
            return True
        if self.deadline.reached(share_end):
            return False
        self.reporter.add_total(len(todo))
        compiles = self.precompiler.submit(p.shape, p.scheme, j.batch_size, todo)
        inputs = self._inputs(p, j.batch_size)
        try:
            for done, cfg in enumerate(todo):
                if self.deadline.reached(share_end):
                    self.reporter.add_total(done - len(todo))
                    return False
                self.reporter.describe(f"{p.label} M={j.batch_size}: GEMM2 launch, {len(todo) - done} left")
                self._measure_config(p, j, cfg, inputs)
                self.reporter.advance()
        finally:  # as in _search: nothing left queued behind a step that stopped
            self.precompiler.cancel(compiles)
        j.data[field]["complete"] = True
        j.save()
        return True

    # -------------------------------------------------------------------------- measuring

    def _inputs(self, p: TuneProblem, M: int) -> Inputs:
        if self._weights is None:  # once per problem, reused by every batch size and config
            self._weights = make_weights(p.shape, p.scheme, self.device, seed=p.weights_seed, dtype=self.plan.dtype)
        weights = self._weights
        seed = input_seed(self.plan.seed, M)
        x = make_x(M, p.shape.hidden, self.device, seed=seed, dtype=self.plan.dtype)
        tw, ids = make_routing(self.plan.routing_kind, M, p.shape, seed=seed, recorded=p.recorded)
        tw, ids = validate_inputs(x, weights, tw.to(self.device), ids.to(self.device))
        return Inputs(x, weights, tw, ids)

    def _time(self, inputs: Inputs, backend, config: KernelConfig | None, what: str) -> tuple[dict, torch.Tensor | None]:
        """(result for the journal, the layer's output of the first call)."""
        kept: list[torch.Tensor] = []
        kwargs = {} if config is None else {"config": config}
        x, w, tw, ids = inputs.x, inputs.weights, inputs.topk_weights, inputs.topk_ids

        def layer():
            out = backend.run(x, w, tw, ids, **kwargs)
            if not kept:
                kept.append(out)
            return out

        try:
            with torch.no_grad():
                timing = measure_time(layer, reps=self.plan.reps, warmup=self.plan.warmup, device=self.device,
                                      what=f"{what} at M={x.shape[0]}")
        except Exception as e:  # noqa: BLE001 - compile errors, out of resources, OOM: recorded, skipped
            return {"error": one_line(e)}, None
        if not (math.isfinite(timing.median_us) and timing.median_us > 0):
            return {"error": f"measured {timing.median_us} µs, below the timer's resolution"}, None
        result = {"us": round(timing.median_us, 3), "p20_us": round(timing.p20_us, 3),
                  "p80_us": round(timing.p80_us, 3), "method": timing.method}
        if timing.flush_us is not None:  # the flushes' median: kept to tell a disturbed timing
            result["flush_us"] = round(timing.flush_us, 1)
            result["flush"] = FLUSH_METHOD  # which harness subtracted it (output.decision_candidates)
        if timing.note:
            result["note"] = timing.note
        return result, (kept[0] if kept else None)

    def _measure_config(self, p: TuneProblem, j: Journal, cfg: KernelConfig, inputs: Inputs, is_default=False) -> None:
        key, what = config_key(cfg), f"triton {config_key(cfg)}"
        if j.deaths(what) >= MAX_DEATHS:
            j.record_config(key, cfg.to_dict(), {"error": _died(self.reporter, p, j, f"config {key}")})
            return
        j.begin(what)
        try:
            result, out = self._time(inputs, self.triton, cfg, what)
            floor = self._floor(p, inputs)
            if floor is not None and result.get("us", floor) < floor:  # impossible: a misread, timed again
                again, _ = self._time(inputs, self.triton, cfg, what)
                self.reporter.log(f"{p.label} M={j.batch_size}: config {key} read {result['us']} µs, below the "
                                  f"roofline floor {floor:.1f}: timed again, {again.get('us', again.get('error'))}")
                if "us" in again:
                    result = {**again, "first_us": result["us"], "floor_us": round(floor, 1)}
            if out is not None:
                if is_default:
                    self._target = (j.batch_size, out)
                wrong = self._wrong_output(out, None if is_default else self._default_output(p, inputs, j.batch_size))
                if wrong:
                    result = {"error": wrong, "rejected_us": result["us"]}
        except BaseException:
            j.end(what)  # stopped on purpose (Ctrl-C, a test): not a death
            raise
        j.record_config(key, cfg.to_dict(), result)
        if "error" in result:
            self.reporter.log(f"{p.label} M={j.batch_size}: config {key} skipped: {result['error']}")
            self._check_device(what)

    def _floor(self, p: TuneProblem, inputs: Inputs) -> float | None:
        """The roofline floor of one layer call on these inputs (their routing's experts), µs;
        None without ceilings (the CPU)."""
        if self.ceilings is None:
            return None
        M = inputs.x.shape[0]
        if (p.label, M) not in self._floors:
            counts = roofline.count(p.shape, p.scheme, M, inputs.topk_ids, inputs.x.dtype)
            self._floors[(p.label, M)] = roofline.floor_us(counts, self.ceilings, p.scheme)
        return self._floors[(p.label, M)]

    def _measure_backend(self, p: TuneProblem, j: Journal, name: str, inputs: Inputs) -> None:
        what = f"backend {name}"
        if j.deaths(what) >= MAX_DEATHS:
            j.record_backend(name, {"error": _died(self.reporter, p, j, f"backend {name}")})
            return
        j.begin(what)
        try:
            result, out = self._time(inputs, get_backend(name), None, what)
            wrong = self._wrong_output(out, None)
            if wrong:
                result = {"error": wrong}
        except BaseException:
            j.end(what)
            raise
        j.record_backend(name, result)
        if "error" in result:
            self.reporter.log(f"{p.label} M={j.batch_size}: backend {name} failed: {result['error']}")
            self._check_device(what)

    def _decide(self, p: TuneProblem, j: Journal) -> None:
        """The decision timing at this size (module docstring): triton with each of its fastest
        configs (output.decision_candidates: the incumbent too) and every other backend, in the
        same interleaved rounds, the replays cycling through plan.routings routings; the fastest
        triton config there is the table's (output.chosen_config). Redone when the candidates or
        the number of routings change. A backend whose separate timing failed (an error, a wrong
        output, deaths) is not run again: its error stands in the decision."""
        candidates = decision_candidates(j.data)
        if not candidates:
            return  # no triton config ran: the table keeps the separate timings
        routings = self.plan.routings
        failed = {n: r["error"] for n in p.backends if (r := j.backend(n)) is not None and "error" in r}
        names = [n for n in p.backends if n not in failed]
        done = j.data.get("decision") or {}
        timed = set(done.get("us", {})) | set(done.get("errors", {}))
        if decision_is_current(j.data) and done.get("routings") == routings and (
                "error" in done or set(names) <= timed):
            return
        M = j.batch_size
        what = f"decision {'/'.join(candidates)} x{routings}"
        if j.deaths(what) >= MAX_DEATHS:
            j.data["decision"] = {"config": candidates[0], "candidates": candidates, "routings": routings,
                                  "error": _died(self.reporter, p, j, "the decision timing")}
            j.save()
            return
        self.reporter.describe(f"{p.label} M={M}: {len(candidates)} triton configs and every backend over "
                               f"{routings} routings")
        inputs = self._inputs(p, M)
        rotation = make_routings(self.plan.routing_kind, M, p.shape, routings, seed=input_seed(self.plan.seed, M),
                                 recorded=p.recorded, device=self.device)
        x, w, tw, ids = inputs.x, inputs.weights, rotation.topk_weights, rotation.topk_ids

        def layer(backend, kwargs: dict):
            return lambda: backend.run(x, w, tw, ids, **kwargs)

        fns = {f"triton {key}": layer(self.triton, {"config": KernelConfig.from_dict(j.config(key)["config"])})
               for key in candidates}
        fns.update({name: layer(get_backend(name), {}) for name in names})
        whats = {name: f"{name if name.startswith('triton ') else 'backend ' + name} at M={M}" for name in fns}
        j.begin(what)
        try:
            with torch.no_grad():
                timings = measure_times(fns, reps=self.plan.reps, warmup=self.plan.warmup, device=self.device,
                                        what=whats, before_each=rotation if len(rotation) > 1 else None)
        except Exception as e:  # noqa: BLE001 - a failure of the whole timing (a CUDA error, OOM): recorded
            j.data["decision"] = {"config": candidates[0], "candidates": candidates, "routings": routings,
                                  "error": one_line(e)}
            self.reporter.log(f"{p.label} M={M}: the decision timing failed: {one_line(e)}")
            self._device_after_decision(j, what)
            j.end(what)
            return
        except BaseException:
            j.end(what)  # stopped on purpose (Ctrl-C, a test): not a death
            raise
        results: dict[str, float | str] = {}  # name -> µs, or why it failed
        for name, t in timings.items():
            if isinstance(t, BaseException):
                results[name] = one_line(t)
            elif not (math.isfinite(t.median_us) and t.median_us > 0):
                results[name] = f"measured {t.median_us} µs, below the timer's resolution"
            else:
                results[name] = round(t.median_us, 3)
        triton_us = {k: v for k in candidates if isinstance(v := results[f"triton {k}"], float)}
        triton_errors = {k: v for k in candidates if isinstance(v := results[f"triton {k}"], str)}
        us = {n: v for n in names if isinstance(v := results[n], float)}
        errors = {**failed, **{n: v for n in names if isinstance(v := results[n], str)}}
        chosen = min(triton_us, key=lambda k: (triton_us[k], k)) if triton_us else candidates[0]
        if triton_us:
            us["triton"] = triton_us[chosen]
        else:
            errors["triton"] = triton_errors[chosen]
        j.data["decision"] = {"config": chosen, "candidates": candidates, "triton_us": triton_us, "routings": routings,
                              "us": us, **({"errors": errors} if errors else {}),
                              **({"triton_errors": triton_errors} if triton_errors else {})}
        new_failures = {**{n: e for n, e in errors.items() if n not in failed and n != "triton"},
                        **{f"triton {k}": e for k, e in triton_errors.items()}}
        for name, error in new_failures.items():
            self.reporter.log(f"{p.label} M={M}: {name} failed in the decision timing: {error}")
        if new_failures:
            self._device_after_decision(j, what)
        j.end(what)

    def _device_after_decision(self, j: Journal, what: str) -> None:
        """After failures in a decision timing: where they left the CUDA context broken
        (DeviceBroken), the decision is taken back (its errors are then the break's, not each
        backend's own: kept, they would stand in the decision table, and auto avoid those
        backends there, after every rerun) and `what` stays in flight, counted as a death: a rerun
        times it again, and after MAX_DEATHS records it failed. A working context keeps it."""
        try:
            self._check_device(what)
        except DeviceBroken:
            j.data.pop("decision", None)
            j.save()  # `what` still in flight (begin): this run's attempt counts as a death
            raise

    def _default_output(self, p: TuneProblem, inputs: Inputs, M: int) -> torch.Tensor | None:
        """The default config's output at M: the reference of the output check. Kept from its
        timing, or (after a resume) computed once; None when the default config fails."""
        if self._target is None or self._target[0] != M:
            try:
                with torch.no_grad():
                    out = self.triton.run(inputs.x, inputs.weights, inputs.topk_weights, inputs.topk_ids,
                                          config=default_config(p.shape, p.scheme, M))
            except Exception:  # noqa: BLE001 - without a reference only NaN/inf are checked
                out = None
            self._target = (M, out)
        return self._target[1]

    @staticmethod
    def _wrong_output(out: torch.Tensor | None, reference: torch.Tensor | None) -> str | None:
        if out is None:
            return None
        if not bool(torch.isfinite(out).all()):
            return "wrong output: NaN or inf values"
        if reference is not None:
            err = rel_l2(out, reference)
            tolerance = output_tolerance()
            if not err <= tolerance:
                return f"wrong output: {err:.1e} relative L2 from the default config's (tolerance {tolerance:g})"
        return None

    def _check_device(self, what: str) -> None:
        if self.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # an out-of-memory failure leaves cached blocks behind
        except Exception as e:  # noqa: BLE001
            raise DeviceBroken(
                f"the CUDA context on {self.device} is unusable after {what} ({one_line(e)}); it is recorded "
                "as failed: rerun the same command to continue"
            ) from None


# ------------------------------------------------------------------------- several GPUs


# How long a worker process told to stop (run_workers) may take to save its journal and end.
WORKER_STOP_S = 30.0


def split_batch_sizes(sizes: Sequence[int], workers: int) -> list[list[int]]:
    """Contiguous runs of the sorted sizes, as even as possible: each worker's sizes neighbour
    each other, so its neighbour pruning has close evidence."""
    sizes = sorted(sizes)
    count = max(1, min(workers, len(sizes)))
    base, extra = divmod(len(sizes), count)
    chunks, start = [], 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        chunks.append(sizes[start:end])
        start = end
    return chunks


class QueueReporter:
    """A worker process's Reporter: every event goes to the parent, which draws the progress."""

    def __init__(self, queue, worker: int):
        self.queue, self.worker = queue, worker

    def _send(self, *event) -> None:
        self.queue.put((self.worker, *event))

    def device(self, name: str) -> None:
        self._send("device", name)

    def add_total(self, count: int) -> None:
        self._send("add_total", count)

    def describe(self, text: str) -> None:
        self._send("describe", text)

    def advance(self) -> None:
        self._send("advance")

    def log(self, text: str) -> None:
        self._send("log", text)


def _worker_main(index: int, plan: TunePlan, devices: list[str], chunks: list[list[int]], queue,
                 deadline_end: float | None) -> None:
    """Entry point of a worker process (torch.multiprocessing.spawn passes `index`)."""
    device = torch.device(devices[index])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    reporter = QueueReporter(queue, index)
    with stop_on_signals():  # the parent's terminate() (run_workers), or a SIGTERM to the process group
        try:
            Worker(plan, device, chunks[index], reporter, deadline_end).run()
        except DeviceBroken as e:
            reporter._send("broken", str(e))
        except KeyboardInterrupt as e:  # torch's spawn wrapper ends the process quietly on it: the parent is told
            reporter._send("stopped", e.signum if isinstance(e, Stopped) else int(signal.SIGINT))
            raise


def run_workers(plan: TunePlan, devices: list[str], deadline_end: float | None, on_event) -> list[str]:
    """Run one worker process per device over contiguous runs of the batch sizes; `on_event(worker,
    kind, *args)` receives the workers' events. Returns the problems reported (DeviceBroken)."""
    import queue as queue_module

    import torch.multiprocessing as mp

    chunks = split_batch_sizes(plan.batch_sizes, len(devices))
    devices = devices[: len(chunks)]
    events = mp.get_context("spawn").Queue()
    broken: list[str] = []
    stopped: list[int] = []

    def drain() -> None:
        while True:
            try:
                worker, kind, *args = events.get(timeout=0.05)
            except queue_module.Empty:
                return
            if kind == "broken":
                broken.append(args[0])
            elif kind == "stopped":  # a signal to the worker alone: not a progress event
                stopped.append(args[0])
                continue
            on_event(worker, kind, *args)

    context = mp.spawn(_worker_main, args=(plan, devices, chunks, events, deadline_end),
                       nprocs=len(devices), join=False)
    try:
        while not context.join(timeout=0.1):
            drain()
    except BaseException:
        alive = [process for process in context.processes if process.is_alive()]  # only those this run started
        for process in alive:  # SIGTERM: each stops as on Ctrl-C (stop_on_signals), un-marking its measurement
            process.terminate()
        deadline = time.monotonic() + WORKER_STOP_S
        for process in alive:  # their journals saved before the parent rebuilds the tables from them
            process.join(timeout=max(deadline - time.monotonic(), 0.0))
            if process.is_alive():  # stuck in a kernel or a compile: that measurement counts as a death
                process.kill()
        raise
    finally:
        drain()
    if stopped:  # a worker was stopped by a signal of its own: the run stops as if this process had it
        raise Stopped(stopped[0]) if stopped[0] != signal.SIGINT else KeyboardInterrupt()
    return broken


__all__ = [
    "OUTPUT_TOLERANCE",
    "DeviceBroken",
    "Stopped",
    "Worker",
    "check_out_layout",
    "device_name",
    "measure_time",
    "order_candidates",
    "output_tolerance",
    "run_journals",
    "discard_run_lock",
    "run_lock",
    "run_workers",
    "split_batch_sizes",
    "stop_on_signals",
    "write_problem_tables",
]
