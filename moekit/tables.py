"""Where measured tables live, what they are called, and how they are written.

Two kinds of table, both written by `moekit tune`, one JSON file per (device, shape, scheme):
    triton/    the triton backend's tuned launch configs, keyed by batch size
    backends/  every backend's measured time per batch size and the winner (auto reads these)

They are searched in the folders of MOEKIT_CONFIG_DIR (several separated by os.pathsep, each laid
out like moekit/configs/: a `triton/` and a `backends/` subfolder) before the tables shipped in
the package. A file name says which problem it measured:
    E={E},N={N},H={H},device_name={device},scheme={scheme}.json
with N the intermediate size per GPU and the device name as vLLM writes it ('NVIDIA H100 80GB
HBM3' -> 'NVIDIA_H100_80GB_HBM3'). Tables tuned with MOEKIT_FP8_ACCUMULATION=fast, for a scheme
the mode affects (moekit.accumulation), end in ',fp8_accumulation=fast.json' instead. Such a table
refines the precise one: at the batch sizes it measured its entries are used, elsewhere the
precise table's (a fast-mode tune of the prefill sizes alone then leaves decode to the tables
tuned before).

Looking a table up lists folders and reads files, so what a lookup found is memoised (`memoized`,
keyed by the caller's question and MOEKIT_CONFIG_DIR): tables written or edited later, by this
process or another, are seen after `clear_cache()` (`moekit.select.clear_cache()` calls it;
`moekit tune` does after writing its tables) or in a new process.

Nothing unreadable is fatal, nor hides the other folders' tables: a folder that cannot be listed
(one of another user, mode 0700) is skipped with a warning of this logger, once per folder and
process; a file named like a table that cannot be read (a broken symlink, no permission) is skipped
by its loader with a warning naming it, as one that is not valid JSON.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from . import env
from .accumulation import FP8_ACCUMULATIONS
from .spec import MoEShape, QuantScheme

log = logging.getLogger("moekit.tables")

CONFIG_DIR_ENV = "MOEKIT_CONFIG_DIR"
SHIPPED_ROOT = Path(__file__).resolve().parent / "configs"
Kind = Literal["triton", "backends"]
KINDS: tuple[str, ...] = ("triton", "backends")


_memo: dict[tuple, object] = {}
_generation = [0]  # bumped by clear_cache: a lookup begun before a clear is not stored after it


def memoized(key: tuple, compute):
    """compute() the first time `key` is asked for under the current MOEKIT_CONFIG_DIR (and
    package folder), the remembered result after that (module docstring). `key` must hold
    everything else the result depends on: the shape, scheme, device, accumulation mode."""
    full = (key, env.raw(CONFIG_DIR_ENV), SHIPPED_ROOT)
    try:
        return _memo[full]
    except KeyError:
        generation = _generation[0]
        value = compute()
        if generation == _generation[0]:
            _memo[full] = value
        return value


def generation() -> int:
    """How many times clear_cache has run: a cache of its own (a tuned table read once per file
    version) keys on it, so that clear_cache empties that one too."""
    return _generation[0]


def clear_cache() -> None:
    """Forget every table looked up so far: after writing or editing tables, in this process or
    another (a running process does not watch the folders)."""
    _generation[0] += 1
    _memo.clear()


def normalize_device_name(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3' (vLLM's convention for file names)."""
    return name.strip().replace(" ", "_")


def device_family(name: str) -> str | None:
    """The GPU model a device name belongs to ('H100', 'H200', 'H20', 'GH200', ...), or None.

    One GPU model ships under several names (H100 SXM reads 'NVIDIA H100 80GB HBM3', PCIe
    'NVIDIA H100 PCIe', NVL 'NVIDIA H100 NVL'); a table measured on one of them is the best
    guess for the others when no exact match exists. A letter after the number names another
    model (L40S and L40, A10G and A10, V100S and V100) and stays part of the family.
    """
    m = re.search(r"\b(GH|GB|[A-Z])(\d{1,3}[A-Z]?)\b", name.replace("_", " ").upper())
    return m.group(1) + m.group(2) if m else None


# GPU models that stand in for each other where one has no table of its own (find_tables' last
# tier), each group in the order its tables are taken: the same architecture (sm_90) and SM count
# (132), differing in memory. Measured: on an H100 the H200's tables beat the analytic defaults at
# all 21 anchor points, by 1-33% (BENCHMARKS.md, twenty-fourth session). Models further apart (the
# cut-down H20; L4 and L40S, one sm_89 but 58 SMs against 142) are left out until measured.
SHARING_GROUPS: tuple[tuple[str, ...], ...] = (("H200", "H100", "H800", "GH200"),)


def sharing_group(name: str) -> tuple[str, ...] | None:
    """The SHARING_GROUPS group of a GPU model named like a device, or None."""
    family = device_family(name)
    return next((g for g in SHARING_GROUPS if family in g), None)


def is_borrowed(path: Path, device_name: str) -> bool:
    """Whether the table at `path` was measured on another GPU model than `device_name`'s (one of
    its sharing group, find_tables' last resort)."""
    named = parse_table_name(path.name)
    return named is not None and device_family(named["device_name"]) != device_family(device_name)


def fast_may_refine(precise: Path | None, fast: Path, device_name: str) -> bool:
    """Whether a fast-mode table refines the precise one found (module docstring): not where it was
    borrowed from another GPU model and the precise one is this GPU's own, whose measurements win."""
    return precise is None or not is_borrowed(fast, device_name) or is_borrowed(precise, device_name)


_borrowed_noted: set[tuple[str, str]] = set()


def note_borrowed(paths, device_name: str, what: str) -> None:
    """Say once per (table, device), at info level, that a table of another GPU model is in use:
    each of `paths` (the tables a lookup uses) that is_borrowed."""
    for path in paths:
        if not is_borrowed(path, device_name) or (str(path), device_name) in _borrowed_noted:
            continue
        _borrowed_noted.add((str(path), device_name))
        log.info("moekit: %s for this problem on %s at the sizes no table of this GPU measured: %s, measured on "
                 "another GPU of the same architecture and SM count (run `moekit tune` here for tables of this GPU)",
                 what, device_name, path)


def table_name(shape: MoEShape, scheme: QuantScheme, device_name: str, accumulation: str = "precise") -> str:
    """The file name of a table; `accumulation` as moekit.accumulation.table_accumulation says."""
    if accumulation not in FP8_ACCUMULATIONS:
        raise ValueError(f"accumulation {accumulation!r}: expected one of {', '.join(FP8_ACCUMULATIONS)}")
    mode = "" if accumulation == "precise" else f",fp8_accumulation={accumulation}"
    return (
        f"E={shape.num_experts},N={shape.n},H={shape.hidden},"
        f"device_name={normalize_device_name(device_name)},scheme={scheme.name}{mode}.json"
    )


_TABLE_NAME = re.compile(r"^E=(\d+),N=(\d+),H=(\d+),device_name=(.+),scheme=([^,]+)(?:,fp8_accumulation=(\w+))?\.json$")


def parse_table_name(file_name: str) -> dict | None:
    """What a table's file name says (table_name's fields), or None for another name."""
    m = _TABLE_NAME.match(file_name)
    if m is None:
        return None
    return {"num_experts": int(m[1]), "intermediate": int(m[2]), "hidden": int(m[3]), "device_name": m[4],
            "scheme": m[5], "fp8_accumulation": m[6] or "precise"}


def accumulation_mismatch(file_name: str, meta: dict) -> str | None:
    """Why a table's meta contradicts the accumulation mode its file name says, or None."""
    named = parse_table_name(file_name)
    measured = meta.get("fp8_accumulation", "precise")
    if named is None or measured == named["fp8_accumulation"]:
        return None
    return f"meta.fp8_accumulation is {measured!r} but the file name says {named['fp8_accumulation']!r}"


def search_dirs(kind: Kind) -> list[Path]:
    """The folders holding tables of `kind`: the user's (MOEKIT_CONFIG_DIR) first, then shipped."""
    if kind not in KINDS:
        raise ValueError(f"unknown table kind {kind!r}; expected one of {KINDS}")
    # read through moekit.env, the same read that keys `memoized`, so both see one environment
    roots = [Path(p) for p in (env.get(CONFIG_DIR_ENV) or "").split(os.pathsep) if p]
    for root in roots:
        _warn_if_missing(root)
    return [root / kind for root in roots] + [SHIPPED_ROOT / kind]


_missing_warned: set[Path] = set()


def _warn_if_missing(root: Path) -> None:
    """A MOEKIT_CONFIG_DIR folder that does not exist (a typo) is said once per process: its
    tables would otherwise be passed over in silence."""
    if root in _missing_warned:
        return
    try:
        missing = not root.is_dir()
    except OSError:  # a folder above it the process cannot search: _folder_names says so, per table folder
        return
    if missing:
        _missing_warned.add(root)
        log.warning("%s names %s, which is not a folder: no tuned tables are read from it", CONFIG_DIR_ENV, root)


def _folder_names(folder: Path, skipped: list | None = None) -> list[str] | None:
    """The names in a table folder, sorted; [] where there is no such folder (a MOEKIT_CONFIG_DIR
    without a `backends/`, say); None where it cannot be listed (one the process may not search,
    as `moekit tune` under umask 077 leaves for a server of another user): a warning of this
    logger once per folder and process, and (folder, problem) appended to `skipped` when given.
    Its tables are not read; the other folders', the shipped ones included, are."""
    try:
        with os.scandir(folder) as entries:
            return sorted(entry.name for entry in entries)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        why = e.strerror or str(e)
        if skipped is not None and all(seen != folder for seen, _ in skipped):  # precise and fast both search it
            skipped.append((folder, f"cannot list this table folder: {why}"))
        if folder not in _missing_warned:
            _missing_warned.add(folder)
            log.warning("moekit: cannot list the table folder %s (%s): its tables are not read (the other folders' "
                        "and the shipped ones are)", folder, why)
        return None


def find_tables(
    kind: Kind, shape: MoEShape, scheme: QuantScheme, device_name: str, accumulation: str = "precise",
    skip_roots: Sequence[Path] = (), skipped: list | None = None,
) -> list[Path]:
    """Candidate table files of one accumulation mode, best first (none from the table roots in
    `skip_roots`: the tuner looks past its own output, moekit.tune.runner.Worker._incumbents).
    Never raises for a folder or file it cannot read: a folder that cannot be listed is skipped
    with a warning (_folder_names: `skipped` gets its (folder, problem)); an entry named like a
    table is listed whatever it is (a broken symlink, one the process may not read), and the
    caller's loading skips it with a warning naming it.

    In each folder (user folders before shipped ones): the exact device name, then another
    device name of the same GPU model (H100 SXM for an H100 PCIe, say). After every folder's,
    the tables of the other GPU models of its sharing group (SHARING_GROUPS: an H200's for an
    H100), user folders first, in the group's order within a folder: a table of this GPU model,
    wherever it is, comes before them. Callers layer the files that load in this order: each
    answers within the range of batch sizes it measured, where no file before it does (a tune of
    a few sizes hides no other size of the tables after it); a file that fails to load is skipped
    with a warning by the caller.
    """
    exact = table_name(shape, scheme, device_name, accumulation)
    family = device_family(device_name)
    group = sharing_group(device_name)
    stem_without_device = exact.replace(f"device_name={normalize_device_name(device_name)},", "")
    found: list[Path] = []
    borrowed: list[Path] = []
    looked_past = {Path(root).resolve() for root in skip_roots}
    for d in search_dirs(kind):
        if looked_past and d.parent.resolve() in looked_past:
            continue
        names = _folder_names(d, skipped)
        if names is None:
            continue
        if exact in names:
            found.append(d / exact)
        if family is None:
            continue
        lent: list[tuple[int, Path]] = []  # this folder's tables of other GPU models, by the group's order
        for name in names:
            named = parse_table_name(name)
            other = named["device_name"] if named else None
            if name == exact or other is None or name.replace(f"device_name={other},", "") != stem_without_device:
                continue
            path = d / name
            if device_family(other) == family:
                found.append(path)
            elif group is not None and device_family(other) in group:
                lent.append((group.index(device_family(other)), path))
        borrowed += [path for _, path in sorted(lent, key=lambda rank_path: rank_path[0])]
    return found + borrowed


class Layers:
    """find_tables' layering, shared by the triton config tables and the decision tables: each
    table answers within the range of batch sizes it measured, where no table taken before it
    does."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] = []

    def take(self, sizes) -> set[int]:
        """Of the next table's measured sizes (non-empty), those it answers; its range is recorded."""
        sizes = list(sizes)
        mine = {m for m in sizes if not any(lo <= m <= hi for lo, hi in self._ranges)}
        self._ranges.append((min(sizes), max(sizes)))
        return mine


def _created_file_mode() -> int:
    """0666 less the process's umask: the mode open() gives a new file. Read from /proc where it
    says (setting the umask to read it back would give other threads' files 0666 meanwhile)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0)
        os.umask(umask)
    return 0o666 & ~umask


def write_json_atomically(path: str | os.PathLike, data) -> Path:
    """Write JSON to `path` through a temporary file and a rename: a reader (or a kill) never
    sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600, which the rename would keep: a serving process of another
        # user could not read the table. The mode a plain open() gives (or the replaced file's).
        os.fchmod(fd, path.stat().st_mode & 0o777 if path.exists() else _created_file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
