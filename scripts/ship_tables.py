"""Compare tables a `moekit tune` run wrote (the tuned/ folder of a gpu_check archive, say) with
the shipped ones, and with --write ship them, keeping where each table came from.

    python3 scripts/ship_tables.py TUNED_DIR [--into moekit/configs] [--only SUBSTR ...]
        [--note "then M = 1-8 searched again (...)"] [--write] [--allow-fewer-sizes]

Without --write it only prints, per table and batch size, whether the triton config changed
(old -> new, with µs) and whether the backend decision's winner changed. With --write each new
table replaces the shipped one of the same name, except that:
- the triton table's meta.command keeps the shipped table's history, with "; " and --note after
  it (the run's own command where no note is given), and meta.gemm2_search stays the shipped
  table's (a retime of a few sizes must not relabel how the others were searched);
- the backend table keeps the shipped meta, with the new date and --note appended to
  meta.updated;
- a new table that lacks batch sizes the shipped one has is refused (nothing tuned is lost
  silently): a retime on the shipped journals keeps every size; a fresh tune of a few sizes
  does not. --allow-fewer-sizes ships it anyway.
A table with no shipped counterpart is new and is copied as it is.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moekit.backends.triton.config import KernelConfig
from moekit.tables import KINDS, write_json_atomically
from moekit.tune.space import config_key

SIZES_FIELD = {"triton": "configs", "backends": "batch_sizes"}
TIMING_FIELDS = ("us", "default_us")


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"cannot read table {path}: {exc}") from None


def _config_text(entry: dict | None) -> str:
    if not entry:
        return "-"
    cfg = KernelConfig.from_dict({k: v for k, v in entry.items() if k not in TIMING_FIELDS})
    return f"{config_key(cfg)} {entry.get('us', float('nan')):.1f} µs"


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
            same = {k: v for k, v in (o or {}).items() if k not in TIMING_FIELDS} == \
                   {k: v for k, v in (n or {}).items() if k not in TIMING_FIELDS}
            what = "same config, retimed" if same else "config changed"
            lines.append(f"  M={M}: {what}: {_config_text(o)} -> {_config_text(n)}")
        else:
            winners = f"{(o or {}).get('winner', '-')} -> {(n or {}).get('winner', '-')}"
            us = ", ".join(f"{b} {t:.1f}" for b, t in sorted((n or {}).get("us", {}).items()))
            lines.append(f"  M={M}: winner {winners} ({us or 'no timings'})")
    return lines


def merged(kind: str, old: dict, new: dict, note: str | None) -> dict:
    """The table to ship: `new`, with the shipped table's history kept (module docstring)."""
    doc = json.loads(json.dumps(new))
    if kind == "triton":
        history = old.get("meta", {}).get("command")
        if history:
            doc["meta"]["command"] = f"{history}; {note or new['meta'].get('command', '')}"
        if "gemm2_search" in old.get("meta", {}):
            doc["meta"]["gemm2_search"] = old["meta"]["gemm2_search"]
    else:
        meta = dict(old.get("meta", {}))
        meta["date"] = new.get("meta", {}).get("date", meta.get("date"))
        if note:
            meta["updated"] = f"{meta['updated']}; {note}" if meta.get("updated") else note
        doc["meta"] = meta
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
    ap.add_argument("--allow-fewer-sizes", action="store_true", help="ship tables that lack sizes the shipped ones have")
    args = ap.parse_args(argv)
    found = [(kind, p) for kind in KINDS for p in sorted((args.tuned / kind).glob("*.json"))
             if not args.only or any(s in p.name for s in args.only)]
    if not found:
        raise SystemExit(f"no tables under {args.tuned}/triton or {args.tuned}/backends"
                         + (f" matching {args.only}" if args.only else ""))
    refused = []
    for kind, path in found:
        new, target = _load(path), args.into / kind / path.name
        old = _load(target) if target.exists() else None
        print(f"{kind}/{path.name}: " + ("new table" if old is None else "against the shipped one"))
        if old is None:
            if args.write:
                write_json_atomically(target, new)
            continue
        for line in size_changes(kind, old, new) or ["  no batch size changed"]:
            print(line)
        lost = missing_sizes(kind, old, new)
        if lost and not args.allow_fewer_sizes:
            refused.append(f"{kind}/{path.name} lacks M={', '.join(lost)}")
            continue
        if args.write:
            write_json_atomically(target, merged(kind, old, new, args.note))
    if refused:
        print("not shipped (a table of fewer sizes; --allow-fewer-sizes ships it anyway):\n  " + "\n  ".join(refused),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
