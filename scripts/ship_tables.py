"""Compare tables a `moekit tune` run wrote (the tuned/ folder of a gpu_check archive, say) with
the shipped ones, and with --write ship them, keeping where each table came from.

    python3 scripts/ship_tables.py TUNED_DIR [--into moekit/configs] [--only SUBSTR ...]
        [--write --note "then M = 1-8 searched again (...)"] [--merge | --allow-fewer-sizes]

Without --write it only prints, per table and batch size, whether the triton config changed
(old -> new, with µs) and whether the backend decision's winner changed. With --write every
table that changed replaces the shipped one of the same name (one whose entries are all the
same is left alone, so shipping twice changes nothing), except that:
- the triton table's meta.command keeps the shipped table's history with "; " and --note after
  it, and meta.gemm2_search stays the shipped table's (a retime of a few sizes must not relabel
  how the others were searched);
- the backend table takes the run's meta with the shipped meta.updated and --note after it;
- --note is required where a shipped table is replaced: it is the only record of the run.
With --merge only the run's batch sizes replace the shipped table's entries and every other size
stays, as does the shipped meta (the note appended as above): for a fresh tune of a few sizes
(`moekit tune --batch-sizes 1 2 --no-between`), whose tables hold only those.
Nothing is written if any table is refused: one that does not load the way moekit reads tables
(a config entry, the decision table's fields, the name against the meta), or one lacking batch
sizes the shipped table has (a retime on the shipped journals keeps every size; a fresh tune of a
few sizes does not; --allow-fewer-sizes ships it anyway). So a triton table and the backend
table of the same run are shipped together or not at all.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from moekit.backends.triton.config import KernelConfig
from moekit.decisions import TableError, parse_table
from moekit.tables import KINDS, accumulation_mismatch, parse_table_name, write_json_atomically
from moekit.tune.space import config_key

SIZES_FIELD = {"triton": "configs", "backends": "batch_sizes"}


@dataclass
class Planned:
    target: Path
    doc: dict | None  # what to write; None: nothing changed


def load_json(path: Path, what: str = "table"):
    """The JSON document at `path`; SystemExit naming `what` it is where it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"cannot read {what} {path}: {exc}") from None


def load_problem(kind: str, path: Path, doc: dict) -> str | None:
    """Why moekit would not read `doc` as the table `path` names (None: it would)."""
    if kind == "backends":
        try:
            parse_table(doc, path)
        except TableError as exc:
            return str(exc)
        return None
    if parse_table_name(path.name) is None or not isinstance(doc.get("configs"), dict):
        return "not a moekit triton table (its name or its 'configs' object)"
    mismatch = accumulation_mismatch(path.name, doc.get("meta", {}))
    if mismatch:
        return mismatch
    for M, entry in doc["configs"].items():
        try:
            KernelConfig.from_table_entry(entry)
        except ValueError as exc:
            return f"batch size {M}: {exc}"
    return None


def _config_text(entry: dict | None) -> str:
    if not entry:
        return "-"
    cfg = KernelConfig.from_table_entry(entry)
    return f"{config_key(cfg)} {entry.get('us', float('nan')):.1f} µs"


def _launch(entry: dict | None) -> dict:
    """A triton entry without tune's notes (its µs): the launch it runs."""
    return {k: v for k, v in (entry or {}).items() if k not in KernelConfig.TABLE_NOTES}


def size_changes(kind: str, old: dict, new: dict) -> list[str]:
    """One line per batch size whose entry differs between the shipped table and the new one."""
    field = SIZES_FIELD[kind]
    before, after = old.get(field, {}), new.get(field, {})
    lines = []
    for M in sorted(set(before) | set(after), key=int):
        o, n = before.get(M), after.get(M)
        if o == n:
            continue
        if kind == "triton":
            what = "same config, retimed" if _launch(o) == _launch(n) else "config changed"
            lines.append(f"  M={M}: {what}: {_config_text(o)} -> {_config_text(n)}")
        else:
            winners = f"{(o or {}).get('winner', '-')} -> {(n or {}).get('winner', '-')}"
            us = ", ".join(f"{b} {t:.1f}" for b, t in sorted((n or {}).get("us", {}).items()))
            lines.append(f"  M={M}: winner {winners} ({us or 'no timings'})")
    return lines


def merged(kind: str, old: dict, new: dict, note: str) -> dict:
    """The table to ship: `new`, with the shipped table's history kept (module docstring)."""
    doc = json.loads(json.dumps(new))
    meta = doc.setdefault("meta", {})
    old_meta = old.get("meta", {})
    if kind == "triton":
        meta["command"] = f"{old_meta['command']}; {note}" if old_meta.get("command") else note
        if "gemm2_search" in old_meta:
            meta["gemm2_search"] = old_meta["gemm2_search"]
        else:
            meta.pop("gemm2_search", None)
    else:
        meta["updated"] = f"{old_meta['updated']}; {note}" if old_meta.get("updated") else note
    return doc


def with_run_sizes(kind: str, old: dict, new: dict) -> dict:
    """--merge: the shipped table (meta and all) with the run's batch sizes' entries in it; the
    triton meta's incomplete_batch_sizes (where a search stopped early) says so of the run's sizes
    as the run's table does, of the others as the shipped one does."""
    field = SIZES_FIELD[kind]
    entries = {**old.get(field, {}), **new.get(field, {})}
    doc = {**old, field: dict(sorted(entries.items(), key=lambda item: int(item[0])))}
    old_meta, new_meta = old.get("meta", {}), new.get("meta", {})
    if kind == "triton" and ("incomplete_batch_sizes" in old_meta or "incomplete_batch_sizes" in new_meta):
        run_sizes = {int(M) for M in new.get(field, {})}
        kept = {M for M in old_meta.get("incomplete_batch_sizes", []) if M not in run_sizes}
        doc["meta"] = {**old_meta, "incomplete_batch_sizes": sorted(kept | set(new_meta.get("incomplete_batch_sizes", [])))}
    return doc


def missing_sizes(kind: str, old: dict, new: dict) -> list[str]:
    field = SIZES_FIELD[kind]
    return sorted(set(old.get(field, {})) - set(new.get(field, {})), key=int)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tuned", type=Path, help="a folder with triton/ and backends/, as `moekit tune --out` writes")
    ap.add_argument("--into", type=Path, default=Path(__file__).resolve().parent.parent / "moekit" / "configs")
    ap.add_argument("--only", nargs="+", default=[], help="only tables whose file name holds one of these")
    ap.add_argument("--note", help="what this run was: appended to meta.command and meta.updated")
    ap.add_argument("--write", action="store_true", help="ship the tables (otherwise only compare)")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--merge", action="store_true", help="only the run's sizes replace the shipped entries")
    how.add_argument("--allow-fewer-sizes", action="store_true", help="ship tables that lack sizes the shipped ones have")
    args = ap.parse_args(argv)
    found = [(kind, p) for kind in KINDS for p in sorted((args.tuned / kind).glob("*.json"))
             if not args.only or any(s in p.name for s in args.only)]
    if not found:
        raise SystemExit(f"no tables under {args.tuned}/triton or {args.tuned}/backends"
                         + (f" matching {args.only}" if args.only else ""))
    planned: list[Planned] = []
    refused: list[str] = []
    for kind, path in found:
        new, target = load_json(path), args.into / kind / path.name
        problem = load_problem(kind, path, new)
        if problem:
            refused.append(f"{kind}/{path.name}: moekit would not read it: {problem}")
            continue
        if not target.exists():
            print(f"{kind}/{path.name}: new table")
            planned.append(Planned(target, new))
            continue
        old = load_json(target)
        if args.merge:
            new = with_run_sizes(kind, old, new)
        changes = size_changes(kind, old, new)
        print(f"{kind}/{path.name}: against the shipped one")
        print("\n".join(changes or ["  no batch size changed"]))
        lost = missing_sizes(kind, old, new)  # none with --merge
        if lost and not args.allow_fewer_sizes:
            refused.append(f"{kind}/{path.name}: lacks M={', '.join(lost)} (--allow-fewer-sizes ships it anyway)")
        elif changes and args.write and not args.note:
            refused.append(f"{kind}/{path.name}: replacing a shipped table needs --note (what this run was)")
        planned.append(Planned(target, merged(kind, old, new, args.note or "") if changes else None))
    if refused:
        print("nothing shipped:\n  " + "\n  ".join(refused), file=sys.stderr)
        return 1
    if args.write:
        for p in planned:
            if p.doc is not None:
                write_json_atomically(p.target, p.doc)
                print(f"wrote {p.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
