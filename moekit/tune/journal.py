"""The tuner's journal: every measurement of one (problem, batch size), on disk as soon as it is made.

One JSON file per batch size, OUT/.progress/<table name without .json>/M=<M>.json, so that worker
processes on several GPUs (each owning its batch sizes) never write the same file. Every write
goes through `moekit.tables.write_json_atomically`: a kill leaves the previous version or the new
one, never half of one. The tables of `moekit tune` are rebuilt from these files only, so a rerun
of the same command skips what is already here and loses nothing.

A journal whose fingerprint (device, dtype, routing, seed, versions) differs from the current
run's measured something else; it is set aside (renamed *.stale.json), not mixed in.

A measurement in progress is marked in `in_flight` before it starts and unmarked after (whether it
succeeded or failed). A mark that survives means the process died during that measurement (a
segfault, the OOM killer, kill -9): the next run tries it once more, and after a second death
records it as failed instead of dying on it forever.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from ..tables import write_json_atomically

FORMAT = "moekit-tune-journal"
VERSION = 1
PROGRESS_DIR = ".progress"
MAX_DEATHS = 2  # deaths during one measurement before it is recorded as failed


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
     "configs": {"<key>": {"config": {...}, "us": .., "p20_us": .., "p80_us": .., "method": ..}
                          | {"config": {...}, "error": "<one line>"}},
     "backends": {"<name>": {"us": .., ...} | {"error": "..."}},
     "search": {"space": .., "candidates": n, "dropped": {"<key>": why}, "static": {why: count},
                "complete": bool},
     "decision": {"config": "<triton key>", "routings": n, "us": {"<backend>": ..},
                  "errors": {"<backend>": ".."}},  (runner._decide)
     "in_flight": {"<what>": deaths}}
    """

    def __init__(self, path: Path, data: dict):
        self.path, self.data = Path(path), data

    @classmethod
    def open(cls, path: Path, fingerprint: dict, problem: dict, batch_size: int) -> tuple["Journal", str | None]:
        """The journal at `path` if it matches this run, else a fresh one; and a note when an
        existing file was set aside."""
        path = Path(path)
        fresh = {
            "format": FORMAT, "version": VERSION, "fingerprint": fingerprint, "problem": problem,
            "batch_size": batch_size, "updated": _now(), "default": None, "configs": {}, "backends": {},
            "search": None, "in_flight": {},
        }
        if not path.exists():
            return cls(path, fresh), None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            ok = (
                isinstance(data, dict) and data.get("format") == FORMAT and data.get("version") == VERSION
                and isinstance(data.get("configs"), dict) and isinstance(data.get("backends"), dict)
            )
            why = "not a journal of this version" if not ok else None
        except (OSError, ValueError) as e:
            data, why = None, f"unreadable ({e})"
        if why is None and (data.get("fingerprint") != fingerprint or data.get("problem") != problem):
            why = "measured under other conditions (" + _differences(data.get("fingerprint") or {}, fingerprint) + ")"
        if why is None:
            data.setdefault("in_flight", {})
            return cls(path, data), None
        stale = path.with_name(path.stem + ".stale.json")
        path.replace(stale)
        return cls(path, fresh), f"set aside {path} as {stale.name}: {why}"

    # ------------------------------------------------------------------------------ reading

    @property
    def batch_size(self) -> int:
        return self.data["batch_size"]

    def config(self, key: str) -> dict | None:
        return self.data["configs"].get(key)

    def backend(self, name: str) -> dict | None:
        return self.data["backends"].get(name)

    def measured_us(self) -> dict[str, float]:
        """Triton config key -> median µs, for every config that ran."""
        return {k: v["us"] for k, v in self.data["configs"].items() if "us" in v}

    def failed(self) -> dict[str, str]:
        return {k: v["error"] for k, v in self.data["configs"].items() if "error" in v}

    def deaths(self, what: str) -> int:
        return int(self.data["in_flight"].get(what, 0))

    # ------------------------------------------------------------------------------ writing

    def save(self) -> None:
        self.data["updated"] = _now()
        write_json_atomically(self.path, self.data)

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


def load_journals(out_dir: Path, table_file_name: str) -> list[dict]:
    """Every valid journal of one table, sorted by batch size (stale and broken files skipped)."""
    folder = journal_dir(out_dir, table_file_name)
    found = []
    for path in folder.glob("M=*.json"):
        if path.name.endswith(".stale.json"):
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("format") == FORMAT and data.get("version") == VERSION:
            found.append(data)
    return sorted(found, key=lambda d: d["batch_size"])


__all__ = ["Journal", "journal_dir", "journal_path", "load_journals", "PROGRESS_DIR", "MAX_DEATHS"]
