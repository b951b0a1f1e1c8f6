"""`moekit tune`'s options, checked all at once before anything runs or is written (bad input is
one line and exit status 2), and turned into a `TunePlan` that worker processes can receive."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from ..backends import get_backend
from ..bench import (
    DEFAULT_BATCH_SIZES,
    ROUTINGS,
    BenchInputError,
    check_run_settings,
    load_routing_file,
    parse_batch_sizes,
    parse_dtype,
    parse_names,
    plan_backends,
    prepare_out_dir,
    remove_if_empty,
    resolve_problems,
)
from ..inputs import DEFAULT_ROUTINGS
from ..spec import MoEShape, QuantScheme
from .precompile import default_helpers
from .space import NEIGHBOUR_MARGIN, SEARCH_SPACES, SpaceFn, default_space, gemm2_grid

GPU_BATCH_SIZES = DEFAULT_BATCH_SIZES  # moekit bench's: tables cover the sizes bench times
CPU_BATCH_SIZES = (1, 4)  # the Triton interpreter takes ~0.3 s per layer call (bench's CPU sizes are more)
DEFAULT_REPS = 20  # per config: medians of 20 flushed replays are stable to ~1% on an H200
DEFAULT_WARMUP = 3  # the first call compiles; the others settle the allocator


class TuneInputError(BenchInputError):
    """Bad input to tune: the CLI prints it as one line and exits with status 2."""


@dataclasses.dataclass
class TuneOptions:
    models: list[str]
    tp: int = 1
    scheme: str | None = None  # one scheme, or several separated by commas (each tuned with its own scales)
    batch_sizes: list[str] | None = None
    backends: list[str] | None = None  # backends timed besides triton (default: every one that can run)
    budget: str | None = None  # "90s", "10m", "1h"; None: no limit
    out: str | None = None
    routing: str = "uniform"
    search_space: str = "pruned"
    reps: int = DEFAULT_REPS
    warmup: int = DEFAULT_WARMUP
    seed: int = 0
    dtype: str = "bf16"
    export_vllm: str | None = None
    compile_workers: int | None = None  # helper processes compiling ahead (None: precompile.default_helpers)
    between: bool = True  # also time every backend at the sizes between the tuned ones (between_sizes)
    gemm2: bool = True  # after each size's search, GEMM2's own launch variants of the best config
    routings: int = DEFAULT_ROUTINGS  # the decision timing cycles through this many routings per size
    argv: list[str] | None = None
    space: SpaceFn | None = None  # tests: the configs to search instead of the device's space
    devices: list[str] | None = None  # tests: worker devices instead of every visible GPU


@dataclasses.dataclass
class TuneProblem:
    """One table to produce: a shape and scheme (several models may share it)."""

    models: list[str]
    shape: MoEShape
    scheme: QuantScheme
    weights_seed: int
    backends: list[str]  # timed besides triton
    recorded: torch.Tensor | None = None  # recorded topk_ids (--routing FILE)

    @property
    def label(self) -> str:
        return f"{'='.join(self.models)} ({self.scheme.name})"


@dataclasses.dataclass
class TunePlan:
    problems: list[TuneProblem]
    batch_sizes: list[int]
    dtype: torch.dtype
    routing: str  # as given: uniform, skewed or the file
    routing_kind: str  # uniform, skewed or file
    routing_file: str | None  # a recorded routing (--routing FILE): the file, resolved (for messages)
    routing_sha256: str | None  # and its topk_ids' content hash (routing_digest): what identifies it
    seed: int
    reps: int
    warmup: int
    search_space: str  # "pruned", "full" (which pruning applies: space.static_prune, neighbour_prune) or "none"
    space: SpaceFn  # the configs to search
    out_dir: Path
    export_dir: Path | None
    budget_s: float | None
    compile_workers: int  # helper processes compiling configs ahead of the measurements (0: none)
    between: list[int]  # sizes between the tuned ones: no search, the backends and the neighbours' configs (between_sizes)
    routings: int  # routings of each size the decision timing cycles through (runner._decide)
    gemm2_grid: tuple  # GEMM2's launch variants tried on the best config (space.gemm2_grid), () when off
    run_meta: dict  # extra metadata of the triton tables (command, search settings)
    created: list[Path]  # output folders this run created (removed again if it fails at once)


_BUDGET = re.compile(r"(?:\d+(?:\.\d+)?[hms])+|\d+(?:\.\d+)?")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "": 1.0}


def parse_budget(text: str | None) -> float | None:
    """'90s', '10m', '1h', '1h30m' or plain seconds ('90') -> seconds; None -> None."""
    if text is None:
        return None
    compact = str(text).strip().lower().replace(" ", "")
    if not _BUDGET.fullmatch(compact):
        raise TuneInputError(f"--budget: {text!r} is not a duration like 90s, 10m, 1h or 1h30m")
    seconds = sum(float(v) * _UNIT[u] for v, u in re.findall(r"(\d+(?:\.\d+)?)([hms]?)", compact))
    if seconds <= 0:
        raise TuneInputError(f"--budget: {text!r} is not a positive duration")
    return seconds


def between_sizes(batch_sizes: Sequence[int]) -> list[int]:
    """One size between each two adjacent tuned sizes, where every backend is timed again (triton
    with the best config of each neighbour, the faster becoming the config there: runner._between).

    Why: a backend's time is not smooth in M. CUTLASS's grouped GEMM moves in steps as its tiles
    fill waves of SMs, so the winner can change between two tuned sizes although the same backend
    won at both: on an H200, Mixtral-8x7B FP8 at M = 768 ran cutlass 12% faster than triton while
    triton won at 512 and 1024 (BENCHMARKS.md, 2026-12-03). The size taken is the geometric
    midpoint (the middle of the gap in log space, where the triton backend's nearest-size config
    lookup switches), rounded to a multiple of 8 from
    64 tokens up (the sizes serving engines capture CUDA graphs for)."""
    sizes = sorted(set(batch_sizes))
    out = []
    for low, high in itertools.pairwise(sizes):
        mid = (low * high) ** 0.5
        mid = round(mid / 8) * 8 if mid >= 64 else round(mid)
        if low < mid < high:
            out.append(mid)
    return out


def routing_digest(topk_ids: torch.Tensor) -> str:
    """sha256 of recorded topk_ids as tune uses them (bench.load_routing_file: int64, [tokens,
    top_k]): the same routing in another file, or saved another way (.pt, .npy, a dict holding it),
    gives the same digest; a routing recorded anew at the same path another."""
    ids = topk_ids.detach().to("cpu", torch.int64).contiguous()
    digest = hashlib.sha256(f"topk_ids int64 {tuple(ids.shape)}\n".encode())
    digest.update(ids.numpy().tobytes())
    return digest.hexdigest()


def _schemes(value: str | None) -> list[str | None]:
    if value is None:
        return [None]
    names = [s for s in re.split(r"[,\s]+", value) if s]
    if not names:
        raise TuneInputError("--scheme: no scheme given")
    return list(dict.fromkeys(names))


def _other_backends(requested: Sequence[str] | None) -> list[str] | None:
    names = parse_names(requested)
    if names and "auto" in names:
        raise TuneInputError("--backends: auto is not a backend to time; tune writes the table that auto reads")
    return names


def _refuse_shared_files(problems: list[TuneProblem], export_vllm: bool) -> None:
    """TuneInputError where two problems of one run would write the same file, each overwriting
    the other's results: moekit's table names carry no top-k (problems alike but for top-k), and
    vLLM's file names no hidden size and no activation scheme (fp8-channel-token and
    fp8-tensor-dynamic both name `dtype=fp8_w8a8`)."""
    from .output import vllm_file_name

    def describe(p: TuneProblem) -> str:
        return f"{'/'.join(p.models)} ({p.scheme.name}, top-{p.shape.top_k}, H={p.shape.hidden})"

    kinds = [("moekit table", lambda p: (p.shape.num_experts, p.shape.hidden, p.shape.n, p.scheme.name),
              "their top-k differs, which the table's name does not say", "")]
    if export_vllm:
        kinds.append(("vLLM config file", lambda p: vllm_file_name(p.shape.num_experts, p.shape.n, "GPU", p.scheme),
                      "vLLM's file name has E, N, the device and the weights' dtype only",
                      " (or leave --export-vllm out)"))
    for what, key, why, alternative in kinds:
        first: dict = {}
        for p in problems:
            other = first.setdefault(key(p), p)
            if other is not p:
                raise TuneInputError(
                    f"{describe(other)} and {describe(p)} would write the same {what} ({why}): tune them "
                    f"in separate runs, each with its own --out and --export-vllm folders{alternative}"
                )


def build_plan(opts: TuneOptions, device: torch.device) -> TunePlan:
    """Check every option; raises TuneInputError naming the first problem. Creates the output
    folder(s) last, so that bad input leaves nothing behind."""
    if opts.search_space not in SEARCH_SPACES:
        raise TuneInputError(f"--search-space: {opts.search_space!r} is not one of {', '.join(SEARCH_SPACES)}")
    try:
        check_run_settings(opts.seed)  # MOEKIT_FP8_ACCUMULATION and MOEKIT_PDL: conditions of every measurement
    except BenchInputError as e:
        raise TuneInputError(str(e)) from None
    helpers = default_helpers(device) if opts.compile_workers is None else opts.compile_workers
    for name, value, least in (("--reps", opts.reps, 1), ("--warmup", opts.warmup, 0), ("--compile-workers", helpers, 0),
                               ("--routings", opts.routings, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise TuneInputError(f"{name} must be an integer >= {least}, got {value!r}")
    budget = parse_budget(opts.budget)
    dtype = parse_dtype(opts.dtype)
    batch_sizes = sorted(parse_batch_sizes(opts.batch_sizes, GPU_BATCH_SIZES if device.type == "cuda" else CPU_BATCH_SIZES))
    requested = _other_backends(opts.backends)
    triton = get_backend("triton")

    problems: list[TuneProblem] = []
    by_table: dict[tuple, TuneProblem] = {}
    for scheme_name in _schemes(opts.scheme):
        for index, found in enumerate(resolve_problems(opts.models, opts.tp, scheme_name, device)):
            reasons = triton.supports(found.shape, found.scheme, device, dtype)
            if reasons:
                raise TuneInputError(f"the triton backend cannot run {found.describe()} here: {'; '.join(reasons)}")
            s = found.shape
            key = (s.num_experts, s.hidden, s.n, s.top_k, found.scheme.name)
            if key in by_table:  # another model with the same layer: one table serves both
                if found.name not in by_table[key].models:
                    by_table[key].models.append(found.name)
                continue
            named = [n for n in requested if n != "triton"] if requested else None
            if named == []:  # --backends triton: no other backend
                others = []
            else:
                others = plan_backends([found], named, device, dtype, include_auto=False).per_problem[found.name]
            recorded = None
            if opts.routing not in ROUTINGS:
                recorded = load_routing_file(opts.routing, found.spec)
            problem = TuneProblem(
                [found.name], found.shape, found.scheme, opts.seed + 1000 * index,
                [n for n in others if n != "triton"], recorded,
            )
            by_table[key] = problem
            problems.append(problem)

    _refuse_shared_files(problems, opts.export_vllm is not None)
    out_dir, created = prepare_out_dir(opts.out or Path("moekit-results") / "tune", "tune")
    created_dirs = [out_dir] if created else []
    export_dir = None
    if opts.export_vllm is not None:
        try:
            export_dir, created = prepare_out_dir(opts.export_vllm, "vllm")
        except BenchInputError as e:
            remove_if_empty(created_dirs)
            raise TuneInputError(str(e).replace("--out", "--export-vllm", 1)) from None
        if created:
            created_dirs.append(export_dir)
    space = opts.space or default_space(device, opts.search_space)
    recorded = problems[0].recorded if problems else None
    return TunePlan(
        problems=problems,
        batch_sizes=batch_sizes,
        dtype=dtype,
        routing=opts.routing,
        routing_kind=opts.routing if opts.routing in ROUTINGS else "file",
        routing_file=None if recorded is None else str(Path(opts.routing).expanduser().resolve()),
        routing_sha256=None if recorded is None else routing_digest(recorded),
        seed=opts.seed,
        reps=opts.reps,
        warmup=opts.warmup,
        search_space=opts.search_space,
        space=space,
        out_dir=out_dir,
        export_dir=export_dir,
        budget_s=budget,
        compile_workers=helpers,
        between=between_sizes(batch_sizes) if opts.between else [],
        routings=opts.routings,
        gemm2_grid=gemm2_grid(device) if opts.gemm2 else (),
        run_meta={
            "tool": "moekit tune",
            "search_space": opts.search_space,
            "gemm2_search": opts.gemm2,
            "neighbour_margin": NEIGHBOUR_MARGIN,  # kept in a table only if a pruned search made it
            "reps": opts.reps,
            "warmup": opts.warmup,
            "seed": opts.seed,
        },
        created=created_dirs,
    )


__all__ = ["TuneInputError", "TuneOptions", "TunePlan", "TuneProblem", "between_sizes", "build_plan", "parse_budget"]
