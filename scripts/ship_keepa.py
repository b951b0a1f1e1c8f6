"""Ship the GEMM2 launches keeping A that won the whole layer in a `gpu_check.sh keepa` run
(scripts/diag_gemm2_keep_a.py --json) into the triton table those points ran.

    python3 scripts/ship_keepa.py DIAG_JSON --table moekit/configs/triton/E=...json
        [--min-gain 0.02] [--measured-on NAME] [--write --note "what the run was (session, card, command)"]

For each measured point (model, tp, M) the diag timed the whole layer with the table's config
("table") and with its fastest kept launches, in the same rounds. Where the fastest kept launch
took at least --min-gain less time than the table's, the table's entry that M read (the nearest
tiled entry: the diag runs only points where the backend ran the tiled path) gets that launch. Checks before anything is written:
- the GPU the diag ran on is the table's: its rows' device_name (diag runs before the thirty-eighth
  session wrote none: say it with --measured-on), and the table file the diag read, where its rows
  name one, is --table;
- the config the diag ran as "table" at the point (its rows' table_config, where given) is the
  entry's, and every kept launch's GEMM1 is the entry's (else the diag ran another table, or the
  table changed since);
- every point that reads an entry agrees on its launch (a point left unchanged keeps the entry's);
- --write needs --note, appended to meta.command after "; " (the table's only record of the edit).
A refusal of any point ships nothing. A shipped entry's `us` becomes the kept launch's layer time
where the point's M is the entry's size, and is left out where it is not (a time at another M);
its `default_us` (the analytic default's time in the tune that wrote the entry) is dropped, as
not comparable with the new time. Without --write it only prints what it would change.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from moekit.backends.triton.config import KernelConfig, nearest
from moekit.tables import normalize_device_name, parse_table_name, write_json_atomically
from moekit.tune.space import config_from_key, config_key

# scripts/ is on the path when a script runs (and in the tests)
from ship_tables import load_json, load_problem


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def layer_rows(rows) -> list[dict]:
    """The diag's whole-layer rows, each checked for the fields this script reads (SystemExit
    naming the first row that lacks one)."""
    if not isinstance(rows, list):
        raise SystemExit(f"expected a list of diag rows, got {type(rows).__name__}")
    layer = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or row.get("what") != "layer":
            continue
        us, M = row.get("us"), row.get("M")
        if not (isinstance(row.get("model"), str) and _integer(row.get("tp")) and _integer(M)
                and isinstance(row.get("config"), str) and isinstance(us, (int, float)) and not isinstance(us, bool)
                and math.isfinite(us) and us > 0):
            raise SystemExit(f"diag row {i} is not a whole-layer timing (model, tp, M, config, us > 0): {row}")
        for field in ("device_name", "table_file", "table_config"):
            if field in row and row[field] is not None and not isinstance(row[field], str):
                raise SystemExit(f"diag row {i}: {field} must be a string, got {row[field]!r}")
        layer.append(row)
    return layer


def layer_times(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """(model, tp, M) -> {config name: whole-layer median µs}."""
    points: dict[tuple, dict[str, float]] = {}
    for row in rows:
        points.setdefault((row["model"], row["tp"], row["M"]), {})[row["config"]] = float(row["us"])
    return points


def provenance_problems(rows: list[dict], table: Path, measured_on: str | None) -> list[str]:
    """Why these rows were not measured with `table` on its GPU (empty: they were, as far as the
    rows say)."""
    named = parse_table_name(table.name)
    if named is None:
        return [f"{table.name} is not a triton table's name"]
    problems = []
    devices = {row["device_name"] for row in rows if row.get("device_name")}
    if devices and any(not row.get("device_name") for row in rows):
        problems.append("some rows name the GPU they ran on and others do not: rows of two diag runs?")
    measured_on = normalize_device_name(measured_on) if measured_on else None
    if measured_on and devices and devices != {measured_on}:
        problems.append(f"--measured-on {measured_on} but the rows say {', '.join(sorted(devices))}")
    devices = devices or ({measured_on} if measured_on else set())
    if not devices:
        problems.append("the rows do not name the GPU they ran on (a diag run before the thirty-eighth session): "
                        "pass --measured-on with the table file's device_name")
    elif devices != {named["device_name"]}:
        problems.append(f"the diag ran on {', '.join(sorted(devices))} but {table.name} is {named['device_name']}'s table")
    files = {row["table_file"] for row in rows if row.get("table_file")}
    if files and files != {table.name}:
        problems.append(f"the diag read {', '.join(sorted(files))}, not {table.name}")
    return problems


def plan(points: dict[tuple, dict[str, float]], table_configs: dict[tuple, str], configs: dict[str, dict],
         min_gain: float):
    """(changes {entry size: (new config, layer µs at the entry's size or None)}, lines to print,
    refusals). `table_configs`: (model, tp, M) -> the config key the diag ran as "table" there."""
    table = {int(M): KernelConfig.from_table_entry(entry) for M, entry in configs.items()}  # load_problem checked them
    choices: dict[int, list[tuple]] = {}  # entry size -> [(config, µs or None, where)]
    lines, refused = [], []
    for (model, tp, M), times in sorted(points.items(), key=lambda kv: kv[0][2]):
        where = f"{model} tp{tp} M={M}"
        # the entry the backend read at M: the diag runs only points where the backend ran the
        # tiled path, whose entry is the nearest tiled one (TritonBackend's lookup: a GEMV entry
        # nearer still would have run the GEMV path, and the diag would have skipped the point)
        size = nearest({s: s for s, c in table.items() if not c.GEMV}, M)
        entry = table[size]
        ran = table_configs.get((model, tp, M))
        if ran is not None and ran != config_key(entry):
            refused.append(f"{where}: the diag ran {ran} as the table's config, but entry {size} is "
                           f"{config_key(entry)}: it read another table, or the table changed since")
            continue
        if "table" not in times:
            refused.append(f"{where}: no whole-layer time with the table's config")
            continue
        kept = {}
        for name, us in times.items():
            if name == "table":
                continue
            try:
                cfg = config_from_key(name)
            except ValueError as exc:
                refused.append(f"{where}: {exc}")
                break
            if cfg.gemm1() != entry.gemm1():
                refused.append(f"{where}: kept launch {name} has another GEMM1 than the table's entry {size} "
                               f"({config_key(entry)}): the diag ran another table")
                break
            if cfg != entry:  # the table's own launch, where it keeps A already, is no change
                kept[name] = (cfg, us)
        else:
            if not kept:
                lines.append(f"{where}: entry {size}: no kept launch other than the table's: unchanged")
                choices.setdefault(size, []).append((entry, None, where))
                continue
            name, (cfg, us) = min(kept.items(), key=lambda kv: kv[1][1])
            gain = 1 - us / times["table"]
            if gain < min_gain:
                lines.append(f"{where}: entry {size}: fastest kept {name} {us:.1f} µs against the table's "
                             f"{times['table']:.1f}: {gain:.1%} less, under {min_gain:.0%}: unchanged")
                choices.setdefault(size, []).append((entry, None, where))
                continue
            lines.append(f"{where}: entry {size}: {config_key(entry)} -> {name}, layer "
                         f"{times['table']:.1f} -> {us:.1f} µs ({gain:.1%} less)")
            choices.setdefault(size, []).append((cfg, us if M == size else None, where))
    changes = {}
    for size, chosen in choices.items():
        launches = {config_key(cfg) for cfg, _, _ in chosen}
        if len(launches) > 1:
            refused.append(f"{' and '.join(w for _, _, w in chosen)} all read entry {size} but chose different "
                           f"launches ({', '.join(sorted(launches))})")
        elif chosen[0][0] != table[size]:
            changes[size] = (chosen[0][0], next((us for _, us, _ in chosen if us is not None), None))
    return changes, lines, refused


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("diag_json", type=Path, help="diag_gemm2_keep_a.py --json's file")
    ap.add_argument("--table", type=Path, required=True, help="the triton table the diag's points read")
    ap.add_argument("--min-gain", type=float, default=0.02,
                    help="least fraction of the layer's time a kept launch must save to be shipped (default 0.02)")
    ap.add_argument("--measured-on", metavar="NAME",
                    help="the GPU of rows that do not name it (as a table file's device_name, NVIDIA_H200, or as "
                         "the GPU calls itself, 'NVIDIA H200')")
    ap.add_argument("--note", help="what the run was: appended to the table's meta.command")
    ap.add_argument("--write", action="store_true", help="edit the table (otherwise only print)")
    args = ap.parse_args(argv)
    if not 0 <= args.min_gain < 1:
        raise SystemExit(f"--min-gain must lie in [0, 1), got {args.min_gain}")
    rows = layer_rows(load_json(args.diag_json, "diag results"))
    doc = load_json(args.table, "triton table")
    problem = load_problem("triton", args.table, doc) if isinstance(doc, dict) else "not a JSON object"
    if problem or not doc["configs"]:  # the rule ship_tables.py ships by: a table moekit would read
        raise SystemExit(f"{args.table}: moekit would not read it as a triton table: {problem or 'no entries'}")
    if not rows:
        raise SystemExit(f"{args.diag_json} has no whole-layer rows (what: layer)")
    refused = provenance_problems(rows, args.table, args.measured_on)
    table_configs = {(r["model"], r["tp"], r["M"]): r["table_config"] for r in rows if r.get("table_config")}
    changes, lines, plan_refused = plan(layer_times(rows), table_configs, doc["configs"], args.min_gain)
    refused += plan_refused
    print("\n".join(lines))
    if args.write and changes and not args.note:
        refused.append("--write needs --note (what this run was): the table's only record of the edit")
    if refused:
        print("nothing shipped:\n  " + "\n  ".join(refused), file=sys.stderr)
        return 1
    if args.write and changes:
        for size, (new, us) in changes.items():
            doc["configs"][str(size)] = {**new.to_dict(), **({"us": round(us, 1)} if us is not None else {})}
        meta = doc.setdefault("meta", {})
        meta["command"] = f"{meta['command']}; {args.note}" if meta.get("command") else args.note
        write_json_atomically(args.table, doc)
        print(f"wrote {args.table} ({len(changes)} entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
