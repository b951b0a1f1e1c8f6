"""`moekit tune`: search the triton backend's launch configs and time every backend, per batch size,
on this GPU; write the tables the triton backend and `auto` read (see moekit.tune.output).

    space.py     the configs searched, and the pruning
    plan.py      options, checked before anything runs
    journal.py   every measurement on disk as it is made: a rerun resumes
    runner.py    measuring, budget, worker processes on several GPUs
    output.py    the triton table, the backend decision table, the vLLM export
    progress.py  progress bars and the summary
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from ..bench import print_wide, default_device
from . import runner
from .plan import (
    TuneInputError,
    TuneOptions,
    TunePlan,
    build_plan,
    parse_budget,
    remove_if_empty,
)
from .progress import (
    ProgressView,
    between_summary,
    summary_table,
    uncovered,
    uncovered_between,
)
from .runner import (
    DeviceBroken,
    Stopped,
    Worker,
    check_out_layout,
    device_name,
    problem_table_name,
    discard_run_lock,
    run_journals,
    run_lock,
    run_workers,
    stop_on_signals,
    write_problem_tables,
)
from .space import hopper_space, interpreter_space


@dataclasses.dataclass
class TuneResult:
    out_dir: Path
    files: list[Path]
    not_covered: list[str]
    # 0 done (or budget used up), 1 a failure stopped it, 130 Ctrl-C, 128 + n stopped by signal n (SIGTERM, SIGHUP)
    exit_code: int


def _devices(opts: TuneOptions, device: torch.device) -> list[str]:
    if opts.devices:
        return list(opts.devices)
    if device.type == "cuda":
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def run_tune(opts: TuneOptions, console=None) -> TuneResult:
    """The whole `moekit tune`; TuneInputError (a BenchInputError) for bad input, nothing written."""
    from rich.console import Console

    console = console or Console()
    device = default_device()
    plan = build_plan(opts, device)
    names = sorted({device_name(torch.device(d)) for d in _devices(opts, device)[: len(plan.batch_sizes)]})
    with contextlib.ExitStack() as held:
        try:
            check_out_layout(plan, names)  # no file where tune keeps a folder, or the other way round
            # refused at once while another run writes into --out; held until the run ends
            held.enter_context(run_lock(plan.out_dir))
        except TuneInputError:
            remove_if_empty(plan.created)  # an --export-vllm folder this run made
            raise
        held.enter_context(stop_on_signals())  # SIGTERM and SIGHUP stop the run as Ctrl-C does
        return _run(opts, plan, device, console)


def _run(opts: TuneOptions, plan: TunePlan, device: torch.device, console) -> TuneResult:
    """The run itself, with --out held (run_lock)."""
    argv = list(sys.argv[1:] if opts.argv is None else opts.argv)
    plan.run_meta["command"] = shlex.join(["moekit", *map(str, argv)])
    devices = _devices(opts, device)
    workers = min(len(devices), len(plan.batch_sizes))
    if workers > 1:  # the compile helpers are shared out among the worker processes (CPU cores)
        plan.compile_workers //= workers
    deadline_end = runner._clock() + plan.budget_s if plan.budget_s is not None else None

    if device.type != "cuda":
        console.print(
            "No CUDA GPU: tuning in the Triton interpreter on a scaled-down shape with a two-config space; "
            "the tables it writes say nothing about a GPU", style="bold yellow", highlight=False,
        )
    for p in plan.problems:
        others = ", ".join(p.backends) or "none"
        console.print(f"{p.label}: {p.shape.describe()}; other backends timed: {others}", highlight=False)
    where = f"{workers} worker processes ({', '.join(devices[:workers])})" if workers > 1 else devices[0]
    console.print(
        f"batch sizes {' '.join(map(str, plan.batch_sizes))} on {where}; search {opts.search_space}; "
        f"budget {opts.budget or 'none'}; journal and tables under {plan.out_dir}", highlight=False,
    )
    if plan.between:
        console.print(f"and every backend between them, at {' '.join(map(str, plan.between))}", highlight=False)

    exit_code, failure = 0, None
    labels = [f"[{d}]" for d in devices[:workers]] if workers > 1 else [""]
    view = ProgressView(console, workers, labels)
    try:
        with view:
            if workers > 1:
                broken = run_workers(plan, devices[:workers], deadline_end, view.on_event)
                if broken:
                    exit_code = 1
            else:
                Worker(plan, torch.device(devices[0]), plan.batch_sizes, view.reporter(0), deadline_end).run()
            if plan.between:  # the sizes between not measured yet (or measured with an older config)
                Worker(plan, torch.device(devices[0]), [], view.reporter(0), deadline_end).run_between()
    except DeviceBroken as e:
        failure, exit_code = str(e), 1
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:  # a worker's own traceback
        failure, exit_code = f"a worker process failed:\n{e}", 1
    except Stopped as e:
        failure, exit_code = f"stopped by {e.name}: rerun the same command to continue where it stopped", 128 + e.signum
    except KeyboardInterrupt:
        failure, exit_code = "interrupted: rerun the same command to continue where it stopped", 130
    finally:
        files, not_covered = _finish(plan, console, sorted(set(view.device_names.values())))
    if failure:
        console.print(f"[red]error:[/] {failure}" if exit_code == 1 else failure, highlight=False, soft_wrap=True)
    if not files:
        if plan.out_dir in plan.created:  # the lock file alone would keep the folder this run made
            discard_run_lock(plan.out_dir)
        remove_if_empty(plan.created)
        exit_code = exit_code or 1
    return TuneResult(plan.out_dir, files, not_covered, exit_code)


def _finish(plan: TunePlan, console, device_names: list[str]) -> tuple[list[Path], list[str]]:
    """Rebuild every table from the journals of this run's conditions, print the summary and what
    was not covered."""
    files: list[Path] = []
    not_covered: list[str] = []

    def log(text: str) -> None:
        console.print(f"  {text}", highlight=False, markup=False, soft_wrap=True)

    for p in plan.problems:
        for name in device_names:
            table_file = problem_table_name(p, name)
            written, notes = write_problem_tables(plan, p, name, log)
            files += written
            journals, _ = run_journals(plan, p, name)
            by_size = {j["batch_size"]: j for j in journals if j["batch_size"] in plan.batch_sizes}
            backend_doc = _read_backend_table(plan.out_dir / "backends" / table_file)
            shown = [by_size[M] for M in plan.batch_sizes if M in by_size]
            if shown:
                print_wide(console, summary_table(f"{p.label} on {name}", shown, backend_doc))
            for note in notes:
                console.print(f"  {note}", highlight=False, soft_wrap=True)
            missing = uncovered(by_size, plan.batch_sizes, p.backends, searched=plan.search_space != "none")
            between = {j["batch_size"]: j for j in journals if j["batch_size"] in plan.between}
            if between:
                console.print(f"  between: {between_summary(between, backend_doc)}", highlight=False, soft_wrap=True)
            missing += uncovered_between(between, plan.between, ["triton", *p.backends])
            not_covered += [f"{p.label}: {line}" for line in missing]
    if plan.search_space == "none":
        console.print("no search ran (--search-space none): the triton configs are those earlier runs left in "
                      f"{plan.out_dir}, or the default config where there are none; --search-space pruned searches",
                      highlight=False, soft_wrap=True)
    if not_covered:
        console.print("[yellow]not covered[/] (rerun the same command, or with a larger --budget, to continue):")
        for line in not_covered:
            console.print(f"  {line}", highlight=False, soft_wrap=True)
    if files:
        console.print("wrote " + ", ".join(str(f) for f in files), highlight=False, soft_wrap=True)
    return files, not_covered


def _read_backend_table(path: Path) -> dict | None:
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


__all__ = [
    "TuneInputError",
    "TuneOptions",
    "TuneResult",
    "hopper_space",
    "interpreter_space",
    "parse_budget",
    "run_tune",
]
