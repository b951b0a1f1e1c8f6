"""The tuner's journal: every measurement of one (problem, batch size), on disk as soon as it is made.

One JSON file per batch size, OUT/.progress/<table name without .json>/M=<M>.json, so that worker
processes on several GPUs (each owning its batch sizes) never write the same file. Every write
goes through `moekit.tables.write_json_atomically`: a kill leaves the previous version or the new
one, never half of one. The tables of `moekit tune` are rebuilt from these files only, so a rerun
of the same command skips what is already here and loses nothing.

A journal whose fingerprint (device, dtype, routing, seed, versions) or problem differs from the
current run's measured something else: it never feeds the run's tables (`load_journals` leaves it
out), and when the run measures that size again it is set aside first (renamed M=<M>.stale.json,
or .stale-2.json and so on: an earlier set-aside is never replaced). It is set aside only then, at
the first save of the new journal, so that a size the run does not get to (a budget cut, other
--batch-sizes) keeps its journal as it was.

A measurement in progress is marked in `in_flight` before it starts and unmarked after (whether it
succeeded or failed). A mark that survives means the process died during that measurement (a
segfault, the OOM killer, kill -9): the next run tries it once more, and after a second death
records it as failed instead of dying on it forever. A stop on purpose un-marks it: Ctrl-C, and
SIGTERM and SIGHUP, which the run turns into the same (runner.stop_on_signals).
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable
from pathlib import Path

from ..tables import write_json_atomically

FORMAT = "moekit-tune-journal"
VERSION = 1
PROGRESS_DIR = ".progress"
MAX_DEATHS = 2  # deaths during one measurement before it is recorded as failed
# Fingerprint fields that describe, for messages and the tables' meta, without being a condition
# of the measurements: a recorded routing's file (its content hash, "routing_sha256", is compared).
NOT_COMPARED = ("routing_file",)
JOURNAL_NAME = re.compile(r"M=(\d+)\.json")  # a journal; set-aside ones are M=<M>.stale[-n].json


def journal_dir(out_dir: Path, table_file_name: str) -> Path:
    return Path(out_dir) / PROGRESS_DIR / table_file_name.removesuffix(".json")


def journal_path(out_dir: Path, table_file_name: str, batch_size: int) -> Path:
    return journal_dir(out_dir, table_file_name) / f"M={batch_size}.json"


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


class Journal:
    """The measurements of one (problem, batch size). `data` is the JSON document:

    {"format", "version", "fingerprint": {...}, "problem": {...}, "batch_size": M, "updated": date,
     "default": "<key of default_config at M>",
     "incumbent": {"key": "<key>", "config": {...}},  the config a table gave at M (runner.Worker._incumbents;
                                                      absent where none did)
     "configs": {"<key>": {"config": {...}, "us": .., "p20_us": .., "p80_us": .., "method": .., "flush_us": .., "flush": ..}
                          | {"config": {...}, "error": "<one line>"}},
     "backends": {"<name>": {"us": .., ...} | {"error": "..."}},
     "backends_asked": ["<name>", ..],  the backends besides triton the last run at this size was asked
                                        to time: the decision table decides the size only once each has
                                        a time or an error (output.backend_table)
     "search": {"space": .., "candidates": n, "dropped": {"<key>": why}, "static": {why: count},
                "complete": bool},
     "decision": {"config": "<triton key chosen>", "candidates": ["<triton key>", ..], "routings": n,
                  "triton_us": {"<triton key>": ..}, "triton_errors": {"<triton key>": ".."},
                  "us": {"<backend>": ..}, "errors": {"<backend>": ".."}},  (runner._decide)
     "in_flight": {"<what>": deaths}}
    """

    def __init__(self, path: Path, data: dict, replaces: str | None = None,
                 log: Callable[[str], None] | None = None):
        self.path, self.data = Path(path), data
        self._replaces = replaces  # why the file at `path` is set aside at the first save (see open)
        self._log = log or (lambda text: None)

    @classmethod
    def open(cls, path: Path, fingerprint: dict, problem: dict, batch_size: int,
             log: Callable[[str], None] | None = None) -> Journal:
        """The journal at `path` if it matches this run, else a fresh one; an existing file that
        does not match is set aside at the fresh journal's first save (module docstring), said
        through `log`."""
        path = Path(path)
        fresh = {
            "format": FORMAT, "version": VERSION, "fingerprint": fingerprint, "problem": problem,
            "batch_size": batch_size, "updated": _now(), "default": None, "configs": {}, "backends": {},
            "search": None, "in_flight": {},
        }
        if not path.exists():
            return cls(path, fresh, log=log)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            why = None if _is_journal(data) else "not a journal of this version"
        except (OSError, ValueError) as e:
            data, why = None, f"unreadable ({e})"
        if why is None:
            why = mismatch(data, fingerprint, problem)
        if why is None:
            data.setdefault("in_flight", {})
            data["fingerprint"] = fingerprint  # NOT_COMPARED fields as this run has them (saved with the next change)
            return cls(path, data, log=log)
        return cls(path, fresh, replaces=why, log=log)

    # ------------------------------------------------------------------------------ reading

    @property
    def batch_size(self) -> int:
        return self.data["batch_size"]

    def config(self, key: str) -> dict | None:
        return self.data["configs"].get(key)

    def incumbent(self) -> dict | None:
        """The config the backend ran at this size before the run (runner.Worker._incumbents), as a
        dict (KernelConfig.to_dict), or None where no table gave one."""
        found = self.data.get("incumbent")
        return found["config"] if found else None

    def set_incumbent(self, key: str, config: dict) -> None:
        """Record the incumbent; written at once only into a file of this run's conditions
        already there, else with the first measurement: a fresh journal's first save sets aside
        the file of other conditions it replaces (open), which a size the run never measures
        (a budget cut) must keep."""
        self._note("incumbent", {"key": key, "config": config})

    def set_backends_asked(self, names: list[str]) -> None:
        """Record the backends besides triton this run times at this size (saved as the incumbent is)."""
        self._note("backends_asked", list(names))

    def _note(self, field: str, value) -> None:
        """Set a field that is not a measurement: written at once only into a file of this run's
        conditions already there, else with the first measurement (set_incumbent says why)."""
        if self.data.get(field) != value:
            self.data[field] = value
            if self._replaces is None and self.path.is_file():
                self.save()

    def backend(self, name: str) -> dict | None:
        return self.data["backends"].get(name)

    def failed(self) -> dict[str, str]:
        return {k: v["error"] for k, v in self.data["configs"].items() if "error" in v}

    def deaths(self, what: str) -> int:
        return int(self.data["in_flight"].get(what, 0))

    # ------------------------------------------------------------------------------ writing

    def save(self) -> None:
        if self._replaces is not None:
            self._set_aside()
        self.data["updated"] = _now()
        write_json_atomically(self.path, self.data)

    def _set_aside(self) -> None:
        why, self._replaces = self._replaces, None
        if not self.path.exists():
            return
        n, stale = 1, self.path.with_name(f"{self.path.stem}.stale.json")
        while stale.exists():  # never replace an earlier set-aside
            n += 1
            stale = self.path.with_name(f"{self.path.stem}.stale-{n}.json")
        self.path.replace(stale)
        self._log(f"set aside {self.path} as {stale.name}: {why}")

    def begin(self, what: str) -> None:
        """Mark `what` as being measured (see the module docstring), on disk before it starts."""
        self.data["in_flight"][what] = self.deaths(what) + 1
        self.save()

    def end(self, what: str, save: bool = True) -> None:
        self.data["in_flight"].pop(what, None)
        if save:
            self.save()

    def record_config(self, key: str, config: dict, result: dict) -> None:
        self.data["configs"][key] = {"config": config, **result}
        self.end(f"triton {key}")

    def record_backend(self, name: str, result: dict) -> None:
        self.data["backends"][name] = result
        self.end(f"backend {name}")


def _differences(old: dict, new: dict) -> str:
    keys = sorted(set(old) | set(new))
    diffs = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
    return ", ".join(diffs) or "a different problem"


def _is_journal(data) -> bool:
    return (
        isinstance(data, dict) and data.get("format") == FORMAT and data.get("version") == VERSION
        and isinstance(data.get("configs"), dict) and isinstance(data.get("backends"), dict)
    )


def mismatch(data: dict, fingerprint: dict, problem: dict) -> str | None:
    """Why a journal was measured under other conditions than `fingerprint` and `problem`, or None
    (NOT_COMPARED fields aside)."""
    old = data.get("fingerprint") or {}
    same = _compared(old) == _compared(fingerprint)
    if same and data.get("problem") == problem:
        return None
    if not same:
        return "measured under other conditions (" + _differences(old, fingerprint) + ")"
    return "measured for another problem (" + _differences(data.get("problem") or {}, problem) + ")"


def _compared(fingerprint: dict) -> dict:
    return {k: v for k, v in fingerprint.items() if k not in NOT_COMPARED}


def load_journals(out_dir: Path, table_file_name: str, fingerprint: dict, problem: dict
                  ) -> tuple[list[dict], dict[int, str]]:
    """The journals of one table measured under `fingerprint` and `problem`, sorted by batch size;
    and {batch size: why} of those measured under other conditions, which must not feed this
    run's tables (set-aside and broken files skipped)."""
    folder = journal_dir(out_dir, table_file_name)
    found, others = [], {}
    for path in folder.glob("M=*.json"):
        if not JOURNAL_NAME.fullmatch(path.name):
            continue  # M=<M>.stale.json and the like
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not _is_journal(data):
            continue
        why = mismatch(data, fingerprint, problem)
        if why is None:
            found.append(data)
        else:
            others[data["batch_size"]] = why
    return sorted(found, key=lambda d: d["batch_size"]), dict(sorted(others.items()))


__all__ = ["MAX_DEATHS", "NOT_COMPARED", "PROGRESS_DIR", "Journal", "journal_dir", "journal_path", "load_journals",
           "mismatch"]
