"""`moekit bench`: every backend on real model shapes, against the roofline, with accuracy.

For each model, batch size M and backend, one point: the layer (or its expert GEMMs alone) timed
by the shared harness (`moekit.timing.time_graphs`: CUDA graphs, L2 flushed before each replay and
its time subtracted, median of repeated replays, the backends of one batch size interleaved), the
flops and bytes of `moekit.roofline`, the floor of the measured ceilings, the speedup against a
baseline backend, and the relative error of the backend's output against `reference` on the same
inputs.

Inputs are random (never zeros); routing is precomputed and shared by every backend of a point:
    uniform  K distinct experts per token, uniformly at random
    skewed   K distinct experts per token drawn from a Zipf-like expert popularity (seeded)
    FILE     recorded topk_ids [M', K] (.pt or .npy): the first M rows, tiled if M' < M

Without a CUDA GPU the same pipeline runs the CPU backends on a scaled-down shape (`cpu_shape`).

Gemm-only mode (`--mode gemm`) times the two expert GEMMs alone, on inputs already quantized and
aligned. A backend opts in by defining the optional hook (duck-typed, see `GemmOnly`):

    backend.prepare_gemm_only(x, weights, topk_weights, topk_ids) -> callable

which does all the preparation (quantize x, align/permute tokens) once and returns a closure that
runs only GEMM1 and GEMM2. Backends without it are reported as "n/a (no gemm-only mode)".
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch
from rich.markup import escape

from . import env, roofline
from .api import fused_moe, validate_inputs, weight_input
from .backends.reference import reference_moe
from .backends import backend_names, get_backend
from .dtypes import ACTIVATION_DTYPES
from .inputs import DEFAULT_ROUTINGS, input_seed, make_routings, make_weights, make_x
from .models import ModelSpec, get_model
from .select import ENV_VAR, BackendUnavailableError, select_backend
from .spec import MoEShape, QuantScheme, get_scheme
from .timing import DEFAULT_REPS, DEFAULT_WARMUP, DEFAULT_ROUNDS, FLUSH_WITH, Timing, time_graphs
from .weights import MoEWeights


class BenchInputError(ValueError):
    """Bad input to bench or check: the CLI prints it as one line and exits with status 2."""


class GemmOnly(Protocol):
    """The optional gemm-only hook of a backend (see the module docstring)."""

    def prepare_gemm_only(
        self, x: torch.Tensor, weights: MoEWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> Callable[[], Any]: ...


GEMM_ONLY_HOOK = "prepare_gemm_only"
NO_GEMM_ONLY = "n/a (no gemm-only mode)"

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CPU_BATCH_SIZES = (1, 4, 16, 64)
# The scaled-down shape of the CPU run: hidden and intermediate per expert shrunk, experts capped.
CPU_HIDDEN, CPU_N, CPU_MAX_EXPERTS = 256, 128, 16
# Backends that run on the CPU only inside the Triton interpreter: correct, but far too slow for
# a default run (they stay available when named in --backends).
INTERPRETED_ON_CPU = ("triton",)
DEFAULT_BASELINES = ("cutlass", "torch", "reference")  # first runnable (choose_baseline), unless --baseline
ROUTINGS = ("uniform", "skewed")

BASE_COLUMNS = (
    "model", "scheme", "backend", "chosen", "mode", "batch_size", "median_us", "p20_us", "p80_us",
    "tflops", "gbps", "floor_us", "efficiency",
)  # then speedup_vs_<baseline>, rel_err, [model_moe_us], note
# Every row carries where it came from, so that rows of many runs can be pooled and each still
# reproduced: the same values as the JSON metadata.
PROVENANCE_COLUMNS = ("device", "capability", "torch", "triton", "moekit", "git_commit", "date", "command")
UNITS = {
    "batch_size": "tokens (M)",
    "median_us": "µs, median of the replays (L2 flushed, flush time subtracted)",  # a CPU run's: CPU_MEDIAN_UNIT
    "p20_us": "µs, 20th percentile",
    "p80_us": "µs, 80th percentile",
    "tflops": "TFLOP/s (1e12), 2*M*topk*3*N*H / median",
    "gbps": "GB/s (1e9 bytes/s), roofline bytes / median (bytes: median over the timed calls, each counted "
    "on the routing it ran)",
    "floor_us": "µs, max(bytes / copy bandwidth, flops / matmul rate); median over the timed calls, each "
    "counted on the routing it ran",
    "efficiency": "floor_us / median_us (1.0 = the physical limit)",
    "speedup": "baseline median / this median",
    "rel_err": "||out - ref||_2 / ||ref||_2 against the reference backend, same inputs",
    "model_moe_us": "µs per decode step for the whole model: MoE layers x median_us",
    "auto_vs_fastest": "auto rows: median of the backend auto chose / the fastest backend's median - 1, "
    "both timed in the same interleaved rounds",
}
CPU_MEDIAN_UNIT = "µs, median of the timed calls (CPU wall clock; no L2 flush)"
# What auto's choice costs against the fastest backend. It is read from the chosen backend's own
# row, not from auto's: under a CUDA graph auto replays exactly the chosen backend's kernels (the
# choice is made on the host at capture), so the two rows differ only by timing spread, which at
# prefill sizes reached 5% between two closures of one kernel (BENCHMARKS.md, 2026-12-03).
AUTO_COLUMN = "auto_vs_fastest"


# ------------------------------------------------------------------------------ input parsing


# The largest batch size bench, check and tune take: warmup's bound (compile_ahead), far above
# a serving step (vLLM's default max-num-batched-tokens is 8192 or 16384). A larger one asked the
# allocator for its inputs and failed with a traceback (99999999999999 tokens).
MAX_BATCH_SIZE = 65536


def parse_batch_sizes(values: Sequence[str] | None, default: Sequence[int]) -> list[int]:
    """Positive integers up to MAX_BATCH_SIZE, from repeated and/or comma-separated strings;
    duplicates dropped."""
    if not values:
        return list(default)
    sizes: list[int] = []
    for value in values:
        for part in str(value).replace(",", " ").split():
            # plain digits only: int() also reads "1_0" (10), "٣" (3) and "+5", which select refuses
            digits = part.removeprefix("-")  # a negative size gets its own message below
            if not (digits.isascii() and digits.isdigit()):
                raise BenchInputError(f"--batch-sizes: {part!r} is not an integer (digits 0-9 only)")
            size = int(part)
            if size < 1:
                raise BenchInputError(f"--batch-sizes: {size} is not a positive integer")
            if size > MAX_BATCH_SIZE:
                raise BenchInputError(f"--batch-sizes: {size} is above {MAX_BATCH_SIZE}, the largest batch size "
                                      "moekit takes (moekit.bench.MAX_BATCH_SIZE)")
            if size not in sizes:
                sizes.append(size)
    if not sizes:
        raise BenchInputError("--batch-sizes: no batch size given")
    return sizes


def parse_names(values: Sequence[str] | None) -> list[str] | None:
    if not values:
        return None
    names: list[str] = []
    for value in values:
        for part in str(value).replace(",", " ").split():
            if part not in names:
                names.append(part)
    return names or None


def parse_dtype(name: str) -> torch.dtype:
    try:
        return ACTIVATION_DTYPES[name]
    except KeyError:
        raise BenchInputError(f"--dtype: {name!r} is not one of {', '.join(ACTIVATION_DTYPES)}") from None


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------- problems


@dataclasses.dataclass(frozen=True)
class Problem:
    """One model as it runs here: `shape` is the model's (CPU: scaled down), `spec` the model's own."""

    spec: ModelSpec
    shape: MoEShape
    scheme: QuantScheme
    scaled: bool

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def apply_on_input(self) -> bool:
        """The model scales each token's input by its routing weight (Llama-4, top-1): the layer
        timed and checked does so too (fused_moe's apply_router_weight_on_input)."""
        return self.spec.routing.apply_on_input

    def backend_inputs(self, x: torch.Tensor, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, topk_weights) as fused_moe hands them to its backend for this model: Llama-4's
        weight moved onto x (api.weight_input), what a reference must be given to compare."""
        return weight_input(x, topk_weights) if self.apply_on_input else (x, topk_weights)

    def describe(self) -> str:
        return f"{self.name} ({self.scheme.name}, {self.shape.describe()})"

    def to_json(self) -> dict:
        def shape_dict(s: MoEShape) -> dict:
            return {
                "num_experts": s.num_experts, "hidden": s.hidden, "intermediate": s.intermediate,
                "n": s.n, "top_k": s.top_k, "tp": s.tp, "num_layers": s.num_layers,
            }

        return {
            "name": self.name,
            "model_type": self.spec.model_type,
            "hf_id": self.spec.hf_id,
            "scheme": self.scheme.name,
            "shape": shape_dict(self.shape),
            "model_shape": shape_dict(self.spec.shape),
            "scaled_down": self.scaled,
            "apply_router_weight_on_input": self.apply_on_input,
        }


def cpu_shape(shape: MoEShape) -> MoEShape:
    """The CPU stand-in of a layer: hidden <= 256, N <= 128, E <= 16, top-k <= E, tp 1; the MoE
    layer count is kept (for whole-model estimates of the scaled-down model)."""
    experts = min(shape.num_experts, CPU_MAX_EXPERTS)
    return MoEShape(
        num_experts=experts,
        hidden=min(shape.hidden, CPU_HIDDEN),
        intermediate=min(shape.n, CPU_N),
        top_k=min(shape.top_k, experts),
        tp=1,
        num_layers=shape.num_layers,
        shared_experts=shape.shared_experts,
    )


def cpu_banner(batch_sizes: Sequence[int], doing: str = "running the CPU backends on",
               caveat: str = "; timings say nothing about a GPU") -> str:
    """What a command without a GPU does, on which scaled-down shape (cpu_shape), and what that
    leaves unsaid (bench's default; check's speaks of its checks)."""
    return (
        f"No CUDA GPU: {doing} a scaled-down shape (hidden <= {CPU_HIDDEN}, N <= {CPU_N}, experts <= "
        f"{CPU_MAX_EXPERTS}, batch sizes {' '.join(map(str, batch_sizes))}){caveat}"
    )


def resolve_problems(models: Sequence[str], tp: int, scheme: str | None, device: torch.device) -> list[Problem]:
    if not models:
        raise BenchInputError("give at least one --model (a preset name or a config.json / model folder)")
    if not isinstance(tp, int) or tp < 1:
        raise BenchInputError(f"--tp must be a positive integer, got {tp!r}")
    override = None
    if scheme is not None:
        try:
            override = get_scheme(scheme)
        except ValueError as e:
            several = "; this command takes one scheme (`moekit tune` takes several)" if "," in scheme else ""
            raise BenchInputError(f"--scheme: {e}{several}") from None
    problems = []
    for name in models:
        try:
            spec = get_model(name, tp=tp)
        except (ValueError, OSError) as e:
            raise BenchInputError(f"--model {name}: {_one_line(e)}") from None
        s = override or spec.scheme
        # the model's own N, not the CPU stand-in's (N <= 128 passes where the real N does not)
        if s.weight == "block" and spec.shape.n % 128:
            raise BenchInputError(
                f"--model {name}: scheme {s.name} needs the intermediate size per GPU to be a multiple "
                f"of 128, got {spec.shape.n} (intermediate {spec.shape.intermediate} / tp {tp})"
            )
        scaled = device.type != "cuda"
        problems.append(Problem(spec, cpu_shape(spec.shape) if scaled else spec.shape, s, scaled))
    problems = _distinct_names(models, problems)
    names = [p.name for p in problems]
    if len(set(names)) != len(names):  # a typo, not a wish to run one model twice (bench, check and tune)
        raise BenchInputError(f"--model: the same model is given twice ({', '.join(names)})")
    return problems


def _distinct_names(models: Sequence[str], problems: list[Problem]) -> list[Problem]:
    """A config file's model is named after its folder, so two config files of one folder (or two
    folders named alike) got one name, and were refused as the same model given twice: those
    keep the --model text as given, as their name. The same model given twice keeps its name
    (and is refused by resolve_problems)."""
    count: dict[str, int] = {}
    for p in problems:
        count[p.name] = count.get(p.name, 0) + 1
    where = {model: str(Path(model).expanduser().resolve()) if Path(model).expanduser().exists() else model
             for model in models}
    out = []
    for model, p in zip(models, problems):
        clash = count[p.name] > 1 and len({where[m] for m, q in zip(models, problems) if q.name == p.name}) > 1
        out.append(dataclasses.replace(p, spec=dataclasses.replace(p.spec, name=model)) if clash else p)
    return out


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


# ---------------------------------------------------------------------------------- backends


@dataclasses.dataclass
class BackendPlan:
    """Which backends run for each problem, and why the others do not."""

    per_problem: dict[str, list[str]]  # problem name -> backend names (may include "auto")
    skipped: dict[str, dict[str, list[str]]]  # problem name -> backend -> reasons


# Why `reference` is left out of a default run on a GPU: plan_backends' reference_note.
REFERENCE_NOT_TIMED = (
    "the float32 ground truth: too slow to time on real shapes by default (name it in --backends to time it)"
)


def plan_backends(
    problems: Sequence[Problem],
    requested: Sequence[str] | None,
    device: torch.device,
    dtype: torch.dtype,
    *,
    include_auto: bool = True,
    extra: Sequence[str] = (),
    reference_note: str = REFERENCE_NOT_TIMED,
) -> BackendPlan:
    """Default: every registered backend that can run the problem here (plus `auto`); a backend
    named explicitly that cannot run is bad input, with its reasons. `include_auto=False` is for
    callers that refuse 'auto' in `requested` (check, tune); `reference_note` says why reference
    is skipped by default on a GPU, in the caller's terms."""
    known = backend_names()
    if requested:
        for name in requested:
            if name != "auto" and name not in known:
                expected = f"auto or one of: {', '.join(known)}" if include_auto else f"one of: {', '.join(known)}"
                raise BenchInputError(f"--backends: unknown backend {name!r}; expected {expected}")
    per_problem: dict[str, list[str]] = {}
    skipped: dict[str, dict[str, list[str]]] = {}
    interpreting = device.type == "cpu"
    for p in problems:
        names: list[str] = []
        skipped[p.name] = {}
        candidates = list(requested) if requested else list(known)
        for name in extra:
            if name not in candidates:
                candidates.append(name)
        for name in candidates:
            if name == "auto":
                continue
            reasons = get_backend(name).supports(p.shape, p.scheme, device, dtype)
            explicit = bool(requested) and name in requested or name in extra
            if reasons:
                if explicit:
                    raise BenchInputError(
                        f"backend {name!r} cannot run {p.describe()} on {device.type}: {'; '.join(reasons)}"
                    )
                skipped[p.name][name] = reasons
            elif interpreting and name in INTERPRETED_ON_CPU and not explicit:
                skipped[p.name][name] = [
                    "on the CPU it runs only in the Triton interpreter, far too slow for a default run "
                    "(name it in --backends to include it anyway)"
                ]
            elif name == "reference" and device.type == "cuda" and not explicit:
                skipped[p.name][name] = [reference_note]
            else:
                names.append(name)
        if (not requested and include_auto) or (requested and "auto" in requested):
            names.append("auto")
        per_problem[p.name] = names
    return BackendPlan(per_problem, skipped)


def choose_baseline(requested: str | None, problems, device, dtype, mode: str = "layer",
                    backends: Sequence[str] | None = None) -> str:
    """--baseline, else the first of DEFAULT_BASELINES that can run every problem here. In gemm
    mode a baseline without a GEMM-only mode has only an "n/a" row, and every speedup would be
    empty: there it must have one (the first such backend that can run, one interpreted on the
    CPU only if --backends names it); where none can, the layer order (check_gemm_only refuses
    a run with nothing to time)."""
    known = backend_names()
    if requested is not None:
        if requested not in known:
            raise BenchInputError(f"--baseline: unknown backend {requested!r}; expected one of: {', '.join(known)}")
        if mode == "gemm" and not _has_gemm_only(requested):
            with_mode = [n for n in known if _has_gemm_only(n)]
            raise BenchInputError(f"--baseline {requested}: has no GEMM-only mode, so --mode gemm gives no speedups "
                                  f"against it; name one that has (those that do: {', '.join(with_mode)}), or use "
                                  "--mode layer")
        return requested

    def runs(name: str) -> bool:
        return all(not get_backend(name).supports(p.shape, p.scheme, device, dtype) for p in problems)

    if mode == "gemm":
        for name in dict.fromkeys([*DEFAULT_BASELINES, *known]):
            interpreted = device.type == "cpu" and name in INTERPRETED_ON_CPU and name not in (backends or ())
            if name in known and _has_gemm_only(name) and not interpreted and runs(name):
                return name
    for name in DEFAULT_BASELINES:
        if name in known and runs(name):
            return name
    return "reference"


# ------------------------------------------------------------------------------ routing files


def load_routing_file(path: str, spec: ModelSpec) -> torch.Tensor:
    """Recorded topk_ids [M', K] from a .pt (torch.save of a tensor, or of a dict holding
    "topk_ids") or .npy file, checked against the model: int64 on the CPU."""
    p = Path(path).expanduser()
    where = f"--routing {path}"
    if not p.is_file():
        raise BenchInputError(f"{where}: not 'uniform', 'skewed', or an existing .pt / .npy file")
    try:
        if p.suffix == ".npy":
            data = torch.from_numpy(np.load(p, allow_pickle=False))
        elif p.suffix in (".pt", ".pth"):
            data = torch.load(p, map_location="cpu", weights_only=True)
            if isinstance(data, dict) and "topk_ids" in data:
                data = data["topk_ids"]
        else:
            raise BenchInputError(f"{where}: expected a .pt or .npy file, got {p.suffix or 'no extension'}")
    except BenchInputError:
        raise
    except Exception as e:  # noqa: BLE001 - any load failure is bad input
        raise BenchInputError(f"{where}: cannot load it ({type(e).__name__}: {_one_line(e)})") from None
    if not isinstance(data, torch.Tensor):
        raise BenchInputError(f"{where}: holds a {type(data).__name__}, expected a tensor of topk_ids [tokens, top_k]")
    if data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool:
        raise BenchInputError(f"{where}: topk_ids must be integers, got dtype {data.dtype}")
    if data.dim() != 2 or data.shape[0] == 0:
        raise BenchInputError(f"{where}: topk_ids must be 2-D [tokens > 0, top_k], got shape {tuple(data.shape)}")
    E, K = spec.shape.num_experts, spec.shape.top_k
    if data.shape[1] != K:
        raise BenchInputError(f"{where}: has top-k {data.shape[1]} but {spec.name} routes each token to {K} experts")
    data = data.long()
    lo, hi = int(data.min()), int(data.max())
    if lo < 0 or hi >= E:
        raise BenchInputError(f"{where}: expert ids must lie in [0, {E}) for {spec.name}, found ids from {lo} to {hi}")
    # a token's top-k experts are distinct (a router picks each once): a repeated one would be
    # weighted twice by every backend and the reference alike, a routing no model runs
    ordered = data.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]).nonzero()
    if len(repeated):
        row, col = repeated[0].tolist()
        raise BenchInputError(f"{where}: row {row} (counting from 0) routes its token to expert "
                              f"{int(ordered[row, col])} more than once; a token's top-k experts must be distinct")
    return data


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||; ValueError where the shapes differ (broadcasting [1, H] against
    [M, H] would give a number for a wrong output)."""
    if out.shape != ref.shape:
        raise ValueError(f"output has shape {tuple(out.shape)}, expected {tuple(ref.shape)} (the reference's)")
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


# ------------------------------------------------------------------------------------ outputs


def prepare_out_dir(
    out: str | os.PathLike | None, prefix: str, *, results: Sequence[str] = (), overwrite: bool = False
) -> tuple[Path, bool]:
    """The output folder, created and proven writable now (before any work): (path, created).

    `results`: the names of the files this run writes there. An earlier run's are never replaced
    silently (nothing already written is lost): if any is present, this is bad input unless
    `overwrite`. Without `out`, a new timestamped folder under moekit-results/."""
    if out is None or str(out) == "":
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path("moekit-results") / f"{prefix}-{stamp}"
        suffix = 1
        while path.exists():  # two runs in one second: each gets a folder of its own
            suffix += 1
            path = Path("moekit-results") / f"{prefix}-{stamp}-{suffix}"
    else:
        path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise BenchInputError(f"--out {path}: exists and is not a folder")
    earlier = [name for name in results if (path / name).exists()]
    if earlier and not overwrite:
        raise BenchInputError(
            f"--out {path}: already holds the results of an earlier run ({', '.join(earlier)}); "
            "pass --overwrite to replace them, or give another --out"
        )
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchInputError(f"--out {path}: cannot create the folder ({e.strerror or _one_line(e)})") from None
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".moekit-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        if created:
            remove_if_empty([path])
        raise BenchInputError(f"--out {path}: folder is not writable ({e.strerror or _one_line(e)})") from None
    return path, created


def remove_if_empty(folders: Sequence[Path]) -> None:
    """Remove folders this run created, if nothing was written into them."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            pass


def write_atomically(out_dir: Path, writers: dict[str, Callable[[Path], None]]) -> list[Path]:
    """Write every file to a hidden temporary name first, then move them all into place. On any
    failure the temporaries are removed and nothing new appears under its final name."""
    tmps: dict[str, Path] = {}
    try:
        for name, writer in writers.items():
            tmp = out_dir / f".{name}.{os.getpid()}.tmp"
            tmps[name] = tmp
            writer(tmp)
        final = []
        for name, tmp in tmps.items():
            os.replace(tmp, out_dir / name)
            final.append(out_dir / name)
        return final
    finally:
        for tmp in tmps.values():
            if tmp.exists():
                tmp.unlink()


def json_safe(obj):
    """obj with every non-finite float (inf, nan) replaced by None: strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def git_commit() -> str:
    """HEAD of the git checkout holding the moekit package, with "-dirty" when tracked files under
    the package differ from it (then HEAD alone does not say what ran); else "unknown"."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None

    tracked = git("ls-files", "--error-unmatch", "__init__.py")  # moekit installed inside another project's
    if tracked is None or tracked.returncode != 0:                # tree (a .venv in it): not its commit
        return "unknown"
    head = git("rev-parse", "HEAD")
    commit = head.stdout.strip() if head is not None and head.returncode == 0 else ""
    if not commit:
        return "unknown"
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".")
    if status is not None and status.returncode == 0 and status.stdout.strip():
        commit += "-dirty"
    return commit


# environment variables that change what runs or how, recorded with every result
ENV_RECORDED = ("MOEKIT_BACKEND", "MOEKIT_FP8_ACCUMULATION", "MOEKIT_PDL", "MOEKIT_CONFIG_DIR", "TRITON_INTERPRET",
                "CUDA_VISIBLE_DEVICES")


def environment(device: torch.device, argv: Sequence[str] | None) -> dict:
    """Device, versions, commit, date and the command line that reproduces the run."""
    import moekit

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "none"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cap = torch.cuda.get_device_capability(device)
        capability = f"{cap[0]}.{cap[1]}"
    else:
        name = f"CPU ({platform.processor() or platform.machine() or 'unknown'})"
        capability = None
    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "device": name,
        "device_type": device.type,
        "capability": capability,
        "torch": torch.__version__,
        "triton": triton_version,
        "moekit": moekit.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(["moekit", *map(str, args)]),
        "env": {k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
    }


def require_plotting() -> None:
    from . import plots

    try:
        plots.require_matplotlib()
    except plots.PlotError as e:
        raise BenchInputError(f"{e}; or pass --no-plots") from None


# -------------------------------------------------------------------------------------- bench


@dataclasses.dataclass
class BenchOptions:
    models: list[str]
    tp: int = 1
    scheme: str | None = None
    batch_sizes: list[str] | None = None
    backends: list[str] | None = None
    baseline: str | None = None
    mode: str = "layer"
    routing: str = "uniform"
    check: bool = True
    out: str | None = None
    seed: int = 0
    dtype: str = "bf16"
    reps: int = DEFAULT_REPS
    warmup: int = DEFAULT_WARMUP
    routings: int = DEFAULT_ROUTINGS  # layer mode: routings each point's replays cycle through
    l2_flush: str = FLUSH_WITH[0]  # how the L2 is emptied before each replay (timing.FLUSH_WITH)
    model_estimate: bool = False
    plots: bool = True
    refresh_ceilings: bool = True  # the floor's ceilings measured in this run (False: an earlier run's)
    overwrite: bool = False  # replace an earlier run's results in `out`
    argv: list[str] | None = None


@dataclasses.dataclass
class BenchResult:
    out_dir: Path
    files: list[Path]
    columns: list[str]
    rows: list[dict]
    metadata: dict
    errors: int
    interrupted: bool = False  # Ctrl-C: `files` are the PARTIAL_FILES, with the rows measured before it


# What a complete run writes (bench.json last: its presence says the run completed), and what an
# interrupted one writes instead: names of their own, so that a partial file is never taken for
# a complete one.
RESULT_FILES = ("bench.csv", "latency.png", "efficiency.png", "bench.json")
PARTIAL_FILES = ("bench.partial.csv", "bench.partial.json")


@dataclasses.dataclass
class _Plan:
    problems: list[Problem]
    batch_sizes: list[int]
    backends: BackendPlan
    baseline: str
    dtype: torch.dtype
    device: torch.device
    routing_kind: str
    recorded: dict[str, torch.Tensor]
    out_dir: Path
    created: bool
    columns: list[str]


MAX_SEED = 2**31  # input_seed(seed, M) stays far inside a torch Generator's 64-bit seed


def check_environment() -> None:
    """ValueError (naming the variable) for an environment bench, check, tune and eval refuse
    before anything runs: a bad MOEKIT_FP8_ACCUMULATION or MOEKIT_PDL (else every triton point
    would fail on them, a table be built with a traceback, or eval load the whole model first)
    and a MOEKIT_BACKEND naming no backend (every auto row failed on it, after the whole run)."""
    from .backends.triton.launch import fp8_accumulation, pdl_wanted
    from .select import environment_backend

    fp8_accumulation()
    pdl_wanted()
    environment_backend()


def check_run_settings(seed) -> None:
    """BenchInputError for what bench, check and tune refuse before anything runs: the
    environment (check_environment) and a --seed out of range."""
    try:
        check_environment()
    except ValueError as e:
        raise BenchInputError(str(e)) from None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
        raise BenchInputError(f"--seed must be an integer in [0, {MAX_SEED}), got {seed!r}")


# how the timing text names each --l2-flush
_FLUSH_TEXT = {"zero": "zeroing", "read": "reading"}


def _validate(opts: BenchOptions, device: torch.device) -> _Plan:
    if opts.mode not in ("layer", "gemm"):
        raise BenchInputError(f"--mode: {opts.mode!r} is not 'layer' or 'gemm'")
    check_run_settings(opts.seed)
    if not isinstance(opts.reps, int) or opts.reps < 1:
        raise BenchInputError(f"--reps must be a positive integer, got {opts.reps!r}")
    if not isinstance(opts.warmup, int) or opts.warmup < 0:
        raise BenchInputError(f"--warmup must be a non-negative integer, got {opts.warmup!r}")
    if not isinstance(opts.routings, int) or opts.routings < 1:
        raise BenchInputError(f"--routings must be a positive integer, got {opts.routings!r}")
    if opts.l2_flush not in FLUSH_WITH:
        raise BenchInputError(f"--l2-flush: {opts.l2_flush!r} is not one of {', '.join(FLUSH_WITH)}")
    dtype = parse_dtype(opts.dtype)
    batch_sizes = parse_batch_sizes(opts.batch_sizes, DEFAULT_BATCH_SIZES if device.type == "cuda" else CPU_BATCH_SIZES)
    problems = resolve_problems(opts.models, opts.tp, opts.scheme, device)
    recorded: dict[str, torch.Tensor] = {}
    routing_kind = opts.routing
    if routing_kind not in ROUTINGS:
        for p in problems:
            recorded[p.name] = load_routing_file(routing_kind, p.spec)
        routing_kind = "file"
    requested = parse_names(opts.backends)
    baseline = choose_baseline(opts.baseline, problems, device, dtype, opts.mode, requested)
    plan = plan_backends(problems, requested, device, dtype, extra=(baseline,))
    check_forced_backend(plan, problems, batch_sizes, device, dtype)
    if opts.mode == "gemm":
        check_gemm_only(plan, problems, batch_sizes, device, dtype)
        if not _has_gemm_only(baseline):  # none runs them all, or only one the CPU interprets, not named
            interpreted = [n for n in INTERPRETED_ON_CPU if _has_gemm_only(n)] if device.type == "cpu" else []
            why = (f"; {', '.join(interpreted)} runs on the CPU only in the Triton interpreter, so it is the baseline "
                   f"only when named: add --backends {interpreted[0]} or --baseline {interpreted[0]}" if interpreted
                   else "; bench the models in separate runs, or use --mode layer")
            raise BenchInputError("--mode gemm: no backend with a GEMM-only mode can run every model here, to be "
                                  f"the baseline{why}")
    if opts.plots:
        require_plotting()
    columns = [*BASE_COLUMNS, f"speedup_vs_{baseline}", "rel_err"]
    if any("auto" in names for names in plan.per_problem.values()):
        columns.append(AUTO_COLUMN)
    if opts.model_estimate:
        columns.append("model_moe_us")
    columns += ["note", *PROVENANCE_COLUMNS]
    out_dir, created = prepare_out_dir(opts.out, "bench", results=RESULT_FILES + PARTIAL_FILES,
                                       overwrite=opts.overwrite)
    return _Plan(problems, batch_sizes, plan, baseline, dtype, device, routing_kind, recorded, out_dir, created, columns)


def _has_gemm_only(name: str) -> bool:
    return getattr(get_backend(name), GEMM_ONLY_HOOK, None) is not None


def check_forced_backend(plan: BackendPlan, problems, batch_sizes, device, dtype) -> None:
    """BenchInputError where MOEKIT_BACKEND sends auto's rows to a backend that cannot run one of
    them here (each such row failed with the reason, after the whole run of the others)."""
    for p in problems:
        if "auto" not in plan.per_problem[p.name]:
            continue
        for M in batch_sizes:
            try:
                select_backend(p.shape, p.scheme, device, dtype, M, "auto")
            except BackendUnavailableError as e:
                raise BenchInputError(f"auto's rows of {p.name} at M = {M}: {e} (unset {ENV_VAR}, or name "
                                      f"a backend that can run it)") from None


def check_gemm_only(plan: BackendPlan, problems, batch_sizes, device, dtype) -> None:
    """BenchInputError where --mode gemm would time nothing: no backend to run (auto by what it
    chooses at each batch size) has a GEMM-only mode. Such a run wrote a table of "n/a" rows and
    exited 0."""
    for p in problems:
        for name in plan.per_problem[p.name]:
            if name == "auto":
                try:
                    chosen = {select_backend(p.shape, p.scheme, device, dtype, M, "auto").backend for M in batch_sizes}
                except (BackendUnavailableError, ValueError):
                    return  # auto cannot choose here: its rows say why (check_forced_backend refused MOEKIT_BACKEND's)
            else:
                chosen = {name}
            if any(map(_has_gemm_only, chosen)):
                return
    with_mode = [n for n in backend_names() if _has_gemm_only(n)]
    ran = sorted({n for names in plan.per_problem.values() for n in names})
    raise BenchInputError(
        f"--mode gemm: none of the backends to run ({', '.join(ran)}) has a GEMM-only mode (those that do: "
        f"{', '.join(with_mode)}); name one that can run here in --backends, or use --mode layer"
    )


def _round(value: float | None, digits: int) -> float | None:
    """`value` with `digits` decimals, but never fewer than 4 significant digits (tiny CPU rates)."""
    if value is None or not math.isfinite(value):
        return None
    if value != 0 and abs(value) < 10 ** (3 - digits):
        return float(f"{value:.4g}")
    return round(value, digits)


def _layer_fn(p: Problem, name: str, mode: str, M: int, x, weights, tw, ids, device) -> tuple[dict, Callable | None]:
    """The row of one (model, backend, batch size) and the closure to time (None: nothing to time,
    the row says why)."""
    row: dict[str, Any] = {
        "model": p.name, "scheme": p.scheme.name, "backend": name, "chosen": name, "mode": mode, "batch_size": M,
    }
    try:
        if name == "auto":
            row["chosen"] = select_backend(p.shape, p.scheme, device, x.dtype, M, "auto").backend
        if mode == "layer":
            def fn():
                return fused_moe(x, weights, tw, ids, backend=name, apply_router_weight_on_input=p.apply_on_input)

            return row, fn
        hook = getattr(get_backend(row["chosen"]), GEMM_ONLY_HOOK, None)
        if hook is None:
            row["note"] = NO_GEMM_ONLY
            return row, None
        vtw, vids = validate_inputs(x, weights, tw, ids)
        return row, hook(x, weights, vtw, vids)
    except Exception as e:  # noqa: BLE001 - one failing point is reported, the run goes on
        return _failed(row, e), None


def _failed(row: dict, e: BaseException) -> dict:
    row["note"] = f"error: {type(e).__name__}: {_one_line(e)[:200]}"
    row["_error"] = True
    return row


def replay_counts(p: Problem, M: int, routing_ids: Sequence[torch.Tensor], reps: int, dtype: torch.dtype) -> list:
    """The roofline counts of each timed call of a closure, in order: call i runs routing
    i % len(routing_ids) (RoutingRotation cycles every closure through its routings from the
    first), so its bytes (the experts touched) are that routing's."""
    per_routing = [roofline.count(p.shape, p.scheme, M, ids, dtype) for ids in routing_ids]
    return [per_routing[i % len(per_routing)] for i in range(reps)]


def _finish_row(
    row: dict, timing: Timing, p: Problem, M: int, x, weights, tw, ids, opts: BenchOptions, ceilings, reference_out,
    counts: Sequence[roofline.Counts] | None = None,
) -> dict:
    """Fill a timed row: times, rates, floor and efficiency, and the accuracy check.

    `counts`: the roofline counts of each timed call (replay_counts; default: every call on
    `ids`). The time is the median over calls that cycle through several routings, which touch
    different numbers of experts (Mixtral-8x7B at M = 4: 5 to 7 of 8 experts, floors 20% apart),
    so the floor and the bytes are the medians over the same calls: a backend at one efficiency
    on every routing then shows that efficiency, whichever routing came first."""
    notes = []
    if opts.check and reference_out is not None:
        try:
            with torch.no_grad():
                out = fused_moe(x, weights, tw, ids, backend=row["backend"],
                                apply_router_weight_on_input=p.apply_on_input)
            err = rel_l2(out, reference_out(row["chosen"]))
        except Exception as e:  # noqa: BLE001
            return _failed(row, e)
        if math.isfinite(err):
            row["rel_err"] = float(f"{err:.4e}")
        else:  # a wrong output: its time stays in the row, the run reports an error (exit status 1)
            notes.append("error: output has NaN or inf values")
            row["_error"] = True
    if timing.note:
        notes.append(timing.note)
    if counts is None:
        counts = [roofline.count(p.shape, p.scheme, M, ids, x.dtype)]
    flops = counts[0].flops  # the same for every routing of a batch size
    nbytes = float(np.median([c.bytes for c in counts]))
    median = timing.median_us
    row.update(median_us=_round(median, 3), p20_us=_round(timing.p20_us, 3), p80_us=_round(timing.p80_us, 3))
    if not (math.isfinite(median) and median > 0):  # rates and efficiency left empty: say why
        notes.append(f"error: measured {median} µs, at or below the timer's resolution (flush time subtracted)")
        row["_error"] = True
    if median > 0:
        row["tflops"] = _round(flops / (median * 1e-6) / 1e12, 4)
        row["gbps"] = _round(nbytes / (median * 1e-6) / 1e9, 3)
    floors = [roofline.floor_us(c, ceilings, p.scheme) for c in counts]
    floor = None if ceilings is None else float(np.median(floors))
    if floor is not None:
        row["floor_us"] = _round(floor, 3)
        if median > 0:
            row["efficiency"] = _round(floor / median, 4)
    if opts.model_estimate:
        row["model_moe_us"] = _round(median * p.shape.num_layers, 2)
    if notes:
        row["note"] = "; ".join(notes)
    return row


def run_bench(opts: BenchOptions, console=None) -> BenchResult:
    """The whole `moekit bench` pipeline; BenchInputError for bad input (nothing written)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    device = default_device()
    plan = _validate(opts, device)
    try:
        return _run(opts, plan, console, Progress, (BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn))
    except BaseException:
        if plan.created:
            remove_if_empty([plan.out_dir])
        raise


def _run(opts: BenchOptions, plan: _Plan, console, Progress, cols) -> BenchResult:
    BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn = cols
    device, dtype = plan.device, plan.dtype
    if device.type != "cuda":
        console.print(cpu_banner(plan.batch_sizes), style="bold yellow", highlight=False)
    ceilings = roofline.get_ceilings(device, refresh=opts.refresh_ceilings)
    meta = environment(device, opts.argv)
    console.print(
        f"device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}, moekit {meta['moekit']}",
        highlight=False,
    )
    console.print(
        f"ceilings: {ceilings.describe()}" if ceilings else "ceilings: none on the CPU (floors and efficiencies left empty)",
        highlight=False,
    )
    for p in plan.problems:
        runs = ", ".join(plan.backends.per_problem[p.name]) or "none"
        console.print(f"{p.describe()}: backends {runs}; baseline {plan.baseline}", highlight=False)
        for name, reasons in plan.backends.skipped[p.name].items():
            console.print(f"  skipped {name}: {'; '.join(reasons)}", highlight=False)
    if plan.routing_kind == "file" and any(p.scaled for p in plan.problems):
        console.print("  recorded routing folded onto the scaled-down shape (id mod experts, a token's repeat moved "
                      "to the next expert it lacks)", highlight=False)
    for name, ids in plan.recorded.items():
        longer = [M for M in plan.batch_sizes if M > ids.shape[0]]
        if longer:  # inputs.recorded_routing tiles the file's rows: its tokens, repeated
            console.print(f"  {name}: the routing file has {ids.shape[0]} tokens; at M = {', '.join(map(str, longer))} "
                          "its rows are repeated to fill the batch", highlight=False)

    rows: list[dict] = []
    total = sum(len(plan.backends.per_problem[p.name]) for p in plan.problems) * len(plan.batch_sizes)
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    )
    # gemm mode aligns its routing before timing, and a recorded routing is the file's: one routing
    one_routing = opts.mode != "layer" or plan.routing_kind == "file"
    routings = 1 if one_routing else opts.routings
    # said only where --routings asked for more than that one routing (the default is not asking;
    # `--routings 1` in layer mode is the user's own choice, not one bench made for them)
    if one_routing and opts.routings not in (1, DEFAULT_ROUTINGS):
        why = "--mode gemm times one aligned routing" if opts.mode == "gemm" else "a routing file is its own rows"
        console.print(f"  --routings {opts.routings} has no effect here: {why}", highlight=False)
    if device.type != "cuda" and opts.l2_flush != FLUSH_WITH[0]:  # the default is not asked for: said in the metadata
        console.print(f"  --l2-flush {opts.l2_flush} has no effect on the CPU: nothing is flushed", highlight=False)
    interrupted, crash = False, None
    try:
        with progress:
            task = progress.add_task("bench", total=total)
            for pi, p in enumerate(plan.problems):
                names = plan.backends.per_problem[p.name]
                if not names:
                    continue
                weights = make_weights(p.shape, p.scheme, device, seed=opts.seed + 1000 * pi, dtype=dtype)
                for M in plan.batch_sizes:
                    seed = input_seed(opts.seed, M)
                    x = make_x(M, p.shape.hidden, device, seed=seed, dtype=dtype)
                    rotation = make_routings(plan.routing_kind, M, p.shape, routings, seed=seed,
                                             recorded=plan.recorded.get(p.name), device=device,
                                             renormalize=p.spec.routing.renormalize)
                    tw, ids = rotation.topk_weights, rotation.topk_ids
                    cache: dict[tuple, torch.Tensor] = {}

                    def reference_out(backend_name: str):
                        # the reference with the backend's documented rounding points (triton's 1x128
                        # groups for the token rule, cutlass's GEMM1 output in x's dtype), so rel_err
                        # measures errors, not design
                        from .check import gemm1_output_rounded, intermediate_granularity  # check imports bench

                        variant = (intermediate_granularity(backend_name, p.scheme),
                                   gemm1_output_rounded(backend_name, p.scheme))
                        if variant not in cache:
                            vtw, vids = validate_inputs(x, weights, tw, ids)
                            rx, vtw = p.backend_inputs(x, vtw)
                            cache[variant] = reference_moe(rx, weights, vtw, vids, intermediate_granularity=variant[0],
                                                           round_gemm1_output=variant[1])
                        return cache[variant]

                    # every backend at this M is timed in the same interleaved rounds (time_graphs)
                    progress.update(task, description=f"{p.name} M={M}: {', '.join(names)}")
                    prepared = [_layer_fn(p, name, opts.mode, M, x, weights, tw, ids, device) for name in names]
                    fns = {row["backend"]: fn for row, fn in prepared if fn is not None}
                    with torch.no_grad():
                        timings = time_graphs(fns, reps=opts.reps, warmup=opts.warmup, device=device,
                                              before_each=rotation if len(rotation) > 1 else None,
                                              flush_with=opts.l2_flush) if fns else {}
                    rotation.reset()  # the accuracy check uses the first routing
                    counts = replay_counts(p, M, [r[1] for r in rotation.routings], opts.reps, x.dtype)
                    for row, fn in prepared:
                        timing = timings.get(row["backend"])
                        if isinstance(timing, Exception):
                            row = _failed(row, timing)
                        elif timing is not None:
                            row = _finish_row(row, timing, p, M, x, weights, tw, ids, opts, ceilings, reference_out,
                                              counts)
                        rows.append(row)
                        progress.advance(task)
                    x = tw = ids = cache = None  # freed before the next size (reference_out names them)
                weights = None  # freed before the next model (reference_out names it)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    except KeyboardInterrupt:  # keep what was measured: written below under the partial names
        if not rows:
            raise
        interrupted = True
    except Exception as e:  # a failure that stops the run (a CUDA error poisons the context): the same,
        if not rows:  # then the error is raised on
            raise
        interrupted, crash = True, e

    _add_speedups(rows, plan.baseline)
    _add_auto_choice_cost(rows)
    for r in rows:
        r.update({k: meta[k] for k in PROVENANCE_COLUMNS})
    errors = sum(1 for r in rows if r.pop("_error", False))
    meta.update(
        tool="moekit bench",
        mode=opts.mode,
        routing=opts.routing if plan.routing_kind == "file" else plan.routing_kind,
        dtype=opts.dtype,
        seed=opts.seed,
        reps=opts.reps,
        warmup=opts.warmup,
        routings=routings,
        l2_flush=opts.l2_flush if device.type == "cuda" else None,
        baseline=plan.baseline,
        accuracy_check=opts.check,
        cpu_scaled_down=device.type != "cuda",
        batch_sizes=plan.batch_sizes,
        timing=(
            f"CUDA graph replays; L2 flushed by {_FLUSH_TEXT[opts.l2_flush]} a 512 MiB buffer before each, each flush's own "
            f"time subtracted; median of {opts.reps} after {opts.warmup} warm-up calls; the backends of one "
            f"batch size interleaved in {min(DEFAULT_ROUNDS, opts.reps)} rounds"
            + (f"; the replays cycle through {routings} routings of each batch size" if routings > 1 else "")
            if device.type == "cuda"
            else f"CPU wall clock (time.perf_counter) around each call; median of {opts.reps} after {opts.warmup} warm-up "
            "calls; no L2 flush (--l2-flush has no effect on the CPU)"
        ),
        ceilings=dataclasses.asdict(ceilings) if ceilings else None,
        models=[p.to_json() for p in plan.problems],
        skipped_backends=plan.backends.skipped,
        complete=not interrupted,
        points_planned=total,
    )
    files, removed = _write(plan, rows, meta, opts, partial=interrupted)
    print_table(console, rows, plan.columns, opts.model_estimate)
    for line in auto_summary(rows):
        console.print(line, highlight=False)
    if interrupted:
        why = f"stopped by {type(crash).__name__}: {crash}" if crash is not None else "interrupted"
        console.print(f"{why}: {len(rows)} of {total} points measured; wrote them to "
                      f"{', '.join(str(f) for f in files)} (partial: no plots)", highlight=False, soft_wrap=True,
                      markup=False)  # paths and messages are the user's text, not rich markup
    else:
        console.print(f"wrote {', '.join(str(f) for f in files)}", highlight=False, markup=False)
    if removed:  # --overwrite: an earlier run's files this run did not write again
        console.print(f"removed the earlier run's {', '.join(str(f) for f in removed)}", highlight=False, markup=False)
    if crash is not None:
        raise crash
    return BenchResult(plan.out_dir, files, plan.columns, rows, meta, errors, interrupted)


def _add_speedups(rows: list[dict], baseline: str) -> None:
    key = f"speedup_vs_{baseline}"
    base = {
        (r["model"], r["batch_size"]): r.get("median_us")
        for r in rows
        if r["backend"] == baseline and r.get("median_us")
    }
    for r in rows:
        b = base.get((r["model"], r["batch_size"]))
        if b and r.get("median_us"):
            r[key] = round(b / r["median_us"], 4)


def _add_auto_choice_cost(rows: list[dict]) -> None:
    """AUTO_COLUMN on each auto row whose chosen backend was timed beside it."""
    for r in rows:
        if r["backend"] != "auto":
            continue
        same = {o["backend"]: o.get("median_us") for o in rows
                if (o["model"], o["batch_size"]) == (r["model"], r["batch_size"]) and o["backend"] != "auto"}
        timed = [us for us in same.values() if us]
        if same.get(r["chosen"]) and timed:
            r[AUTO_COLUMN] = round(same[r["chosen"]] / min(timed) - 1, 4)


def auto_summary(rows: list[dict]) -> list[str]:
    """One line per model: how often auto chose the fastest timed backend, and its worst choice."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        scored = [r for r in rows if r["model"] == model and r.get(AUTO_COLUMN) is not None]
        if not scored:
            continue
        fastest = sum(1 for r in scored if r[AUTO_COLUMN] <= 0)
        worst = max(scored, key=lambda r: r[AUTO_COLUMN])
        line = f"auto on {model}: chose the fastest backend at {fastest} of {len(scored)} batch sizes"
        if worst[AUTO_COLUMN] > 0:
            line += f"; worst choice {worst['chosen']} at M={worst['batch_size']}, {100 * worst[AUTO_COLUMN]:+.1f}%"
        forced = env.get(ENV_VAR)
        if forced:  # the rows named auto ran the environment's backend: not auto's choice to credit
            line += f" (but {ENV_VAR}={forced} chose for auto, not its tables)"
        lines.append(line)
    return lines


def _write(plan: _Plan, rows: list[dict], meta: dict, opts: BenchOptions,
           partial: bool = False) -> tuple[list[Path], list[Path]]:
    """(the files written, an earlier run's files removed: remove_superseded)."""
    from . import plots

    columns = plan.columns
    units = {c: UNITS.get("speedup" if c.startswith("speedup_vs_") else c) for c in columns}
    units = {c: u for c, u in units.items() if u}
    if meta["device_type"] != "cuda":  # UNITS describes the GPU's harness (metadata.timing: the CPU's)
        units["median_us"] = CPU_MEDIAN_UNIT

    def write_csv(path: Path):
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            w.writeheader()
            for r in rows:
                w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in columns})

    def write_json(path: Path):
        doc = {"metadata": meta, "columns": columns, "units": units, "rows": [{c: r.get(c) for c in columns} for r in rows]}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(json_safe(doc), f, indent=2, ensure_ascii=False, allow_nan=False)
            f.write("\n")

    what = "expert GEMMs only" if opts.mode == "gemm" else "whole layer, routing excluded"
    title = f"moekit bench: {what}, {plan.routing_kind} routing\n{meta['device']}"
    if meta["cpu_scaled_down"]:
        title += " (scaled-down CPU shape)"
    if partial:
        writers = dict(zip(PARTIAL_FILES, (write_csv, write_json)))
    else:
        writers = {"bench.csv": write_csv}
        if opts.plots:
            writers["latency.png"] = lambda path: plots.latency_plot(rows, path, title=title)
            writers["efficiency.png"] = lambda path: plots.efficiency_plot(
                rows, path, title=title, has_ceilings=meta["ceilings"] is not None
            )
        writers["bench.json"] = write_json  # last: its presence says the run completed
    files = write_atomically(plan.out_dir, writers)
    return files, remove_superseded(plan.out_dir, RESULT_FILES + PARTIAL_FILES, writers)


def remove_superseded(out_dir: Path, names: Sequence[str], written) -> list[Path]:
    """An earlier run's result files this run did not rewrite (it was given --overwrite): its
    plots beside a run with --no-plots, its complete bench.json beside this run's partial
    files, its partial files beside this complete run. Left there they would describe another
    run than the files beside them. Returns those removed."""
    removed = []
    for name in names:
        path = out_dir / name
        if name not in written and path.exists():
            path.unlink()
            removed.append(path)
    return removed


def _fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    return format(value, spec)


def print_wide(console, renderable) -> None:
    """Print at the terminal's width; into a pipe or file (logs, CI), wide enough not to squeeze."""
    if console.is_terminal or console.width >= 160:
        console.print(renderable)
        return
    from rich.console import Console

    Console(file=console.file, width=160, no_color=console.no_color).print(renderable)


def format_us(value) -> str:
    """A time in µs with 3-4 significant digits."""
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _sig(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def print_table(console, rows: list[dict], columns: list[str], model_estimate: bool) -> None:
    """One rich table per model."""
    from rich import box
    from rich.table import Table

    speedup = next(c for c in columns if c.startswith("speedup_vs_"))
    heads = ["M", "backend", "median µs", "p20-p80", "TFLOP/s", "GB/s", "floor µs", "eff",
             "x " + speedup.removeprefix("speedup_vs_"), "rel err"]
    if model_estimate:
        heads.append("model MoE ms")
    for model in dict.fromkeys(r["model"] for r in rows):
        model_rows = [r for r in rows if r["model"] == model]
        table = Table(
            title=escape(f"{model} ({model_rows[0]['scheme']}, {model_rows[0]['mode']})"), box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True
        )
        for h in heads:
            table.add_column(h, justify="left" if h == "backend" else "right")
        for r in model_rows:
            backend = r["backend"] + (f">{r['chosen']}" if r["backend"] == "auto" else "")
            if r.get("median_us") is None:
                table.add_row(str(r["batch_size"]), backend, r.get("note") or "-", *["-"] * (len(heads) - 3))
                continue
            cells = [
                str(r["batch_size"]), backend, format_us(r["median_us"]),
                f"{format_us(r['p20_us'])}-{format_us(r['p80_us'])}",
                _sig(r.get("tflops")), _sig(r.get("gbps")),
                format_us(r.get("floor_us")), _fmt(r.get("efficiency"), ".2f"), _fmt(r.get(speedup), ".2f"),
                _fmt(r.get("rel_err"), ".1e"),
            ]
            if model_estimate:
                cells.append(_fmt(None if r.get("model_moe_us") is None else r["model_moe_us"] / 1e3, ".2f"))
            table.add_row(*cells)
        print_wide(console, table)
    notes = {r["note"] for r in rows if r.get("note") and r.get("median_us") is not None}
    for note in sorted(notes):
        console.print(f"note: {note}", highlight=False)


__all__ = [
    "BenchInputError", "BenchOptions", "BenchResult", "GemmOnly", "run_bench", "load_routing_file", "cpu_shape",
    "resolve_problems",
]
