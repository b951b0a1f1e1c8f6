"""What `moekit tune` shows: a rich progress bar per worker while it runs (problem, batch size,
configs left, ETA), and at the end a summary per table and what the run did not cover."""

from __future__ import annotations

from typing import Self

from rich import box
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from ..backends.triton.config import KernelConfig
from ..bench import format_us
from .output import GEMM2_FIELDS, best_config, chosen_config, decision_is_current, incumbent_key


class LocalReporter:
    """The Reporter of a worker running in this process."""

    def __init__(self, view: ProgressView, worker: int):
        self.view, self.worker = view, worker

    def device(self, name: str) -> None:
        self.view.on_event(self.worker, "device", name)

    def add_total(self, count: int) -> None:
        self.view.on_event(self.worker, "add_total", count)

    def describe(self, text: str) -> None:
        self.view.on_event(self.worker, "describe", text)

    def advance(self) -> None:
        self.view.on_event(self.worker, "advance")

    def log(self, text: str) -> None:
        self.view.on_event(self.worker, "log", text)


class ProgressView:
    """One bar per worker; the ETA is rich's, from the pace so far and the measurements planned
    (the plan shrinks as neighbour pruning drops configs)."""

    def __init__(self, console, workers: int, labels: list[str]):
        self.console = console
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=True,
        )
        self.labels = labels
        self.tasks: dict[int, int] = {}
        self.totals: dict[int, int] = {}
        self.done: dict[int, int] = {}
        self.device_names: dict[int, str] = {}

    def __enter__(self) -> Self:
        self.progress.start()
        for worker, label in enumerate(self.labels):
            self.tasks[worker] = self.progress.add_task(label, total=None)
            self.totals[worker] = self.done[worker] = 0
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def reporter(self, worker: int) -> LocalReporter:
        return LocalReporter(self, worker)

    def on_event(self, worker: int, kind: str, *args) -> None:
        task = self.tasks[worker]
        if kind == "device":
            self.device_names[worker] = args[0]
        elif kind == "add_total":
            self.totals[worker] = max(self.totals[worker] + args[0], self.done[worker])
            self.progress.update(task, total=self.totals[worker])
        elif kind == "describe":
            self.progress.update(task, description=f"{self.labels[worker]}: {args[0]}")
        elif kind == "advance":
            self.done[worker] += 1
            self.progress.advance(task)
        elif kind == "log":
            self.progress.console.print(f"  {args[0]}", style="dim", highlight=False, markup=False, soft_wrap=True)
        elif kind == "broken":
            self.progress.console.print(f"[red]error:[/] {escape(args[0])}", highlight=False, soft_wrap=True)


# ------------------------------------------------------------------------------- summary


def _config_text(cfg: dict) -> str:
    if cfg.get("GEMV"):  # the GEMV path: no row tiles, no tile order; stages only where its K loops are pipelined
        gemv = KernelConfig.from_dict(cfg)
        text = f"GEMV N{gemv.BLOCK_N} K{gemv.BLOCK_K} w{gemv.num_warps}" + (f" s{gemv.num_stages}" if gemv.num_stages > 1 else "")
        text += " late" if gemv.GEMV == 2 else ""  # GEMM1 reducing once after its K loop
        if gemv.has_gemm2:  # GEMM2's own column block and warps, and depth where its own
            g2 = gemv.gemm2()
            text += f" + GEMM2 N{g2.BLOCK_N} w{g2.num_warps}" + (f" s{g2.num_stages}" if gemv.num_stages2 else "")
        return text
    text = (f"M{cfg['BLOCK_M']} N{cfg['BLOCK_N']} K{cfg['BLOCK_K']} G{cfg['GROUP_M']} "
            f"w{cfg['num_warps']} s{cfg['num_stages']}")
    gemm2 = KernelConfig.from_dict(cfg)
    if gemm2.OVERLAP:
        text += " Gluon"
    if gemm2.has_gemm2:  # GEMM2's own launch (tuner's GEMM2 step), after a "+"
        g2 = gemm2.gemm2()
        text += f" + GEMM2 N{g2.BLOCK_N}" + (f" K{g2.BLOCK_K}" if gemm2.BLOCK_K2 else "") + \
            f" G{g2.GROUP_M} w{g2.num_warps} s{g2.num_stages}"
        if g2.N_TILES2:
            text += f" x{g2.N_TILES2} tiles per program"
        if g2.OVERLAP2:
            text += " Gluon"
        if g2.KEEP_A2:  # the run keeps its row block's activations
            text += " keeping A"
    return text


def summary_table(title: str, journals: list[dict], backend_doc: dict | None) -> Table:
    """Per batch size: the best config, its µs, the default config's, the gain, the µs of the
    config used before (a table's, runner.Worker._incumbents: "-" where none was), the winner."""
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for head in ("M", "best triton config", "µs", "default µs", "gain", "before µs", "winner", "winner µs", "configs"):
        table.add_column(head, justify="left" if head in ("best triton config", "winner") else "right")
    decisions = (backend_doc or {}).get("batch_sizes", {})
    for j in journals:
        best = chosen_config(j)
        default = j["configs"].get(j.get("default") or "", {})
        before = j["configs"].get(incumbent_key(j) or "", {})
        decision = decisions.get(str(j["batch_size"]), {})
        winner = decision.get("winner")
        search = j.get("search") or {}
        measured = sum(1 for v in j["configs"].values() if "us" in v)
        failed = len(j["configs"]) - measured
        status = f"{measured} timed" + (f", {failed} failed" if failed else "")
        if not search:
            status += ", not searched"
        elif not search.get("complete"):
            status += ", stopped early"
        gain = None
        if best and default.get("us"):
            gain = f"{default['us'] / best[1]['us']:.2f}x"
        table.add_row(
            str(j["batch_size"]),
            _config_text(best[1]["config"]) if best else "-",
            format_us(best[1]["us"]) if best else "-",
            format_us(default.get("us")),
            gain or "-",
            format_us(before.get("us")),
            winner or "-",
            format_us(decision.get("us", {}).get(winner)) if winner else "-",
            status,
        )
    return table


def uncovered(journals_by_size: dict[int, dict], batch_sizes: list[int], backends: list[str],
              searched: bool = True) -> list[str]:
    """What was asked for and not measured, one line per batch size. `searched=False`
    (--search-space none): the search was not asked for, so an absent or partial one is not
    listed (rerunning the same command would never add it)."""
    lines = []
    for M in batch_sizes:
        j = journals_by_size.get(M)
        if j is None:
            lines.append(f"M={M}: nothing measured")
            continue
        missing = []
        if j.get("default") not in j["configs"]:
            missing.append("default config")
        missing += [name for name in backends if name not in j["backends"]]
        search = j.get("search")
        if searched and search is None:
            missing.append("the search")
        elif searched and not search.get("complete"):
            timed = sum(1 for v in j["configs"].values() if not KernelConfig.from_dict(v["config"]).is_gemm2_variant)
            missing.append(f"part of the search ({timed} configs measured, {search['candidates']} candidates)")
        if best_config(j) is not None and not decision_is_current(j):
            missing.append(_decision_missing(j))
        for field in GEMM2_FIELDS:  # runner.gemm2_bases
            gemm2 = j.get(field)
            if gemm2 is not None and not gemm2.get("complete"):
                timed = sum(1 for k in j["configs"] if k.startswith(gemm2["base"] + "+"))  # space.config_key
                missing.append(f"part of GEMM2's launch variants of {gemm2['base']} ({timed} of {gemm2['variants']} measured)")
        if missing:
            lines.append(f"M={M}: not measured: {', '.join(missing)}")
    return lines


def _decision_missing(j: dict) -> str:
    """What a size lacks without a current decision timing, and what its table keeps meanwhile."""
    keeps = chosen_config(j)[0]
    return f"the decision timing of its fastest configs (the table keeps {keeps} there meanwhile)"


def between_summary(journals_by_size: dict[int, dict], backend_doc: dict | None) -> str:
    """One line: each between size's winner and its µs, e.g. 'M=728 cutlass 801.2'."""
    decisions = (backend_doc or {}).get("batch_sizes", {})
    parts = []
    for M in sorted(journals_by_size):
        decision = decisions.get(str(M), {})
        winner = decision.get("winner")
        parts.append(f"M={M} {winner} {format_us(decision['us'][winner])}" if winner else f"M={M} -")
    return ", ".join(parts)


def uncovered_between(journals_by_size: dict[int, dict], sizes: list[int], backends: list[str]) -> list[str]:
    """Between sizes (moekit.tune.plan.between_sizes) where a backend was not timed."""
    lines = []
    for M in sizes:
        j = journals_by_size.get(M)
        triton_timed = j is not None and best_config(j) is not None
        missing = [n for n in backends if j is None or (not triton_timed if n == "triton" else n not in j["backends"])]
        if triton_timed and not decision_is_current(j):
            missing.append(_decision_missing(j))
        if missing:
            lines.append(f"M={M} (between): not measured: {', '.join(missing)}")
    return lines


__all__ = ["LocalReporter", "ProgressView", "between_summary", "summary_table", "uncovered", "uncovered_between"]
