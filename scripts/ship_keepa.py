"""Ship the GEMM2 launches keeping A that won the whole layer in a `gpu_check.sh keepa` run
(scripts/diag_gemm2_keep_a.py --json) into the triton table those points ran.

    python3 scripts/ship_keepa.py DIAG_JSON --table moekit/configs/triton/E=...json
        [--min-gain 0.02] [--write --note "what the run was (session, card, command)"]

For each measured point (model, tp, M) the diag timed the whole layer with the table's config
("table") and with its fastest kept launches, in the same rounds. Where the fastest kept launch
took at least --min-gain less time than the table's, the table's entry that M reads (the nearest
size, as the backend looks it up) gets that launch. Checks before anything is written:
- the GPU the diag ran on (its rows' device_name, where the diag wrote one) is the table's;
- the kept launch's GEMM1 is that entry's GEMM1 (else the diag ran another table, or the table
  changed since: the point is refused);
- two points that read the same entry must agree on the launch;
- --write needs --note, appended to meta.command after "; " (the table's only record of the edit).
The entry keeps its `default_us` (the analytic default's time); its `us` becomes the kept
launch's layer time in the run. Without --write it only prints what it would change.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moekit.backends.triton.config import KernelConfig, nearest
from moekit.tables import parse_table_name, write_json_atomically
from moekit.tune.space import config_from_key, config_key


def _load(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"cannot read {what} {path}: {exc}") from None


def layer_times(rows: list) -> dict[tuple, dict[str, float]]:
    """(model, tp, M) -> {config name: whole-layer median µs} of the diag's layer rows."""
    points: dict[tuple, dict[str, float]] = {}
    for row in rows:
        if isinstance(row, dict) and row.get("what") == "layer":
            points.setdefault((row["model"], row["tp"], row["M"]), {})[row["config"]] = float(row["us"])
    return points


def plan(points: dict[tuple, dict[str, float]], configs: dict[str, dict], min_gain: float):
    """(changes {entry size: (new config, kept µs, point)}, lines to print, refusals)."""
    table = {int(M): KernelConfig.from_table_entry(e) for M, e in configs.items()}
    changes: dict[int, tuple] = {}
    lines, refused = [], []
    for (model, tp, M), times in sorted(points.items(), key=lambda kv: kv[0][2]):
        where = f"{model} tp{tp} M={M}"
        if "table" not in times:
            refused.append(f"{where}: no whole-layer time with the table's config")
            continue
        kept = {name: us for name, us in times.items() if name != "table"}
        if not kept:
            lines.append(f"{where}: no kept launch ran: unchanged")
            continue
        name, us = min(kept.items(), key=lambda kv: kv[1])
        gain = 1 - us / times["table"]
        if gain < min_gain:
            lines.append(f"{where}: fastest kept {name} {us:.1f} µs against the table's {times['table']:.1f}: "
                         f"{gain:.1%} less, under {min_gain:.0%}: unchanged")
            continue
        new = config_from_key(name)
        size = nearest({s: s for s in table}, M)  # the entry the backend reads at M
        if new.gemm1() != table[size].gemm1():
            refused.append(f"{where}: kept launch {name} has another GEMM1 than the table's entry {size} "
                           f"({config_key(table[size])}): the diag ran another table")
            continue
        if size in changes and changes[size][0] != new:
            refused.append(f"{where} and {changes[size][2]} both read entry {size} but chose different launches")
            continue
        changes[size] = (new, us, where)
        lines.append(f"{where}: entry {size}: {config_key(table[size])} -> {name}, layer "
                     f"{times['table']:.1f} -> {us:.1f} µs ({gain:.1%} less)")
    return changes, lines, refused


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("diag_json", type=Path, help="diag_gemm2_keep_a.py --json's file")
    ap.add_argument("--table", type=Path, required=True, help="the triton table the diag's points read")
    ap.add_argument("--min-gain", type=float, default=0.02,
                    help="least fraction of the layer's time a kept launch must save to be shipped (default 0.02)")
    ap.add_argument("--note", help="what the run was: appended to the table's meta.command")
    ap.add_argument("--write", action="store_true", help="edit the table (otherwise only print)")
    args = ap.parse_args(argv)
    if not 0 <= args.min_gain < 1:
        raise SystemExit(f"--min-gain must lie in [0, 1), got {args.min_gain}")
    rows, doc = _load(args.diag_json, "diag results"), _load(args.table, "triton table")
    if not isinstance(rows, list) or not isinstance(doc, dict) or not isinstance(doc.get("configs"), dict):
        raise SystemExit("expected a list of diag rows and a triton table with a 'configs' object")
    points = layer_times(rows)
    if not points:
        raise SystemExit(f"{args.diag_json} has no whole-layer rows (what: layer)")
    measured_on = {row["device_name"] for row in rows if isinstance(row, dict) and "device_name" in row}
    named = parse_table_name(args.table.name)
    if measured_on and (named is None or measured_on != {named["device_name"]}):
        raise SystemExit(f"the diag ran on {', '.join(sorted(measured_on))} but {args.table.name} is "
                         f"{named['device_name'] if named else 'not a table name'}'s table: nothing shipped")
    changes, lines, refused = plan(points, doc["configs"], args.min_gain)
    print("\n".join(lines))
    if args.write and changes and not args.note:
        refused.append("--write needs --note (what this run was): the table's only record of the edit")
    if refused:
        print("nothing shipped:\n  " + "\n  ".join(refused), file=sys.stderr)
        return 1
    if args.write and changes:
        for size, (new, us, _) in changes.items():
            old = doc["configs"][str(size)]
            doc["configs"][str(size)] = {**new.to_dict(), "us": round(us, 1),
                                         **({"default_us": old["default_us"]} if "default_us" in old else {})}
        meta = doc.setdefault("meta", {})
        meta["command"] = f"{meta['command']}; {args.note}" if meta.get("command") else args.note
        write_json_atomically(args.table, doc)
        print(f"wrote {args.table} ({len(changes)} entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
