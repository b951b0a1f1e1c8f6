"""`moekit tune`'s refusals before it measures anything: a second run into the same --out while one
runs, the same model given twice; and what its --help says of --backends and --budget."""

from __future__ import annotations

import fcntl
import os

import pytest
from helpers import tiny_mixtral

from moekit.cli import build_parser, main
from moekit.tune import TuneOptions, run_tune, runner
from moekit.tune.journal import PROGRESS_DIR
from moekit.tune.plan import TuneInputError, parse_budget


@pytest.fixture
def tiny_model(tmp_path):
    return tiny_mixtral(tmp_path, experts=4, hidden=128, intermediate=128, layers=2)


def lock_file(out):
    return out / PROGRESS_DIR / runner.RUN_LOCK


def test_a_second_run_into_the_same_out_is_refused_at_once(tmp_path, tiny_model, capsys):
    """Two runs into one --out overwrite each other's journal entries: the second is refused,
    naming the folder and the pid of the run that holds it."""
    out = tmp_path / "out"
    lock_file(out).parent.mkdir(parents=True)
    with open(lock_file(out), "w") as held:  # stands for a run in progress: its lock and its pid
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        assert main(["tune", "--model", str(tiny_model), "--out", str(out), "--batch-sizes", "1"]) == 2
        text = capsys.readouterr()
        lines = [line for line in (text.out + text.err).splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), lines
        assert f"--out {out}:" in lines[0] and "pid 4242" in lines[0]
        assert not (out / "triton").exists()  # nothing measured, nothing written
        with open(lock_file(out)) as f:
            assert f.read() == "4242\n"  # the holder's pid is not erased by the refused run


def test_the_run_lock_is_held_for_the_run_and_released_after(tmp_path, tiny_model, monkeypatch):
    """Held while the run measures, released when it ends, by an exception too; a lock file left
    behind (a crash: flock dies with its process) blocks nothing."""
    out = tmp_path / "out"
    seen = []

    def measuring(self):  # stands for the worker: another run is refused meanwhile
        with pytest.raises(TuneInputError, match=f"pid {os.getpid()}"):
            with runner.run_lock(out):
                pass
        seen.append(True)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.Worker, "run", measuring)
    opts = TuneOptions(models=[str(tiny_model)], batch_sizes=["1"], out=str(out), argv=["tune"], between=False)
    assert run_tune(opts).exit_code == 130 and seen == [True]
    # the folder this run made, with nothing written into it, went with the lock file
    assert not out.exists()
    lock_file(out).parent.mkdir(parents=True)
    lock_file(out).write_text("4242\n")  # a crashed run's file: flock died with its process
    with runner.run_lock(out):  # it blocks nothing
        pass


def test_a_failed_run_keeps_a_folder_it_did_not_make(tmp_path, tiny_model, monkeypatch):
    """Only the folder this run created goes: one that was there stays, lock file and all."""
    out = tmp_path / "out"
    out.mkdir()

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.Worker, "run", interrupted)
    opts = TuneOptions(models=[str(tiny_model)], batch_sizes=["1"], out=str(out), argv=["tune"], between=False)
    assert run_tune(opts).exit_code == 130
    assert out.is_dir() and lock_file(out).exists()


def test_the_same_model_twice_is_refused(tmp_path, tiny_model, capsys):
    """As bench and check refuse it: a run of one model would otherwise pass silently for two."""
    out = tmp_path / "out"
    assert main(["tune", "--model", str(tiny_model), "--model", str(tiny_model), "--out", str(out)]) == 2
    line = capsys.readouterr().out.strip()
    assert line.startswith("error: --model: the same model is given twice") and "\n" not in line
    assert not out.exists()


def test_tune_help_says_what_the_cpu_times_and_that_plain_seconds_work():
    tune = build_parser()._subparsers._group_actions[0].choices["tune"]
    helps = {a.dest: a.help for a in tune._actions}
    assert "on the CPU reference too" in helps["backends"] and "on a GPU reference only when named" in helps["backends"]
    assert "plain seconds" in helps["budget"] and parse_budget("600") == 600
