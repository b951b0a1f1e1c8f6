"""Backend decision tables: every backend's measured time per batch size, and the winner.

`moekit tune` writes one JSON file per (device, shape, scheme), named by `moekit.tables.table_name`
and found by `moekit.tables.find_tables("backends", ...)` (the user's MOEKIT_CONFIG_DIR folders
before the shipped moekit/configs/backends/, an exact device name before another name of the same
GPU model; the tables found are layered, each answering within the range of sizes it measured
where none before it does; in fast accumulation mode a fast-mode table refines the precise one,
see moekit.tables). The format (version 1):

    {"format": "moekit-backend-table", "version": 1,
     "meta": {"device_name": "...", "num_experts": E, "hidden": H, "intermediate": N_per_gpu,
              "top_k": K, "scheme": "...", "dtype": "bfloat16", "routing": "uniform",
              "mode": "layer", "moekit": "...", "torch": "...", "triton": "...", "date": "..."},
     "batch_sizes": {"<M>": {"us": {"<backend>": <us>, ...}, "winner": "<backend>",
                             "errors": {"<backend>": "<reason>"}}, ...}}

A batch size M between two measured sizes a < b gets each backend's time interpolated linearly in M
between its times at a and b (backends measured at both), and the fastest of those wins; below the
smallest or above the largest measured size, the end point. Why not simply the winner of the
nearest size: the margins matter. On an H200, Mixtral-8x7B FP8 (BENCHMARKS.md, 2026-12-03) had
cutlass 11% ahead at 728 and triton 5% ahead at 1024; at 896, nearer 1024, cutlass was 11% faster,
which the interpolation picks and the nearest-size rule did not (replayed on every measured point:
never worse, one miss fewer). What runs at that size is `moekit.select`'s business: the winner if
it can run here, else the fastest backend measured (or interpolated) there that can.

A table that does not load or does not validate is skipped with ONE `BackendTableWarning` per file
(naming the file and the problem); the caller falls back to the next table or the heuristic. A
folder that cannot be listed is skipped by moekit.tables.find_tables, with a warning of its own:
the other folders' tables, the shipped ones included, are still read.
Nothing here raises into a forward pass: `find_table` catches every error.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Literal

from . import tables
from .accumulation import table_accumulation
from .spec import MoEShape, QuantScheme

FORMAT = "moekit-backend-table"
VERSION = 1


class BackendTableWarning(UserWarning):
    """A backend decision table was skipped (it did not load or did not validate)."""


class TableError(ValueError):
    """Why a backend decision table cannot be used."""


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured batch size: every backend's time (us), the winner, and what failed there."""

    m: int
    us: dict[str, float]
    winner: str
    errors: dict[str, str]

    def fastest(self) -> list[str]:
        """Measured backends, fastest first (ties by name)."""
        return sorted(self.us, key=lambda b: (self.us[b], b))


def interpolate(lower: Point, upper: Point, m: int) -> Point | None:
    """Each backend measured at both sizes, its time linear in M between them; a backend measured
    at one only is left out (with the other's error, if it failed there). None when no backend
    was measured at both."""
    t = (m - lower.m) / (upper.m - lower.m)
    us = {b: lower.us[b] + (upper.us[b] - lower.us[b]) * t for b in lower.us if b in upper.us}
    if not us:
        return None
    errors = {}
    for b in dict.fromkeys([*lower.us, *upper.us, *lower.errors, *upper.errors]):
        if b not in us:
            errors[b] = lower.errors.get(b) or upper.errors.get(b) or "measured at only one of the two sizes"
    return Point(m, us, min(us, key=lambda b: (us[b], b)), errors)


@dataclasses.dataclass(frozen=True)
class Location:
    """Where a batch size M falls in a table: the point used (measured, or interpolated between
    the two measured sizes bracketing M) and those two."""

    m: int
    point: Point  # the measured point used, or the interpolated one (point.m == m)
    lower: Point | None  # the largest measured size <= M (None below the smallest)
    upper: Point | None  # the smallest measured size >= M (None above the largest)
    how: Literal["exact", "between", "nearest", "below", "above"]

    def neighbours(self) -> list[Point]:
        """The measured sizes looked at (one when exact or beyond the ends, else two)."""
        if self.how == "exact":
            return [self.point]
        return [p for p in (self.lower, self.upper) if p is not None]

    def describe(self) -> str:
        if self.how == "exact":
            return f"measured at M={self.m}"
        if self.how == "between":
            return f"M={self.m} between measured {self.lower.m} and {self.upper.m}: times interpolated linearly in M"
        if self.how == "nearest":
            return (
                f"M={self.m} between measured {self.lower.m} and {self.upper.m}, no backend measured at both: "
                f"nearest in log space, {self.point.m}"
            )
        end = "smallest" if self.how == "below" else "largest"
        return f"M={self.m} {self.how} the {end} measured size, using M={self.point.m}"


@dataclasses.dataclass(frozen=True)
class BackendTable:
    path: Path
    meta: dict
    points: tuple[Point, ...]  # sorted by batch size
    # the tables found after this one whose points it holds beyond its own sizes (find_table's layering)
    filled_from: tuple[Path, ...] = ()
    # (size, file) of each point measured in another file than `path` (layering, refine)
    sources: tuple[tuple[int, Path], ...] = ()

    def source(self, m: int) -> Path:
        """The file the point of measured size m came from."""
        return dict(self.sources).get(m, self.path)

    def files(self, points) -> list[Path]:
        """The files the measured `points` came from, each once, in their order."""
        return list(dict.fromkeys(self.source(p.m) for p in points))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(p.m for p in self.points)

    def locate(self, m: int) -> Location:
        sizes = self.sizes
        i = bisect.bisect_left(sizes, m)
        if i < len(sizes) and sizes[i] == m:
            p = self.points[i]
            return Location(m, p, p, p, "exact")
        if i == 0:
            return Location(m, self.points[0], None, self.points[0], "below")
        if i == len(sizes):
            return Location(m, self.points[-1], self.points[-1], None, "above")
        lo, hi = self.points[i - 1], self.points[i]
        point = interpolate(lo, hi, m)
        if point is not None:
            return Location(m, point, lo, hi, "between")
        # nearest in log space: log M - log lo <= log hi - log M  <=>  M*M <= lo*hi (ties: lo)
        return Location(m, lo if m * m <= lo.m * hi.m else hi, lo, hi, "nearest")


# ------------------------------------------------------------------------------- validation


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_finite(value) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def parse_table(data, path: str | Path, shape: MoEShape | None = None, scheme: QuantScheme | None = None) -> BackendTable:
    """Validate the parsed JSON of a table file; raises TableError naming the first problem.

    The meta must match the file name (E, N, H, device, scheme) and, when given, the problem asked
    about (`shape`: experts, hidden, intermediate per GPU, top-k; `scheme`)."""
    path = Path(path)
    if not isinstance(data, dict):
        raise TableError(f"expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise TableError(f"'format' is {data.get('format')!r}, expected {FORMAT!r}")
    if data.get("version") != VERSION:
        raise TableError(f"version {data.get('version')!r}; this moekit reads version {VERSION}")
    meta = data.get("meta")
    if not isinstance(meta, dict):
        raise TableError("'meta' is missing or not an object")
    for key in ("num_experts", "hidden", "intermediate", "top_k"):
        if not _positive_int(meta.get(key)):
            raise TableError(f"meta.{key} is {meta.get(key)!r}, expected a positive integer")
    for key in ("device_name", "scheme"):
        if not isinstance(meta.get(key), str) or not meta[key]:
            raise TableError(f"meta.{key} is {meta.get(key)!r}, expected a name")
    if meta.get("mode", "layer") != "layer":
        raise TableError(f"meta.mode is {meta.get('mode')!r}; auto decides on whole-layer times ('layer')")

    named = tables.parse_table_name(path.name)
    if named is None:
        raise TableError("file name is not E={E},N={N},H={H},device_name={device},scheme={scheme}"
                         "[,fp8_accumulation=fast].json")
    for key in ("num_experts", "intermediate", "hidden", "scheme"):
        if meta[key] != named[key]:
            raise TableError(f"meta.{key} is {meta[key]!r} but the file name says {named[key]!r}")
    mismatch = tables.accumulation_mismatch(path.name, meta)
    if mismatch:
        raise TableError(mismatch)
    if tables.normalize_device_name(meta["device_name"]) != named["device_name"]:
        raise TableError(f"meta.device_name is {meta['device_name']!r} but the file name says {named['device_name']!r}")
    if shape is not None:
        asked = {"num_experts": shape.num_experts, "hidden": shape.hidden, "intermediate": shape.n, "top_k": shape.top_k}
        for key, value in asked.items():
            if meta[key] != value:
                raise TableError(f"measured with {key}={meta[key]}, this problem has {key}={value}")
    if scheme is not None and meta["scheme"] != scheme.name:
        raise TableError(f"measured for scheme {meta['scheme']!r}, this problem is {scheme.name!r}")

    sizes = data.get("batch_sizes")
    if not isinstance(sizes, dict) or not sizes:
        raise TableError("'batch_sizes' is missing, empty or not an object")
    points = []
    for key, entry in sizes.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and str(int(key)) == key and int(key) > 0):
            raise TableError(f"batch size {key!r} is not a positive integer")
        where = f"batch size {key}"
        if not isinstance(entry, dict):
            raise TableError(f"{where}: expected an object")
        us = entry.get("us")
        if not isinstance(us, dict) or not us:
            raise TableError(f"{where}: 'us' is missing, empty or not an object")
        for backend, value in us.items():
            if not _positive_finite(value):
                raise TableError(f"{where}: {backend} time {value!r} is not a positive finite number of us")
        winner = entry.get("winner")
        if winner not in us:
            raise TableError(f"{where}: winner {winner!r} is not among the measured backends {sorted(us)}")
        errors = entry.get("errors", {})
        if not isinstance(errors, dict) or not all(isinstance(v, str) for v in errors.values()):
            raise TableError(f"{where}: 'errors' must map backend names to reasons")
        points.append(Point(int(key), {b: float(v) for b, v in us.items()}, winner, dict(errors)))
    points.sort(key=lambda p: p.m)
    return BackendTable(path, dict(meta), tuple(points))


def load_table(path: str | Path, shape: MoEShape | None = None, scheme: QuantScheme | None = None) -> BackendTable:
    """Read and validate one table file; raises TableError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TableError(f"cannot read it: {e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:  # JSONDecodeError
        raise TableError(f"not valid JSON: {e}") from None
    return parse_table(data, path, shape, scheme)


# ------------------------------------------------------------------------------------ lookup

_warned: set[tuple[str, str]] = set()


def _warn_once(path, problem: str) -> None:
    key = (str(path), problem)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(f"moekit: ignoring backend table {path}: {problem}", BackendTableWarning, stacklevel=3)


def refine(base: BackendTable, top: BackendTable) -> BackendTable:
    """`base` with `top`'s points at the sizes `top` measured (a fast-mode table over the precise
    one, moekit.tables); it reads as `top`'s file."""
    measured = {p.m for p in top.points}
    points = sorted([*(p for p in base.points if p.m not in measured), *top.points], key=lambda p: p.m)
    sources = tuple((p.m, base.source(p.m)) for p in base.points if p.m not in measured) + top.sources
    return BackendTable(top.path, {**top.meta, "refines": base.path.name}, tuple(points),
                        (*top.filled_from, *base.filled_from), sources)


def find_table(
    shape: MoEShape, scheme: QuantScheme, device_name: str, skipped: list | None = None
) -> BackendTable | None:
    """The valid tables for this problem on this device (user folders, then shipped, then a GPU of
    the sharing group), layered (_layered_valid), or None; in fast accumulation mode the
    fast-mode ones refine them (`refine`).

    Tables that fail to load are skipped with one warning per file; their (path, problem) is also
    appended to `skipped` when given. Never raises."""
    try:
        accumulation = table_accumulation(scheme)
    except ValueError as e:  # a bad MOEKIT_FP8_ACCUMULATION: select refuses it first; here, never raise
        warnings.warn(f"moekit: {e}; reading the precise-mode decision tables", BackendTableWarning, stacklevel=2)
        accumulation = "precise"
    found = precise = _layered_valid(shape, scheme, device_name, "precise", skipped)
    precise_path = precise.path if precise is not None else None
    used = [precise_path, *precise.filled_from] if precise is not None else []
    if accumulation != "precise":
        fast = _layered_valid(shape, scheme, device_name, accumulation, skipped,
                              keep=lambda path: tables.fast_may_refine(precise_path, path, device_name))
        if fast is not None:
            found = refine(precise, fast) if precise is not None else fast
            used += [fast.path, *fast.filled_from]
    tables.note_borrowed(used, device_name, "backend decision table")
    return found


def _layered_valid(shape, scheme, device_name, accumulation: str, skipped: list | None,
                   keep=lambda path: True) -> BackendTable | None:
    """The valid tables found (moekit.tables.find_tables' order), layered: the first answers within
    the range of sizes it measured, each later one only beyond the ranges of those before it (a
    tune of a few sizes hides no other size of the tables after it). The result reads as the first
    table's file; `filled_from` names the others whose points it holds."""
    try:
        # a folder that cannot be listed is skipped there, with a warning (and in `skipped`): the
        # other folders', the shipped one included, are still searched
        candidates = tables.find_tables("backends", shape, scheme, device_name, accumulation, skipped=skipped)
    except Exception as e:  # noqa: BLE001 - never expected; whatever it is must not break a forward pass
        _warn_once(tables.table_name(shape, scheme, device_name, accumulation),
                   f"cannot search for it: {type(e).__name__}: {e}")
        return None
    first: BackendTable | None = None
    points: list[Point] = []
    layers = tables.Layers()
    filled_from: list[Path] = []
    sources: list[tuple[int, Path]] = []
    for path in candidates:
        if not keep(path):
            continue
        try:
            table = load_table(path, shape, scheme)
        except Exception as e:  # noqa: BLE001 - TableError and anything unexpected alike
            problem = str(e) if isinstance(e, TableError) else f"{type(e).__name__}: {e}"
            if skipped is not None:
                skipped.append((path, problem))
            _warn_once(path, problem)
            continue
        mine = layers.take(table.sizes)
        beyond = [p for p in table.points if p.m in mine]
        if first is None:
            first = table
        elif beyond:
            filled_from.append(path)
            sources += [(p.m, path) for p in beyond]
        points += beyond
    if first is None or not filled_from:
        return first
    return dataclasses.replace(first, points=tuple(sorted(points, key=lambda p: p.m)), filled_from=tuple(filled_from),
                               sources=tuple(sources))
