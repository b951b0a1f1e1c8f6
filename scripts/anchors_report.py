"""Issue 3's must-hold, read off a run of `gpu_check.sh anchors`: moekit's triton backend against
vLLM's tuned kernel at the anchor points (BENCHMARKS.md, Reference points: an H100 80GB HBM3).

At each point (model, M), from the anchors step's `moekit bench` results (bench.json of
anchors-<mode>-gemm-<model>/ and anchors-<mode>-layer-<model>/) and the reference table:
  - the two expert GEMMs alone: time and efficiency (floor / time, the floor from the ceilings
    measured in the same run) against vLLM's; the must-hold is the efficiency at least vLLM's;
  - the whole layer against vLLM's two GEMMs alone (must-hold: no longer), its efficiency against
    the aim (0.8 at M <= 192, 0.6 at M >= 4096), and what auto ran there;
  - the same layer comparison for the same bytes (vLLM's efficiency over the layer's): layer mode
    times several routings, gemm mode and vLLM's table one each, and at decode sizes the experts a
    routing touches move the bytes by several percent (GLM-4.5V M = 8 on an H100: a floor of 140.2
    µs for the GEMMs' routing, 148.7 over the layer's; BENCHMARKS.md, forty-second session). Shown
    beside the must-hold, which stays the issue's: time.
Prints a table (rich) and the counts; --markdown writes the table for BENCHMARKS.md, --json the
rows for machines.

    python3 scripts/anchors_report.py RESULTS_DIR [RESULTS_DIR ...] [--mode precise|fast]
        [--markdown FILE] [--json FILE]

A later directory's results replace an earlier one's for the same model (calls split over
models). Results of another card than the anchors' are reported with a warning: the reference
points were measured on an H100 80GB HBM3.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "BENCHMARKS.md"
REFERENCE_HEADING = "## Reference points"
ANCHORS_CARD = "NVIDIA H100 80GB HBM3"
# the reference table's model names -> `moekit bench` preset names (as the anchors step runs them)
MODELS = {
    "GLM-4.5V-FP8 TP2": "glm-4.5v-fp8",
    "Mixtral-8x7B FP8": "mixtral-8x7b",
    "DeepSeek-V3 TP8, blocks": "deepseek-v3",
}
DECODE_AIM, PREFILL_AIM = 0.8, 0.6  # issue 3's aim: layer efficiency at M <= 192 / M >= 4096


class ReportError(Exception):
    """Missing or malformed input: the message says which and what was expected."""


def reference_points(path: Path = BENCHMARKS) -> dict[tuple[str, int], dict]:
    """{(model, M): {"floor_us", "vllm_us", "vllm_eff"}} from the Reference points table (eff from
    its floor and time)."""
    text = path.read_text(encoding="utf-8")
    start = text.find(REFERENCE_HEADING)
    if start < 0:
        raise ReportError(f"{path}: no section starting with {REFERENCE_HEADING!r}")
    section = text[start:text.find("\n## ", start + 1)]
    row = re.compile(r"^\| (?P<model>[^|]+?) \| (?P<m>\d+) \| (?P<floor>[\d.]+) \| (?P<us>[\d.]+) \((?P<eff>[\d.]+)\) \|",
                     re.MULTILINE)
    points = {}
    for m in row.finditer(section):
        if m["model"] not in MODELS:
            raise ReportError(f"{path}: reference row of unknown model {m['model']!r}; known: {', '.join(MODELS)}")
        floor, us = float(m["floor"]), float(m["us"])
        # the efficiency from the table's floor and time, not its two-digit rounding
        points[(MODELS[m["model"]], int(m["m"]))] = {"floor_us": floor, "vllm_us": us, "vllm_eff": floor / us}
    if not points:
        raise ReportError(f"{path}: no rows in the Reference points table")
    return points


def load_results(dirs: list[Path], mode: str) -> tuple[dict[tuple[str, str, int, str], dict], set[str]]:
    """({(kind, model, M, backend): bench row}, the devices the rows were measured on), kind
    "gemm" or "layer"; a later directory's file replaces an earlier one's."""
    found: dict[tuple[str, str], Path] = {}
    for d in dirs:
        if not Path(d).is_dir():
            raise ReportError(f"{d}: not a directory (expected the results folder of gpu_check.sh anchors)")
        for f in sorted(Path(d).glob(f"anchors-{mode}-*-*/bench.json")):
            m = re.fullmatch(rf"anchors-{mode}-(gemm|layer)-(.+)", f.parent.name)
            if m:
                found[m.groups()] = f
    if not found:
        raise ReportError(f"no anchors-{mode}-gemm-<model>/bench.json or anchors-{mode}-layer-<model>/bench.json "
                          f"under {', '.join(map(str, dirs))}")
    rows, devices = {}, set()
    for (kind, model), f in found.items():
        try:
            doc = json.loads(f.read_text(encoding="utf-8"))
            devices.add(doc["metadata"]["device"])
            flush = doc["metadata"].get("l2_flush", "zero")  # runs before --l2-flush zeroed, as the reference did
            if flush != "zero":
                raise ReportError(f"{f}: timed with --l2-flush {flush}; the reference points were timed after "
                                  f"zeroing the flush buffer (--l2-flush zero), so the two cannot be compared")
            for r in doc["rows"]:
                rows[(kind, r["model"], int(r["batch_size"]), r["backend"])] = r
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ReportError(f"{f}: not a moekit bench result ({type(e).__name__}: {e})") from None
    return rows, devices


def _us(row: dict | None) -> float | None:
    v = (row or {}).get("median_us")
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _eff(row: dict | None) -> float | None:
    v = (row or {}).get("efficiency")
    return float(v) if isinstance(v, (int, float)) else None


def aim(M: int) -> float | None:
    """Issue 3's aim for the layer's efficiency at this batch size (None between 192 and 4096)."""
    return DECODE_AIM if M <= 192 else PREFILL_AIM if M >= 4096 else None


def compare(reference: dict, rows: dict) -> list[dict]:
    """One record per reference point that the results cover (a point without any of its rows is
    left out; a missing value is None)."""
    out = []
    for (model, M), ref in sorted(reference.items()):
        gemm, layer, auto = (rows.get((kind, model, M, backend)) for kind, backend in
                             (("gemm", "triton"), ("layer", "triton"), ("layer", "auto")))
        if gemm is None and layer is None:
            continue
        g_us, l_us = _us(gemm), _us(layer)
        rec = {"model": model, "M": M, "vllm_us": ref["vllm_us"], "vllm_eff": ref["vllm_eff"],
               "gemms_us": g_us, "gemms_eff": _eff(gemm), "layer_us": l_us, "layer_eff": _eff(layer),
               "auto_us": _us(auto), "auto_ran": (auto or {}).get("chosen") if _us(auto) else None,
               "aim": aim(M)}
        rec["gemms_vs_vllm"] = g_us / ref["vllm_us"] if g_us else None
        rec["layer_vs_vllm"] = l_us / ref["vllm_us"] if l_us else None
        # the must-hold: GEMMs at least as efficient as vLLM's, each against the floor of its own run
        rec["gemms_hold"] = rec["gemms_eff"] is not None and rec["gemms_eff"] >= ref["vllm_eff"]
        rec["layer_hold"] = l_us is not None and l_us <= ref["vllm_us"]
        # the layer's time on vLLM's routing's bytes, over vLLM's time: vLLM's efficiency over the layer's
        rec["layer_vs_vllm_same_bytes"] = ref["vllm_eff"] / rec["layer_eff"] if l_us and rec["layer_eff"] else None
        rec["layer_hold_same_bytes"] = (None if rec["layer_vs_vllm_same_bytes"] is None
                                        else rec["layer_vs_vllm_same_bytes"] <= 1.0)
        rec["aim_met"] = None if rec["aim"] is None or rec["layer_eff"] is None else rec["layer_eff"] >= rec["aim"]
        out.append(rec)
    return out


def counts(records: list[dict]) -> list[str]:
    n = len(records)
    with_aim = [r for r in records if r["aim_met"] is not None]
    return [
        f"GEMMs at least as efficient as vLLM's: {sum(r['gemms_hold'] for r in records)} of {n} points",
        f"whole layer no longer than vLLM's two GEMMs: {sum(r['layer_hold'] for r in records)} of {n} points",
        f"whole layer no longer than vLLM's two GEMMs for the same bytes (vLLM's efficiency over the layer's): "
        f"{sum(bool(r['layer_hold_same_bytes']) for r in records)} of {n} points",
        f"layer efficiency at the aim (0.8 at M <= 192, 0.6 at M >= 4096): "
        f"{sum(r['aim_met'] for r in with_aim)} of {len(with_aim)} points",
    ]


COLUMNS = ("model", "M", "vLLM GEMMs", "GEMMs", "GEMMs / vLLM", "GEMMs eff (vLLM)", "layer", "layer / vLLM",
           "same bytes", "layer eff (aim)", "auto")


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def cells(r: dict) -> list[str]:
    mark = {True: " ok", False: " no", None: ""}
    return [
        r["model"], str(r["M"]), _f(r["vllm_us"], ".1f"), _f(r["gemms_us"], ".1f"), _f(r["gemms_vs_vllm"], ".2f"),
        f"{_f(r['gemms_eff'], '.2f')} ({r['vllm_eff']:.2f}){mark[r['gemms_hold'] if r['gemms_us'] else None]}",
        _f(r["layer_us"], ".1f"), _f(r["layer_vs_vllm"], ".2f") + mark[r["layer_hold"] if r["layer_us"] else None],
        _f(r["layer_vs_vllm_same_bytes"], ".2f") + mark[r["layer_hold_same_bytes"]],
        f"{_f(r['layer_eff'], '.2f')} ({_f(r['aim'], '.1f')}){mark[r['aim_met']]}",
        "-" if r["auto_us"] is None else f"{r['auto_ran']} {r['auto_us']:.1f}",
    ]


def markdown(records: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" if c == "model" else "---:" for c in COLUMNS) + "|"]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in records]
    return "\n".join(lines + [""] + [f"- {c}" for c in counts(records)]) + "\n"


def print_table(records: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in COLUMNS:
        table.add_column(c, justify="left" if c == "model" else "right")
    for r in records:
        table.add_row(*cells(r))
    console = Console()
    console.print(table)
    for c in counts(records):
        console.print(c)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, help="results folders of gpu_check.sh anchors (its $OUT archive, extracted)")
    ap.add_argument("--mode", choices=("precise", "fast"), default="precise", help="which accumulation mode's results")
    ap.add_argument("--markdown", type=Path, help="also write the table and counts as Markdown here")
    ap.add_argument("--json", type=Path, help="also write the records as JSON here")
    args = ap.parse_args(argv)
    try:
        rows, devices = load_results(args.dirs, args.mode)
        records = compare(reference_points(), rows)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if devices != {ANCHORS_CARD}:
        print(f"warning: measured on {', '.join(sorted(devices))}; the reference points are the {ANCHORS_CARD}'s",
              file=sys.stderr)
    print_table(records, f"issue 3's anchor points, {args.mode} mode, on {', '.join(sorted(devices))}")
    if args.markdown:
        args.markdown.write_text(markdown(records), encoding="utf-8")
    if args.json:
        args.json.write_text(json.dumps({"mode": args.mode, "devices": sorted(devices), "records": records}, indent=1) + "\n",
                             encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
