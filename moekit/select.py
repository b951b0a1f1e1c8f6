"""Which backend runs a call: the `backend` argument, then MOEKIT_BACKEND, then auto.

A backend asked for by name (argument or environment) that cannot run raises
`BackendUnavailableError` with every reason; only `auto` chooses among backends:

  1. the backend decision table of (device, shape, scheme), if one loads (`moekit.decisions`:
     the user's MOEKIT_CONFIG_DIR before the shipped tables): the winner at M, measured there or
     interpolated between the two measured sizes around it (the end point below the smallest /
     above the largest); if the winner cannot run here, the fastest backend there that can;
  2. otherwise `HEURISTIC_RULES`: the first backend of a preference list that can run.
Auto never picks a backend whose supports() refuses. With `allow_weight_copies=False` (what
`moekit.MoELayer` passes) it also passes over backends that would keep a converted copy of the
weights (`Backend.copies_weights`): the `torch` backend on FP8 schemes, and for float32 activations.

Cost per call: everything that does not depend on M (refusals, the table file, the device name)
is resolved once per (shape, scheme, device, dtype, MOEKIT_CONFIG_DIR, TRITON_INTERPRET) and each
batch size's choice is then memoised, so a call is a few dictionary look-ups (no file IO, no JSON,
no GPU synchronisation). Tables written later in the same process are seen after `clear_cache()`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
import re
from pathlib import Path
from typing import Literal

import torch

from . import decisions, env, tables
from .accumulation import FP8_ACCUMULATION_ENV, fp8_accumulation, table_accumulation
from .backends.base import assume_capability, backend_names, check_shape, get_backend
from .dtypes import as_torch_dtype, check_fused_moe_dtype
from .routing import check_flag
from .spec import MoEShape, QuantScheme, get_scheme

ENV_VAR = "MOEKIT_BACKEND"
log = logging.getLogger("moekit.select")

# ===================================================================================== HEURISTIC
# What auto does without a decision table for (device, shape, scheme). Per device type, rules
# (max rows per expert, preference order): rows per expert = M * top_k / E; the first rule whose
# bound holds (None: no bound) applies, and auto takes the first backend of its order that can
# run (and, in a MoELayer, keeps no copy of the weights). A device type not listed here: reference.
#
# A rule may carry a third element, the smallest intermediate size per GPU (N) it applies to, and
# a fourth, the FP8 accumulation mode it applies to (accumulation.table_accumulation; None: any).
#
# Evidence (H200, torch 2.11, triton 3.6, 2026-12-03, `moekit bench` whole layer, BENCHMARKS.md):
# triton (analytic default configs) was the fastest backend at every batch size 1..8192 on
# GLM-4.5V-FP8 TP2 (E=128, N=704: 1.3x-3.2x faster than cutlass) and DeepSeek-V3 TP8 (block
# weights: cutlass cannot run; 1.1x-2.2x faster than torch), and on Mixtral-8x7B FP8 (E=8,
# N=14336) up to M=512 (128 rows per expert: 754 vs 783 µs). From M=1024 on Mixtral (256+ rows per
# expert of a 14336-wide expert) CUTLASS's grouped GEMM won: 1126 vs 1265 µs at 1024, 3124 vs 3992
# at 4096, 6593 vs 7586 at 8192. Hence: few, wide experts with many rows each -> cutlass first.
# In fast accumulation mode (MOEKIT_FP8_ACCUMULATION=fast) triton won there too, untuned (H100,
# 2026-12-05, twenty-fourth session: Mixtral 1109 vs 1139 µs at 1024, 2762 vs 3555 at 4096, 5460
# vs 6888 at 8192; H200 2815 vs 3700 at 4096), so the cutlass rule is for precise mode only.
# Shapes with a decision table (shipped or tuned) never reach these rules.
HEURISTIC_RULES: dict[str, tuple[tuple, ...]] = {
    "cuda": (
        (255, ("triton", "cutlass", "torch", "reference")),
        (None, ("cutlass", "triton", "torch", "reference"), 4096, "precise"),
        (None, ("triton", "cutlass", "torch", "reference")),
    ),
    "cpu": ((None, ("torch", "reference")),),
}
# ===============================================================================================

# GPU models whose compute capability moekit knows, for devices described by name (--device-name).
KNOWN_CAPABILITIES: dict[str, tuple[int, int]] = {
    "H100": (9, 0), "H200": (9, 0), "H20": (9, 0), "H800": (9, 0), "GH200": (9, 0),
    "A100": (8, 0),
    "L40S": (8, 9), "L4": (8, 9),
}
COPY_REASON = "keeps a converted copy of the weights (a MoELayer's auto avoids it; name it to use it)"
_PER_M_LIMIT = 1 << 14  # memoised batch sizes per problem; beyond, choices are computed each call


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """A CUDA GPU described rather than present: its name (as torch.cuda.get_device_name says it)
    and compute capability. select_backend answers for it as if it were here."""

    name: str
    capability: tuple[int, int]
    type = "cuda"  # like torch.device.type (a class attribute, not a field)

    @classmethod
    def from_name(cls, name: str) -> "DeviceSpec":
        """'NVIDIA H100 80GB HBM3' -> capability (9, 0), by the GPU model in the name."""
        for token in re.split(r"[\s_\-]+", str(name).strip().upper()):
            if token in KNOWN_CAPABILITIES:
                return cls(str(name).strip(), KNOWN_CAPABILITIES[token])
        raise ValueError(
            f"unknown GPU {name!r}: moekit knows the compute capability of "
            f"{', '.join(KNOWN_CAPABILITIES)} (give the name as torch reports it, e.g. 'NVIDIA H100 80GB HBM3')"
        )

    def __str__(self) -> str:
        return f"{self.name} (compute capability {self.capability[0]}.{self.capability[1]}, described)"


class BackendUnavailableError(RuntimeError):
    """A backend asked for by name cannot run this problem."""

    def __init__(self, name: str, source: str, reasons: list[str], runnable: list[str]):
        # source: "argument", or f"{ENV_VAR}={name}". One line: the commands print it as their
        # one-line error (moekit bench's, for a MOEKIT_BACKEND that cannot run its auto rows).
        self.name, self.source, self.reasons, self.runnable = name, source, reasons, runnable
        super().__init__(
            f"backend {name!r} (from {source}) cannot run this problem: {'; '.join(reasons)}; "
            f"backends that can: {', '.join(runnable) or 'none'}"
        )


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend chosen for a call and why."""

    backend: str
    source: Literal["argument", "environment", "table", "heuristic"]
    detail: str
    refused: dict[str, list[str]]  # backend -> reasons it cannot run (only backends that cannot)
    avoided: dict[str, str] = dataclasses.field(default_factory=dict)  # runnable, but auto passed it over

    def __str__(self) -> str:
        return f"{self.backend} ({self.source}: {self.detail})"


# One cache for everything static: supports() answers and the per-problem resolvers. Tests that
# change the registry replace it (conftest's `registry` fixture); `clear_cache()` empties it.
_supports_cache: dict[tuple, object] = {}


def clear_cache() -> None:
    """Forget every cached refusal, table and choice (after writing tables in this process),
    the triton backend's tuned configs included (moekit.tables.clear_cache)."""
    _supports_cache.clear()
    tables.clear_cache()


def _device_key(device) -> torch.device | DeviceSpec:
    if isinstance(device, (torch.device, DeviceSpec)):
        return device
    return torch.device(device)


def refusals(
    shape: MoEShape, scheme: QuantScheme, device: torch.device | DeviceSpec | str, dtype: torch.dtype
) -> dict[str, list[str]]:
    """Every registered backend's reasons not to run (empty list: it can). Cached: it is static.
    A `DeviceSpec` is answered as a CUDA device of its capability, present or not; `dtype` may
    be its name (moekit.dtypes.as_torch_dtype). ValueError for a dtype fused_moe refuses (float64,
    int8): answered `reference` before, for an x that fused_moe then refused."""
    device = _device_key(device)
    dtype = as_torch_dtype(dtype)
    check_fused_moe_dtype(dtype)
    key = (shape, scheme, device, dtype, env.raw("TRITON_INTERPRET"))
    result = {}
    for name in backend_names():
        k = (name, *key)
        if k not in _supports_cache:
            backend = get_backend(name)
            if isinstance(device, DeviceSpec):
                with assume_capability(device.capability):
                    _supports_cache[k] = backend.supports(shape, scheme, torch.device("cuda"), dtype)
            else:
                _supports_cache[k] = backend.supports(shape, scheme, device, dtype)
        result[name] = _supports_cache[k]
    return result


def device_name(device: torch.device | DeviceSpec) -> str | None:
    """The name decision tables are filed under: the GPU's name, 'cpu', or None (no tables)."""
    if isinstance(device, DeviceSpec):
        return device.name
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            return torch.cuda.get_device_name(index)
        except Exception:  # noqa: BLE001 - no CUDA here: no table
            return None
    return None


def _check_num_tokens(num_tokens) -> None:
    """num_tokens (M) is a count: a negative one was answered as if it were 1."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an integer >= 0 (the batch size M), got {num_tokens!r}")


def _environment() -> tuple:
    """(MOEKIT_BACKEND, MOEKIT_CONFIG_DIR, TRITON_INTERPRET, MOEKIT_FP8_ACCUMULATION) as
    cheap-to-compare values (moekit.env.raw; the last picks the decision tables, moekit.tables)."""
    return (env.raw(ENV_VAR), env.raw(tables.CONFIG_DIR_ENV), env.raw("TRITON_INTERPRET"),
            env.raw(FP8_ACCUMULATION_ENV))


def select_backend(
    shape: MoEShape,
    scheme: QuantScheme,
    device: torch.device | DeviceSpec | str,
    dtype: torch.dtype = torch.bfloat16,
    num_tokens: int = 1,
    backend: str | None = "auto",
    *,
    allow_weight_copies: bool = True,
) -> Choice:
    """The backend that `fused_moe` would run for this problem, and where that choice came from.

    `device` may be a `DeviceSpec` (a GPU described by name and capability, not present).
    `allow_weight_copies=False`: auto passes over backends that would keep a converted copy of
    the weights (a backend named by argument or MOEKIT_BACKEND is still used). `scheme` may be
    a scheme's name, and `dtype` a torch.dtype or its name ("bf16", "bfloat16", as the commands
    take it), as everywhere else. ValueError for a num_tokens that is no integer >= 0, and for a
    dtype that fused_moe refuses (dtypes.FUSED_MOE_DTYPES; checked where the problem is first
    resolved, refusals). TypeError for a shape that is no MoEShape."""
    if type(shape) is not MoEShape:  # one comparison for the common call; check_shape takes a subclass
        check_shape(shape)
    if type(allow_weight_copies) is not bool:  # "no" was taken as True (routing.check_flag)
        allow_weight_copies = check_flag("allow_weight_copies", allow_weight_copies)
    if not isinstance(scheme, QuantScheme):
        scheme = get_scheme(scheme)
    if not isinstance(dtype, torch.dtype):
        dtype = as_torch_dtype(dtype)
    if type(num_tokens) is not int or num_tokens < 0:  # a bool, a NumPy integer: checked by name
        _check_num_tokens(num_tokens)
    env_backend, config_dir, interpret, accumulation = _environment()
    if not isinstance(device, (torch.device, DeviceSpec)):
        device = torch.device(device)
    key = ("auto", shape, scheme, device, dtype, allow_weight_copies, config_dir, interpret, accumulation,
           tables.SHIPPED_ROOT)
    resolver = _supports_cache.get(key)
    if resolver is None:
        resolver = _resolver(shape, scheme, device, dtype, allow_weight_copies)

    if backend is None or backend == "auto":
        env_backend = _env_backend(env_backend)
        if env_backend is None:
            choice = resolver.auto(num_tokens)
        else:
            choice = resolver.named(env_backend, "environment")
    else:
        choice = resolver.named(backend, "argument")
    if log.isEnabledFor(logging.DEBUG):
        log.debug("moekit: M=%d %s %s -> %s", num_tokens, shape.describe(), scheme.name, choice)
    return choice


@functools.lru_cache(maxsize=16)
def _env_backend(raw_value) -> str | None:
    """MOEKIT_BACKEND (its env.raw value) as a backend name, stripped as MOEKIT_PDL and
    MOEKIT_FP8_ACCUMULATION are; unset, empty or "auto": None (auto decides). Parsed once per value."""
    value = (env.value(raw_value) or "").strip()
    return None if value in ("", "auto") else value


def environment_backend() -> str | None:
    """The backend MOEKIT_BACKEND names (None: unset, empty or "auto"); a ValueError naming the
    variable where it names no backend: for the commands, which refuse it before they run."""
    name = _env_backend(env.raw(ENV_VAR))
    if name is not None:
        _check_name(name, "environment")
    return name


def _check_name(name: str, source: str) -> None:
    """get_backend's ValueError for a name that is no backend, saying MOEKIT_BACKEND where the
    name came from there (source "environment"; "argument": as get_backend says it)."""
    try:
        get_backend(name)
    except ValueError as e:
        if source == "argument":
            raise
        raise ValueError(f"{ENV_VAR}={name!r}: {e}") from None


def _resolver(shape, scheme, device, dtype, allow_weight_copies) -> "_Resolver":
    """The cached resolver of a problem (select_backend inlines the look-up)."""
    _, config_dir, interpret, accumulation = _environment()
    device = _device_key(device)
    key = ("auto", shape, scheme, device, dtype, allow_weight_copies, config_dir, interpret, accumulation,
           tables.SHIPPED_ROOT)
    resolver = _supports_cache.get(key)
    if resolver is None:
        resolver = _supports_cache[key] = _Resolver(shape, scheme, device, dtype, allow_weight_copies)
    return resolver


def explain(
    shape: MoEShape,
    scheme: QuantScheme,
    device: torch.device | DeviceSpec | str,
    dtype: torch.dtype = torch.bfloat16,
    num_tokens: int = 1,
    backend: str | None = "auto",
) -> list[str]:
    """What `moekit select` prints: the choice for fused_moe (and for a MoELayer where it differs),
    where it came from, the decision table's times at the measured sizes used, every refusal.
    Raises ValueError (unknown backend) or BackendUnavailableError like select_backend."""
    device = _device_key(device)
    dtype = as_torch_dtype(dtype)
    choice = select_backend(shape, scheme, device, dtype, num_tokens, backend)
    r = _resolver(shape, scheme, device, dtype, True)
    lines = [f"backend: {choice.backend}"]
    if choice.source == "table":
        loc = r.table.locate(num_tokens)
        where = loc.describe()
        lines += [f"from: decision table {r.table.path}", f"  {where}"]
        # the files of the sizes used: a table found after it (layered beyond the range it measured),
        # or the precise table a fast-mode one refines
        used = r.table.files(loc.neighbours())
        later = [f for f in used if f != r.table.path and f.name != r.table.meta.get("refines")]
        if later:
            lines.append(f"  sizes measured in {', '.join(map(str, later))}: a table found after it answers beyond "
                         "the range it measured")
        names = dict.fromkeys(f.name for f in used)
        borrowed = [name for name in names if tables.is_borrowed(Path(name), device_name(device) or "")]
        if borrowed:
            lines.append(f"  ({' and '.join(borrowed)}: measured on another GPU model of its sharing group; "
                         "`moekit tune` here writes this GPU's own)")
        rest = choice.detail.split(where, 1)[-1].lstrip("; ")
        if rest:
            lines.append(f"  {rest}")
        # tables are filed without the activation dtype, so one measured with bf16 also answers
        # for fp16: say so rather than pass its times off as this dtype's
        measured = r.table.meta.get("dtype")
        asked = str(dtype).removeprefix("torch.")
        if measured and measured != asked:
            lines.append(f"  measured with {measured} activations, not {asked}: a table answers for every activation dtype")
    else:
        lines.append(f"from: {choice.source} ({choice.detail})")
    for path, problem in r.skipped:
        lines.append(f"skipped table {path}: {problem}")
    if r.table is None:
        name = device_name(device)
        if name is None:
            lines.append(f"no decision table: tables exist per named device, not for {device}")
        else:
            dirs = ", ".join(str(d) for d in tables.search_dirs("backends"))
            names = dict.fromkeys([tables.table_name(shape, scheme, name),
                                   tables.table_name(shape, scheme, name, table_accumulation(scheme))])
            lines.append(f"no decision table {' or '.join(names)} in {dirs}")
    else:
        loc = r.table.locate(num_tokens)
        points = loc.neighbours()
        if loc.how == "between":
            points = [*points, loc.point]
        used = r.table.files(loc.neighbours())
        if used == [r.table.path]:
            over = f", over {r.table.meta['refines']} where it measured nothing" if "refines" in r.table.meta else ""
            lines.append(f"measured (us) in {r.table.path.name}{over}:")
        elif len(used) == 1:
            lines.append(f"measured (us) in {used[0].name}:")
        else:
            lines.append("measured (us) in " + " and ".join(
                f"{f.name} (M={', '.join(str(p.m) for p in loc.neighbours() if r.table.source(p.m) == f)})"
                for f in used) + ":")
        header = ["backend"] + [
            f"M={p.m}" + (" (interpolated, used)" if loc.how == "between" else " (used)") * (p is loc.point)
            for p in points
        ]
        rows = [header]
        names = list(dict.fromkeys(n for p in points for n in [*p.fastest(), *p.errors]))
        for n in names:
            cells = [n]
            for p in points:
                if n in p.us:
                    cells.append(f"{p.us[n]:.4g}" + (" winner" if n == p.winner else ""))
                else:
                    cells.append(f"failed: {p.errors[n]}" if n in p.errors else "-")
            rows.append(cells)
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    if r.refused:
        lines.append("refused:")
        lines += [f"  {n}: {'; '.join(reasons)}" for n, reasons in r.refused.items()]
    else:
        lines.append("refused: none")
    if choice.source in ("table", "heuristic"):
        layer = select_backend(shape, scheme, device, dtype, num_tokens, backend, allow_weight_copies=False)
        if layer.backend != choice.backend:
            passed = ", ".join(layer.avoided)
            lines.append(f"a MoELayer (auto) runs {layer.backend} instead: {passed} {COPY_REASON}")
    return lines


class _Resolver:
    """Everything about one problem that does not depend on M, and the memoised choice per M."""

    def __init__(self, shape, scheme, device, dtype, allow_weight_copies):
        # A bad MOEKIT_FP8_ACCUMULATION is refused (ValueError naming it) whatever the backend,
        # not only by the triton kernels: it also picks the decision tables. Not cached: a
        # resolver exists only for a valid value (it is part of the resolver's key).
        fp8_accumulation()
        self.shape, self.scheme, self.device = shape, scheme, device
        reasons = refusals(shape, scheme, device, dtype)
        self.refused = {name: r for name, r in reasons.items() if r}
        self.runnable = [name for name, r in reasons.items() if not r]
        self.avoided = {}
        if not allow_weight_copies:
            self.avoided = {n: COPY_REASON for n in self.runnable if get_backend(n).copies_weights(scheme, dtype)}
        self.eligible = [n for n in self.runnable if n not in self.avoided]
        self.skipped: list = []  # (path, problem) of tables that did not load
        name = device_name(device)
        self.table = decisions.find_table(shape, scheme, name, self.skipped) if name else None
        self._per_m: dict[int, Choice] = {}
        self._named: dict[tuple[str, str], Choice] = {}

    # ----------------------------------------------------------------------- named backends
    def named(self, name: str, source: str) -> Choice:
        choice = self._named.get((name, source))
        if choice is None:
            _check_name(name, source)  # unknown names raise, listing the valid ones
            detail = "backend argument" if source == "argument" else f"{ENV_VAR}={name}"
            if self.refused.get(name):
                where = "argument" if source == "argument" else f"{ENV_VAR}={name}"
                raise BackendUnavailableError(name, where, self.refused[name], self.runnable)
            choice = self._named[(name, source)] = Choice(name, source, detail, self.refused, self.avoided)
        return choice

    # --------------------------------------------------------------------------------- auto
    def auto(self, m: int) -> Choice:
        choice = self._per_m.get(m)
        if choice is None:
            choice = self.decide(m)
            if len(self._per_m) < _PER_M_LIMIT:
                self._per_m[m] = choice
        return choice

    def why_not(self, name: str) -> str:
        if name in self.refused:
            return "; ".join(self.refused[name])
        if name in self.avoided:
            return self.avoided[name]
        return "not a backend of this moekit"

    def decide(self, m: int) -> Choice:
        note = ""
        if self.table is not None:
            loc = self.table.locate(m)
            files = self.table.files(loc.neighbours())  # where its sizes were measured
            point, where = loc.point, f"{', '.join(map(str, files))}: {loc.describe()}"
            if point.winner in self.eligible:
                return Choice(point.winner, "table", where, self.refused, self.avoided)
            passed = [f"winner {point.winner} cannot be used ({self.why_not(point.winner)})"]
            for name in point.fastest():
                if name in self.eligible:
                    there = "interpolated" if loc.how == "between" else "measured"
                    detail = "; ".join([where, *passed, f"fastest usable {there} there: {name} ({point.us[name]:.4g} us)"])
                    return Choice(name, "table", detail, self.refused, self.avoided)
                if name != point.winner:
                    passed.append(f"{name} cannot be used ({self.why_not(name)})")
            note = f"table {self.table.path} measured no usable backend at M={point.m}; "
        return self.heuristic(m, note)

    def heuristic(self, m: int, note: str = "") -> Choice:
        rules = HEURISTIC_RULES.get(self.device.type, ((None, ("reference",)),))
        rows = m * self.shape.top_k / self.shape.num_experts
        accumulation = table_accumulation(self.scheme)
        bound, order, min_n, mode = None, rules[-1][1], 0, None
        for bound, order, *rest in rules:
            min_n, mode = (list(rest) + [0, None])[:2]
            if (bound is None or rows <= bound) and self.shape.n >= min_n and mode in (None, accumulation):
                break
        rule = "" if bound is None else f" (rows per expert {rows:g} <= {bound:g})"
        if min_n:
            rule += f" (rows per expert {rows:g}, intermediate {self.shape.n} >= {min_n})"
        if mode:
            rule += f" ({mode} FP8 accumulation)"
        passed = [n for n in order if n in self.avoided]
        passed_note = f"; passed over {', '.join(passed)}: {COPY_REASON}" if passed else ""
        for name in order:
            if name in self.eligible:
                detail = f"{note}first usable of {', '.join(order)} on {self.device.type}{rule}{passed_note}"
                return Choice(name, "heuristic", detail, self.refused, self.avoided)
        return Choice("reference", "heuristic", f"{note}no faster backend can run this problem", self.refused, self.avoided)
