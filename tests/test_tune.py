"""`moekit tune`: the search space and its pruning, the tables it writes (both formats key by key,
the vLLM export), resuming after a kill, failing configs, the budget, worker processes, bad input.

On the CPU the Triton kernels run in the interpreter on a tiny layer (E=4, H=128, N=128, top-2)
with a two-config space. Tests that need a known winner replace the timing function
(`moekit.tune.runner.measure_time`) by `FakeTimer`: deterministic times, optionally still running
the layer, optionally failing, killing the run, or advancing a fake clock.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import itertools
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import time
import types

import torch
from helpers import tiny_mixtral
from rich.console import Console

from moekit.backends import backend_names
from moekit.backends.triton import launch
from moekit.backends.triton.config import KernelConfig, default_config, get_config
from moekit.inputs import make_weights
from moekit.cli import main
from moekit.spec import BF16, FP8_BLOCK128, FP8_CHANNEL_TOKEN, MoEShape, get_scheme
from moekit.tables import CONFIG_DIR_ENV, table_name
from moekit.weights import empty_weights
from moekit.timing import FLUSH_METHOD, Timing
from moekit.tune import (
    TuneOptions,
    output,
    parse_budget,
    precompile,
    run_tune,
    runner,
    space,
)
from moekit.tune.plan import TuneInputError, between_sizes
from moekit.tune.space import NeighbourResult, config_key, interpreter_space

CUDA = torch.cuda.is_available()
SHAPE = MoEShape(4, 128, 128, 2)  # the tiny model's layer (the same on the CPU: no scaling needed)
SIZES = ["1", "4"]
BACKEND_META_KEYS = {
    "device_name", "num_experts", "hidden", "intermediate", "top_k", "scheme", "dtype", "routing", "mode",
    "moekit", "torch", "triton", "date",
}
CONFIG_FIELDS = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "JOIN", "GEMV"]
VLLM_FIELDS = ["BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages"]


class Killed(BaseException):
    """Stands for a kill: not an Exception, so nothing in the tuner records it as a failure."""


DECIDE = runner.Worker._decide


def agreeing_decision(self, p, j):
    """Stands for a decision timing that agreed with the separate timings: its record, with the
    candidates' separate times and no backend's (so the decision table keeps the separate
    timings), and nothing measured."""
    candidates = output.decision_candidates(j.data)
    if candidates and not output.decision_is_current(j.data):
        j.data["decision"] = {"config": candidates[0], "candidates": candidates, "routings": self.plan.routings,
                              "triton_us": {k: j.config(k)["us"] for k in candidates}, "us": {}}
        j.save()


@pytest.fixture(autouse=True)
def no_decision_timing(monkeypatch):
    """The decision timing (runner.Worker._decide) measures nothing in the tests of everything
    else, whose expected calls and tables are those of the separate timings: it records that it
    agreed with them (agreeing_decision). The tests of the decision timing turn it back on
    (`decisions_on`); `decisions_off` leaves it out entirely (a budget cut before it)."""
    monkeypatch.setattr(runner.Worker, "_decide", agreeing_decision)


def decisions_on(monkeypatch):
    monkeypatch.setattr(runner.Worker, "_decide", DECIDE)


def decisions_off(monkeypatch):
    monkeypatch.setattr(runner.Worker, "_decide", lambda self, p, j: None)


@pytest.fixture(autouse=True)
def cpu_gemm2_grid(monkeypatch):
    """GEMM2's launch variants of the CPU (space.GEMM2_GRID_CPU, GEMM2_RUNS_CPU) on a GPU too: the
    tests name those variants (FAST_GEMM2, OTHER_GEMM2, WIDE_GEMM2: 32-wide GEMM2 launches, which
    the GPU's grid has none of), count them and patch them; on a GPU the plan would take the
    36-launch GEMM2_GRID_GPU with runs of 8. Read when the plan is made, so that a test's own
    patch of the CPU grid applies. Nothing changes on the CPU; the GPU grid itself is named in
    test_config_from_key_inverts_config_key."""
    if CUDA:
        from moekit.tune import plan

        monkeypatch.setattr(plan, "gemm2_grid", lambda device: space.gemm2_grid(torch.device("cpu")))


@pytest.fixture
def tiny_model(tmp_path):
    return tiny_mixtral(tmp_path, experts=4, hidden=128, intermediate=128, layers=2)


def tune(tiny_model, out, scheme="fp8-channel-token", **kw):
    """run_tune on the tiny model with the two-config space; returns (result, printed text).
    GEMM2's own launch search is off unless asked for (gemm2=True): the tests of everything else
    count measurements, and that step has tests of its own.
    On a GPU machine: one worker, in this process, on cuda:0 (on a host of several GPUs the default
    is a worker process per GPU, which the tests' monkeypatches, FakeTimer's included, never
    reach), compiling in that process (the default there is up to 8 helper processes with a CUDA
    context each, started anew by every call). Both are what the CPU does by default."""
    if CUDA:
        kw.setdefault("devices", ["cuda:0"])
        kw.setdefault("compile_workers", 0)
    buf = io.StringIO()
    opts = TuneOptions(models=[str(tiny_model)], scheme=scheme, batch_sizes=kw.pop("batch_sizes", SIZES), reps=1,
                       warmup=0, out=str(out), space=kw.pop("space", interpreter_space), argv=["tune"],
                       gemm2=kw.pop("gemm2", False), **kw)
    result = run_tune(opts, Console(file=buf, width=200, no_color=True))
    return result, buf.getvalue()


def read(path):
    return json.loads(path.read_text())


def only_file(folder):
    """The one table in `folder` (copies of earlier tables kept by output._write_keeping aside)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and ".bak-" not in p.name)
    assert len(files) == 1, files
    return files[0]


def backups_of(path):
    """The copies kept of `path` before it was replaced (output._backup_name), oldest first."""
    return sorted(path.parent.glob(path.name + ".bak-*"), key=lambda p: p.stat().st_mtime_ns)


def journals(out):
    folder = only_file_dir(out / ".progress")
    return {int(p.stem.removeprefix("M=")): read(p) for p in folder.glob("M=*.json") if "stale" not in p.name}


def only_file_dir(folder):
    dirs = [p for p in folder.iterdir() if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


class FakeTimer:
    """Replaces runner.measure_time: `us[what]` (else `default_us`) as the median; `run`: call the
    layer once first; `fail[what]`: raise that message; `kill_after`: raise Killed once that many
    measurements are done; `step`: seconds the fake clock advances per measurement."""

    def __init__(self, us=None, default_us=100.0, run=False, fail=None, kill_after=None, step=0.0):
        self.us, self.default_us, self.run = us or {}, default_us, run
        self.fail, self.kill_after, self.step = fail or {}, kill_after, step
        self.calls: list[str] = []
        self.now = 1000.0

    def __call__(self, fn, *, reps, warmup, device, what):
        if self.kill_after is not None and len(self.calls) >= self.kill_after:
            raise Killed(what)
        self.calls.append(what)  # "triton <key> at M=4", "backend torch at M=1"
        self.now += self.step
        self.current = base = what.removeprefix("decision: ").split(" at M=")[0]
        if self.run:
            fn()
        if base in self.fail:
            raise RuntimeError(self.fail[base])
        return Timing.from_samples([self.us.get(base, self.default_us)], "fake")

    def clock(self):
        return self.now

    def many(self, fns, *, reps, warmup, device, what, before_each=None):
        """Replaces runner.measure_times (the decision timing): each closure as `self` times one,
        its call recorded as "decision: <what>"; a failure is that closure's result."""
        out = {}
        for name, fn in fns.items():
            if self.run and before_each is not None:
                before_each(name)
            try:
                out[name] = self(fn, reps=reps, warmup=warmup, device=device, what=f"decision: {what[name]}")
            except RuntimeError as e:
                out[name] = e
        return out

    def install(self, monkeypatch):
        monkeypatch.setattr(runner, "measure_times", self.many)
        monkeypatch.setattr(runner, "measure_time", self)
        monkeypatch.setattr(runner, "_clock", self.clock)
        monkeypatch.setattr(runner, "get_ceilings", lambda device: None)  # fake times: no floor check on a GPU
        return self


def triton(cfg: KernelConfig) -> str:
    return f"triton {config_key(cfg)}"


FAST_CFG = KernelConfig(16, 32, 128, 1, 4, 2)  # in interpreter_space for the FP8 schemes
OTHER_CFG = KernelConfig(16, 64, 128, 8, 4, 3)


# ------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("scheme", [FP8_CHANNEL_TOKEN, FP8_BLOCK128, BF16], ids=lambda s: s.name)
def test_tune_writes_valid_tables_and_vllm_export(tmp_path, tiny_model, scheme):
    out, export = tmp_path / "out", tmp_path / "vllm"
    result, text = tune(tiny_model, out, scheme.name, export_vllm=str(export), gemm2=True)
    assert result.exit_code == 0, text
    assert result.not_covered == []

    triton_file = only_file(out / "triton")
    backend_file = only_file(out / "backends")
    assert triton_file.name == backend_file.name
    t, b = read(triton_file), read(backend_file)
    device = b["meta"]["device_name"]
    assert triton_file.name == f"E=4,N=128,H=128,device_name={device.replace(' ', '_')},scheme={scheme.name}.json"
    js = journals(out)
    assert sorted(js) == [1, 2, 4]  # 2: between the tuned sizes (backends only)

    # the backend decision table, key by key (moekit.decisions reads exactly this)
    assert list(b) == ["format", "version", "meta", "batch_sizes"]
    assert b["format"] == "moekit-backend-table" and b["version"] == 1
    assert set(b["meta"]) == BACKEND_META_KEYS
    meta = b["meta"]
    assert (meta["num_experts"], meta["hidden"], meta["intermediate"], meta["top_k"]) == (4, 128, 128, 2)
    assert (meta["scheme"], meta["dtype"], meta["routing"], meta["mode"]) == (scheme.name, "bfloat16", "uniform", "layer")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d.*", meta["date"])
    assert device == ("cpu" if not CUDA else torch.cuda.get_device_name())
    assert list(b["batch_sizes"]) == ["1", "2", "4"]
    for m, entry in b["batch_sizes"].items():
        assert set(entry) <= {"us", "winner", "errors"}
        assert "triton" in entry["us"] and set(entry["us"]) <= set(backend_names())
        assert all(isinstance(v, float) and v > 0 for v in entry["us"].values())
        assert entry["winner"] == min(entry["us"], key=entry["us"].get)
        j = js[int(m)]
        if m == "2":  # between: triton timed with the best config of each tuned size around it
            around = list(dict.fromkeys(config_key(KernelConfig.from_dict(t["configs"][n])) for n in ("1", "4")))
            assert j["between_configs"] == around and sorted(j["configs"]) == sorted(around)
            assert "triton" not in j["backends"] and not j.get("search")
        # triton's time is its fastest measured config's; the others as measured
        assert entry["us"]["triton"] == min(v["us"] for v in j["configs"].values() if "us" in v)
        assert {k: v for k, v in entry["us"].items() if k != "triton"} == {k: v["us"] for k, v in j["backends"].items()}

    # the triton table: the fastest config and its µs per batch size, and metadata
    assert list(t) == ["meta", "configs"] and list(t["configs"]) == ["1", "2", "4"]  # 2: the faster neighbour config
    assert t["meta"]["incomplete_batch_sizes"] == []  # a size between is not a search cut short
    for key in ("device_name", "num_experts", "hidden", "intermediate", "top_k", "scheme", "routing", "moekit",
                "torch", "triton", "date"):
        assert t["meta"][key] == b["meta"][key] or key == "date"
    for m, entry in t["configs"].items():
        # GEMM2's own launch fields appear only where the best config has one (KernelConfig.to_dict)
        assert [k for k in entry if k not in KernelConfig.GEMM2_FIELDS + KernelConfig.GEMM2_ONLY] == [*CONFIG_FIELDS, "us", "default_us"]
        assert not KernelConfig.from_dict(entry).problems(scheme)
        j = js[int(m)]
        best = min((v["us"], k) for k, v in j["configs"].items() if "us" in v)
        assert entry["us"] == best[0] and config_key(KernelConfig.from_dict(entry)) == best[1]
        if m == "2":
            assert entry["default_us"] is None  # the default config is not timed between
        else:
            assert entry["default_us"] == j["configs"][config_key(default_config(SHAPE, scheme, int(m)))]["us"]

    # the vLLM export: vLLM's file name and format exactly
    vllm = only_file(export)
    dtype = {"fp8-channel-token": ",dtype=fp8_w8a8", "fp8-block128": ",dtype=fp8_w8a8,block_shape=[128,128]",
             "bf16": ""}[scheme.name]
    assert vllm.name == f"E=4,N=128,device_name={output.vllm_device_name(device)}{dtype}.json"
    exported = read(vllm)
    assert list(exported) == [m for m in ("1", "2", "4") if m in exported] and exported
    for m, cfg in exported.items():
        assert list(cfg) == VLLM_FIELDS and all(type(v) is int for v in cfg.values())
        ours = KernelConfig(cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"] // 2, cfg["BLOCK_SIZE_K"], cfg["GROUP_SIZE_M"],
                            cfg["num_warps"], cfg["num_stages"])
        assert "us" in js[int(m)]["configs"][config_key(ours)]  # a measured config, BLOCK_SIZE_N = 2 * BLOCK_N
        if scheme.block:
            assert cfg["BLOCK_SIZE_N"] % 128 == 0 and cfg["BLOCK_SIZE_K"] == 128


def test_backend_table_loads_in_the_decisions_reader(tmp_path, tiny_model, monkeypatch):
    decisions = pytest.importorskip("moekit.decisions")
    FakeTimer().install(monkeypatch)
    result, _ = tune(tiny_model, tmp_path / "out")
    assert result.exit_code == 0
    table = decisions.load_table(only_file(tmp_path / "out" / "backends"), SHAPE, FP8_CHANNEL_TOKEN)
    assert table.sizes == (1, 2, 4)  # 2: between the tuned sizes


@pytest.mark.skipif(CUDA, reason="the CLI searches the device's space: on a GPU the whole Hopper space")
def test_cli_tune_end_to_end(tmp_path, tiny_model, monkeypatch, capsys):
    FakeTimer().install(monkeypatch)
    out = tmp_path / "out"
    argv = ["tune", "--model", str(tiny_model), "--scheme", "bf16", "--batch-sizes", "1,4", "--reps", "1",
            "--warmup", "0", "--out", str(out), "--budget", "1h", "--export-vllm", str(tmp_path / "v")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "gain" in text and "winner" in text  # the summary table
    assert only_file(out / "triton").name.endswith("scheme=bf16.json")
    assert read(only_file(out / "triton"))["meta"]["command"] == "moekit " + " ".join(argv)


# ------------------------------------------------------------------ tuned configs are used


def test_tuned_configs_are_picked_up_through_MOEKIT_CONFIG_DIR(tmp_path, tiny_model, monkeypatch):
    FakeTimer(us={triton(FAST_CFG): 10.0}).install(monkeypatch)  # a config other than the default wins
    out = tmp_path / "out"
    result, _ = tune(tiny_model, out)
    assert result.exit_code == 0
    device = read(only_file(out / "backends"))["meta"]["device_name"]
    monkeypatch.delenv(CONFIG_DIR_ENV, raising=False)
    for m in (1, 4):
        assert default_config(SHAPE, FP8_CHANNEL_TOKEN, m) != FAST_CFG
        assert get_config(SHAPE, FP8_CHANNEL_TOKEN, m, device) == default_config(SHAPE, FP8_CHANNEL_TOKEN, m)
    monkeypatch.setenv(CONFIG_DIR_ENV, str(out))
    for m in (1, 4, 3000):  # 3000: the nearest tuned size, 4
        assert get_config(SHAPE, FP8_CHANNEL_TOKEN, m, device) == FAST_CFG


def test_a_process_that_looked_a_table_up_sees_the_one_tune_writes(tmp_path, tiny_model, monkeypatch):
    """get_config remembers the tables it found (moekit.tables.memoized); a tune in the same
    process writing into MOEKIT_CONFIG_DIR makes the next lookup see its table."""
    out = tmp_path / "out"
    monkeypatch.setenv(CONFIG_DIR_ENV, str(out))
    FakeTimer(us={triton(FAST_CFG): 10.0}).install(monkeypatch)
    device = "cpu" if not CUDA else torch.cuda.get_device_name()  # the device name tune files tables under
    assert get_config(SHAPE, FP8_CHANNEL_TOKEN, 4, device) == default_config(SHAPE, FP8_CHANNEL_TOKEN, 4)
    result, _ = tune(tiny_model, out)
    assert result.exit_code == 0
    assert read(only_file(out / "backends"))["meta"]["device_name"] == device
    assert get_config(SHAPE, FP8_CHANNEL_TOKEN, 4, device) == FAST_CFG


def test_each_measurement_runs_the_config_it_is_filed_under(tmp_path, tiny_model, monkeypatch):
    timer = FakeTimer(run=True).install(monkeypatch)
    seen: list[tuple[str, str | None]] = []
    real_run = launch.TritonBackend.run

    def spy(self, x, weights, topk_weights, topk_ids, config=None):
        seen.append((timer.current, config_key(config) if config else None))
        return real_run(self, x, weights, topk_weights, topk_ids, config=config)

    monkeypatch.setattr(launch.TritonBackend, "run", spy)
    tune(tiny_model, tmp_path / "out", batch_sizes=["1"])
    triton_calls = [(what, key) for what, key in seen if what.startswith("triton ")]
    assert {what for what, _ in triton_calls} == {w.split(" at M=")[0] for w in timer.calls if w.startswith("triton ")}
    # the first call of each measurement is the timed one: forced to its own config (a later call
    # with the default config is the reference of the output check)
    first = {}
    for what, key in triton_calls:
        first.setdefault(what, key)
    assert all(what == f"triton {key}" for what, key in first.items())


# A config outside interpreter_space (so the search never reaches it): a table's, the incumbent.
TABLE_CFG = KernelConfig(32, 32, 128, 4, 4, 2)


def write_table_of(folder, configs: dict[int, KernelConfig], device: str):
    """A triton table of the tiny model's layer on `device` in `folder`/triton, as tune writes one."""
    path = folder / "triton" / table_name(SHAPE, FP8_CHANNEL_TOKEN, device)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"meta": {"top_k": SHAPE.top_k},
                                "configs": {str(m): c.to_dict() for m, c in configs.items()}}))
    return path


@pytest.mark.parametrize("fastest", [True, False])
def test_the_config_a_table_gave_before_is_timed_and_kept_where_fastest(fastest, tmp_path, tiny_model, monkeypatch):
    """A tune that replaces a table (an H100's own replacing the H200's it borrowed, say) times the
    config the backend ran at each size before it, beside the default: the new table keeps it
    where it is the fastest, so no budget, however short, writes a slower table."""
    decisions_on(monkeypatch)  # a config replaces the incumbent once the decision timing confirms it
    device = torch.cuda.get_device_name() if CUDA else "cpu"  # the name tune files tables under
    assert TABLE_CFG not in interpreter_space(FP8_CHANNEL_TOKEN) and not TABLE_CFG.problems(FP8_CHANNEL_TOKEN)
    write_table_of(tmp_path / "before", {1: TABLE_CFG, 4: TABLE_CFG}, device)
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path / "before"))
    us = {triton(FAST_CFG): 40.0, triton(TABLE_CFG): 30.0 if fastest else 50.0}
    timer = FakeTimer(us=us, run=True).install(monkeypatch)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out)
    assert result.exit_code == 0
    # timed once per size (M=2: the size between 1 and 4), and ran as itself (run=True: a config
    # that cannot run is recorded failed), then again in each size's decision timing
    timed = [w for w in timer.calls if w.startswith(triton(TABLE_CFG))]
    assert sorted(w for w in timer.calls if w.startswith(f"decision: {triton(TABLE_CFG)}")) == sorted(
        f"decision: {triton(TABLE_CFG)} at M={m}" for m in (1, 2, 4))
    assert sorted(timed) == sorted(f"{triton(TABLE_CFG)} at M={m}" for m in (1, 2, 4))
    for j in journals(out).values():
        assert j["incumbent"] == {"key": config_key(TABLE_CFG), "config": TABLE_CFG.to_dict()}
        assert j["configs"][config_key(TABLE_CFG)]["us"] == us[triton(TABLE_CFG)]
    winner = TABLE_CFG if fastest else FAST_CFG
    table = read(only_file(out / "triton"))["configs"]
    assert {m: KernelConfig.from_table_entry(e) for m, e in table.items()} == {m: winner for m in ("1", "2", "4")}
    assert re.search(r"before µs", text) and text.count(f" {us[triton(TABLE_CFG)]:.1f} ") >= len(SIZES)

    # a rerun finds it measured: nothing is timed again
    again = FakeTimer(us=us).install(monkeypatch)
    tune(tiny_model, out)
    assert not [w for w in again.calls if w.startswith(triton(TABLE_CFG))]


def test_an_unconfirmed_config_does_not_replace_the_incumbent(tmp_path, tiny_model, monkeypatch):
    """Where no current decision timing confirmed a faster config (a budget cut before it, a
    journal of an older moekit), the table keeps the config used before, however fast another
    config's separate timing was: the separate timings misranked configs on an H100."""
    decisions_off(monkeypatch)
    device = torch.cuda.get_device_name() if CUDA else "cpu"
    write_table_of(tmp_path / "before", {1: TABLE_CFG, 4: TABLE_CFG}, device)
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path / "before"))
    FakeTimer(us={triton(FAST_CFG): 10.0, triton(TABLE_CFG): 50.0}).install(monkeypatch)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, between=False)
    assert all("decision" not in j for j in journals(out).values())
    table = read(only_file(out / "triton"))["configs"]
    assert {m: KernelConfig.from_table_entry(e) for m, e in table.items()} == {m: TABLE_CFG for m in SIZES}
    # and the run says so: rerun to confirm the faster config
    keeps = f"the decision timing of its fastest configs (the table keeps {config_key(TABLE_CFG)} there meanwhile)"
    assert len(result.not_covered) == len(SIZES) and all(keeps in line for line in result.not_covered)
    # without an incumbent, the fastest separate timing stands
    FakeTimer(us={triton(FAST_CFG): 10.0}).install(monkeypatch)
    monkeypatch.delenv(CONFIG_DIR_ENV)
    tune(tiny_model, tmp_path / "out2", between=False)
    table = read(only_file(tmp_path / "out2" / "triton"))["configs"]
    assert {m: KernelConfig.from_table_entry(e) for m, e in table.items()} == {m: FAST_CFG for m in SIZES}


def test_the_incumbent_is_confirmed_however_it_ranked_alone(tmp_path, tiny_model, monkeypatch):
    """The decision timing runs the incumbent even when its separate timing ranked it below the
    CONFIRMED_CONFIGS fastest, and it stays where it wins there."""
    decisions_on(monkeypatch)
    monkeypatch.setattr(output, "CONFIRMED_CONFIGS", 1)
    device = torch.cuda.get_device_name() if CUDA else "cpu"
    write_table_of(tmp_path / "before", {4: TABLE_CFG}, device)
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path / "before"))
    timer = FakeTimer(us={triton(FAST_CFG): 10.0, triton(TABLE_CFG): 50.0})
    timer.install(monkeypatch)

    def many(fns, **kw):  # over the routings the incumbent is the faster
        out = timer.many(fns, **kw)
        out[triton(TABLE_CFG)] = Timing.from_samples([30.0], "fake")
        out[triton(FAST_CFG)] = Timing.from_samples([90.0], "fake")
        return out

    monkeypatch.setattr(runner, "measure_times", many)
    out = tmp_path / "out"
    tune(tiny_model, out, batch_sizes=["4"], between=False)
    decision = journals(out)[4]["decision"]
    assert decision["candidates"] == [config_key(FAST_CFG), config_key(TABLE_CFG)]
    assert decision["config"] == config_key(TABLE_CFG)
    assert KernelConfig.from_table_entry(read(only_file(out / "triton"))["configs"]["4"]) == TABLE_CFG


def test_the_last_size_is_confirmed_when_the_budget_ends_in_its_search(tmp_path, tiny_model, monkeypatch):
    """The last size's share of the budget ends at the deadline: its decision timing runs after
    it all the same (seconds), else its search could never replace the incumbent."""
    decisions_on(monkeypatch)
    device = torch.cuda.get_device_name() if CUDA else "cpu"
    write_table_of(tmp_path / "before", {1: TABLE_CFG, 4: TABLE_CFG}, device)
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path / "before"))
    monkeypatch.setattr(space, "GEMM2_GRID_CPU", ((32, 4, 2), (64, 4, 3), (32, 2, 3), (64, 2, 2), (32, 4, 4)))
    timer = FakeTimer(us={triton(FAST_CFG): 10.0, triton(TABLE_CFG): 50.0}, step=10.0).install(monkeypatch)
    out = tmp_path / "out"
    start = timer.now
    result, text = tune(tiny_model, out, budget="210s", backends=["torch"], gemm2=True, between=False)
    js = journals(out)
    decided_at = timer.calls.index(f"decision: {triton(FAST_CFG)} at M=4")
    assert start + 10.0 * decided_at >= start + 210  # after the deadline
    assert js[4]["decision"]["config"] == config_key(FAST_CFG)
    table = read(only_file(out / "triton"))["configs"]
    assert KernelConfig.from_table_entry(table["4"]) == FAST_CFG


def test_every_triton_candidate_failing_in_the_decision_timing(tmp_path, tiny_model, monkeypatch):
    """No triton config ran in the decision timing: the decision table says triton failed there
    (auto takes another backend), the triton table keeps its config, and the run goes on."""
    decisions_on(monkeypatch)
    monkeypatch.setattr(runner.Worker, "_check_device", lambda self, what: None)
    timer = FakeTimer(us={triton(FAST_CFG): 10.0})
    timer.install(monkeypatch)

    def many(fns, **kw):
        out = timer.many(fns, **kw)
        return {name: RuntimeError("too many resources requested") if name.startswith("triton ") else t
                for name, t in out.items()}

    monkeypatch.setattr(runner, "measure_times", many)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, backends=["torch"], batch_sizes=["4"], between=False)
    assert result.exit_code == 0, text
    decision = journals(out)[4]["decision"]
    assert decision["errors"] == {"triton": "RuntimeError: too many resources requested"}
    assert set(decision["triton_errors"]) == set(decision["candidates"]) and "triton" not in decision["us"]
    entry = read(only_file(out / "backends"))["batch_sizes"]["4"]
    assert entry["winner"] == "torch" and "triton" in entry["errors"]
    assert KernelConfig.from_table_entry(read(only_file(out / "triton"))["configs"]["4"]) == FAST_CFG


def test_the_vllm_export_follows_the_table(tmp_path, tiny_model, monkeypatch):
    """Where the table keeps the incumbent (no decision timing confirmed FAST_CFG), the vLLM file
    exports the incumbent too, not the config only the separate timing put first."""
    decisions_off(monkeypatch)
    device = torch.cuda.get_device_name() if CUDA else "cpu"
    write_table_of(tmp_path / "before", {1: TABLE_CFG, 4: TABLE_CFG}, device)
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path / "before"))
    FakeTimer(us={triton(FAST_CFG): 10.0, triton(TABLE_CFG): 50.0}).install(monkeypatch)
    tune(tiny_model, tmp_path / "out", between=False, export_vllm=str(tmp_path / "vllm"))
    exported = read(only_file(tmp_path / "vllm"))
    assert set(exported) == set(SIZES)
    assert all((v["BLOCK_SIZE_M"], v["BLOCK_SIZE_N"] // 2, v["GROUP_SIZE_M"]) ==  # N: gate and up columns
               (TABLE_CFG.BLOCK_M, TABLE_CFG.BLOCK_N, TABLE_CFG.GROUP_M) for v in exported.values()), exported


def test_a_fast_mode_incumbent_reads_the_precise_table_in_out(tmp_path, tiny_model, monkeypatch):
    """In fast mode the backend runs the fast table over the precise one; a fast tune into the
    --out of an earlier precise tune records as incumbent what the backend ran: the precise
    table there (not a fast one: the run's own)."""
    from moekit import select

    device = torch.cuda.get_device_name() if CUDA else "cpu"
    write_table_of(tmp_path / "before", {1: TABLE_CFG, 4: TABLE_CFG}, device)
    out = tmp_path / "out"
    monkeypatch.setenv(CONFIG_DIR_ENV, f"{out}{os.pathsep}{tmp_path / 'before'}")
    decisions_on(monkeypatch)
    FakeTimer(us={triton(FAST_CFG): 10.0}).install(monkeypatch)
    tune(tiny_model, out, between=False)  # the precise table into --out: FAST_CFG
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    select.clear_cache()
    ran = {m: get_config(SHAPE, FP8_CHANNEL_TOKEN, m, device) for m in (1, 4)}
    assert ran == {1: FAST_CFG, 4: FAST_CFG}
    FakeTimer(us={triton(FAST_CFG): 10.0}).install(monkeypatch)
    tune(tiny_model, out, between=False)
    fast = next(d for d in (out / ".progress").iterdir() if d.is_dir() and "fast" in d.name)
    assert {m: read(fast / f"M={m}.json")["incumbent"]["key"] for m in (1, 4)} == {1: config_key(FAST_CFG),
                                                                                   4: config_key(FAST_CFG)}


def test_a_config_timed_below_the_roofline_floor_is_timed_again(tmp_path, tiny_model, monkeypatch):
    """A separate timing below the floor of its inputs is a misread: timed once more, the second
    reading kept and the first beside it; a timing above the floor is not repeated."""
    timer = FakeTimer(us={triton(FAST_CFG): 60.0})
    timer.install(monkeypatch)
    monkeypatch.setattr(runner.Worker, "_floor", lambda self, p, inputs: 50.0)
    first_reads = {triton(FAST_CFG): 10.0}  # FAST_CFG's first reading: below the floor

    def measure(fn, **kw):
        base = kw["what"].split(" at M=")[0]
        if base in first_reads:
            timer.calls.append(kw["what"])
            return Timing.from_samples([first_reads.pop(base)], "fake")
        return timer(fn, **kw)

    monkeypatch.setattr(runner, "measure_time", measure)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, batch_sizes=["1"], between=False)
    fast = journals(out)[1]["configs"][config_key(FAST_CFG)]
    assert (fast["us"], fast["first_us"], fast["floor_us"]) == (60.0, 10.0, 50.0)
    assert timer.calls.count(f"{triton(FAST_CFG)} at M=1") == 2
    others = [w for w in timer.calls if w.startswith("triton ") and not w.startswith(triton(FAST_CFG))]
    assert others and len(others) == len(set(others))  # above the floor: timed once each
    assert all("first_us" not in e for k, e in journals(out)[1]["configs"].items() if k != config_key(FAST_CFG))
    assert "below the roofline floor 50.0: timed again, 60.0" in text


def test_the_floor_is_that_of_the_inputs_routing(monkeypatch):
    """Worker._floor: roofline.floor_us of the experts the inputs' routing touches, per size."""
    from moekit import roofline

    worker = runner.Worker.__new__(runner.Worker)
    worker.ceilings, worker._floors = None, {}
    p = types.SimpleNamespace(label="tiny", shape=SHAPE, scheme=FP8_CHANNEL_TOKEN)
    ids = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32)
    inputs = runner.Inputs(torch.zeros(2, SHAPE.hidden, dtype=torch.bfloat16), None, None, ids)
    assert worker._floor(p, inputs) is None  # no ceilings: the CPU
    worker.ceilings = roofline.Ceilings("gpu", copy_gbps=1000.0, bf16_tflops=100.0, fp8_tflops=200.0, torch="t",
                                        triton="t", measured="now")
    want = roofline.floor_us(roofline.count(SHAPE, FP8_CHANNEL_TOKEN, 2, ids, torch.bfloat16), worker.ceilings,
                             FP8_CHANNEL_TOKEN)
    assert worker._floor(p, inputs) == want and want > 0
    assert roofline.count(SHAPE, FP8_CHANNEL_TOKEN, 2, ids).experts_touched == 2  # the routing's, not the expectation


def test_the_journal_keeps_the_flush_time_of_each_timing(tmp_path, tiny_model, monkeypatch):
    """A separate timing's L2 flush median (each replay is timed apart from its own flush) is kept
    beside its µs, so that a disturbed timing can be told afterwards."""
    FakeTimer().install(monkeypatch)
    monkeypatch.setattr(runner, "measure_time", lambda fn, **kw: Timing.from_samples([80.0], "cuda-graph", 190.25))
    out = tmp_path / "out"
    tune(tiny_model, out, batch_sizes=["1"], between=False)
    entries = [*journals(out)[1]["configs"].values(), *journals(out)[1]["backends"].values()]
    assert entries and all(e["flush_us"] == 190.2 and e["us"] == 80.0 for e in entries)
    # and which harness subtracted it: output.decision_candidates ranks each method's timings apart
    assert all(e["flush"] == FLUSH_METHOD for e in entries)


def test_the_decision_timing_confirms_the_fastest_of_each_flush_method():
    """Timings of the older harness (no "flush" in the entry) could read up to 60 µs too fast: the
    decision timing takes the fastest few of each method, so that configs timed by the current
    harness are confirmed even where misread older ones are all faster; the incumbent too."""
    old = {f"old{i}": {"config": {}, "us": 10.0 + i} for i in range(5)}  # misread: all "faster"
    new = {f"new{i}": {"config": {}, "us": 40.0 + i, "flush": FLUSH_METHOD} for i in range(5)}
    journal = {"configs": {**old, **new, "failed": {"config": {}, "error": "x"}},
               "incumbent": {"key": "new4", "config": {}}}
    n = output.CONFIRMED_CONFIGS
    assert output.decision_candidates(journal) == [*[f"old{i}" for i in range(n)], *[f"new{i}" for i in range(n)], "new4"]
    # a journal of one method: its fastest few, as before
    assert output.decision_candidates({"configs": new}) == [f"new{i}" for i in range(n)]


def test_the_run_looks_past_its_own_tables_for_the_config_used_before(tmp_path, tiny_model, monkeypatch):
    """With its output folder in MOEKIT_CONFIG_DIR (how tuned tables are used), a rerun's
    incumbent is still the table from before the first run, not the first run's own."""
    decisions_on(monkeypatch)
    device = torch.cuda.get_device_name() if CUDA else "cpu"
    write_table_of(tmp_path / "before", {1: TABLE_CFG}, device)
    out = tmp_path / "out"
    monkeypatch.setenv(CONFIG_DIR_ENV, f"{out}{os.pathsep}{tmp_path / 'before'}")
    us = {triton(FAST_CFG): 10.0}  # the search's winner, in the run's own table after the first run
    FakeTimer(us=us).install(monkeypatch)
    tune(tiny_model, out, batch_sizes=["1"])
    assert get_config(SHAPE, FP8_CHANNEL_TOKEN, 1, device) == FAST_CFG  # the run's table is found first
    FakeTimer(us=us).install(monkeypatch)
    tune(tiny_model, out, batch_sizes=["1"])
    assert journals(out)[1]["incumbent"]["key"] == config_key(TABLE_CFG)


def test_without_a_table_only_the_default_is_timed_first(tmp_path, tiny_model, monkeypatch):
    monkeypatch.delenv(CONFIG_DIR_ENV, raising=False)
    timer = FakeTimer().install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out)
    assert all("incumbent" not in j for j in journals(out).values())
    space_keys = {triton(c) for c in interpreter_space(FP8_CHANNEL_TOKEN)}
    defaults = {triton(default_config(SHAPE, FP8_CHANNEL_TOKEN, int(m))) for m in SIZES}
    assert {w.split(" at M=")[0] for w in timer.calls if w.startswith("triton ")} <= space_keys | defaults


# ----------------------------------------------------------------------- resume after a kill


def test_resume_after_a_kill_measures_only_what_is_missing(tmp_path, tiny_model, monkeypatch):
    times = {triton(FAST_CFG): 50.0, triton(OTHER_CFG): 60.0}
    # the same run uninterrupted: what a complete run measures
    full = FakeTimer(us=times).install(monkeypatch)
    tune(tiny_model, tmp_path / "reference")
    everything = list(full.calls)
    assert len(everything) == len(set(everything)) >= 6

    first = FakeTimer(us=times, kill_after=3).install(monkeypatch)
    out = tmp_path / "out"
    with pytest.raises(Killed):
        tune(tiny_model, out)
    assert len(first.calls) == 3
    on_disk = sum(len(j["configs"]) + len(j["backends"]) for j in journals(out).values())
    assert on_disk == 3  # nothing measured was lost
    assert all(j["in_flight"] == {} for j in journals(out).values())

    second = FakeTimer(us=times).install(monkeypatch)
    result, _ = tune(tiny_model, out)
    assert result.exit_code == 0 and result.not_covered == []
    assert set(second.calls).isdisjoint(first.calls)
    assert sorted(first.calls + second.calls) == sorted(everything)
    assert read(only_file(out / "triton"))["configs"] == read(only_file(tmp_path / "reference" / "triton"))["configs"]


def test_a_config_that_killed_the_process_twice_is_recorded_as_failed(tmp_path, tiny_model, monkeypatch):
    FakeTimer().install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, batch_sizes=["1"])
    path = next((out / ".progress").glob("*/M=1.json"))
    data = read(path)
    del data["configs"][config_key(FAST_CFG)]  # as if the process died while measuring it, twice
    data["in_flight"] = {triton(FAST_CFG): 2}
    path.write_text(json.dumps(data))
    again = FakeTimer().install(monkeypatch)
    result, _ = tune(tiny_model, out, batch_sizes=["1"])
    assert result.exit_code == 0
    assert triton(FAST_CFG) + " at M=1" not in again.calls
    assert "died 2 times" in read(path)["configs"][config_key(FAST_CFG)]["error"]

    data = read(path)  # one death only: measured again
    del data["configs"][config_key(FAST_CFG)]
    data["in_flight"] = {triton(FAST_CFG): 1}
    path.write_text(json.dumps(data))
    third = FakeTimer().install(monkeypatch)
    tune(tiny_model, out, batch_sizes=["1"])
    assert third.calls == [triton(FAST_CFG) + " at M=1"]
    assert "us" in read(path)["configs"][config_key(FAST_CFG)]


def test_journal_of_other_conditions_is_set_aside(tmp_path, tiny_model, monkeypatch):
    FakeTimer().install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, batch_sizes=["1"])
    again = FakeTimer().install(monkeypatch)
    result, text = tune(tiny_model, out, batch_sizes=["1"], seed=7)
    assert result.exit_code == 0
    assert "set aside" in text and "seed: 0 -> 7" in text
    assert len(again.calls) >= 4  # everything measured again
    assert len(list((out / ".progress").glob("*/M=1.stale.json"))) == 1


def test_journals_of_other_conditions_never_feed_the_tables(tmp_path, tiny_model, monkeypatch):
    """A run's tables hold only journals measured under its conditions: a rerun with another
    seed at M=1 alone leaves the seed-0 journals of M=2 and 4 out (and says so), keeps them as they
    are, and a run back at seed 0 has them again; each set-aside of M=1 is kept."""
    FakeTimer().install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out)
    result, text = tune(tiny_model, out, batch_sizes=["1"], seed=7)
    assert result.exit_code == 0, text
    assert "left out of the tables" in text and "M=2, 4" in text and "seed: 0 -> 7" in text
    assert list(read(only_file(out / "backends"))["batch_sizes"]) == ["1"]
    triton_table = read(only_file(out / "triton"))
    assert list(triton_table["configs"]) == ["1"] and triton_table["meta"]["seed"] == 7
    assert {M: j["fingerprint"]["seed"] for M, j in journals(out).items()} == {1: 7, 2: 0, 4: 0}

    result, text = tune(tiny_model, out, batch_sizes=["1"], seed=0)  # M=1 set aside a second time
    assert result.exit_code == 0, text
    folder = only_file_dir(out / ".progress")
    assert read(folder / "M=1.stale.json")["fingerprint"]["seed"] == 0
    assert read(folder / "M=1.stale-2.json")["fingerprint"]["seed"] == 7
    assert list(read(only_file(out / "backends"))["batch_sizes"]) == ["1", "2", "4"]


def test_sizes_between_take_neighbour_configs_of_the_run_conditions_only(tmp_path, tiny_model, monkeypatch):
    """A size between (4, between 1 and 16) is timed with the best configs of its neighbours
    measured under the run's conditions, not with one a journal of another seed found nearer (2)."""
    FakeTimer(us={triton(OTHER_CFG): 10.0}).install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, batch_sizes=["2"])
    FakeTimer(us={triton(FAST_CFG): 10.0}).install(monkeypatch)
    result, text = tune(tiny_model, out, batch_sizes=["1", "16"], seed=7)
    assert result.exit_code == 0, text
    js = journals(out)
    assert js[2]["fingerprint"]["seed"] == 0 and js[4]["fingerprint"]["seed"] == 7
    assert js[4]["between_configs"] == [config_key(FAST_CFG)]


@pytest.mark.parametrize("incumbent", [False, True], ids=["no-table", "table-before"])
def test_a_budget_cut_sets_aside_only_what_it_measured_again(incumbent, tmp_path, tiny_model, monkeypatch):
    """Other conditions and a budget used up by the first measurement: M=1's journal is set
    aside when its new one is saved, M=4's is left as it was (not measured, nothing lost), and
    the tables the first run wrote, which the new ones lack sizes of, are kept. Also where a
    table from before gives an incumbent (the H100 and H200 have shipped ones): recording it is
    no measurement, and sets nothing aside."""
    if incumbent:
        device = torch.cuda.get_device_name() if CUDA else "cpu"
        write_table_of(tmp_path / "before", {1: TABLE_CFG, 4: TABLE_CFG}, device)
        monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path / "before"))
    FakeTimer().install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out)
    table = only_file(out / "triton")
    before = {"triton": table.read_text(), "backends": (out / "backends" / table.name).read_text()}
    four = (only_file_dir(out / ".progress") / "M=4.json").read_text()

    again = FakeTimer(step=10.0).install(monkeypatch)
    result, text = tune(tiny_model, out, seed=7, budget="5s")
    assert result.exit_code == 0, text
    assert len(again.calls) == 1
    folder = only_file_dir(out / ".progress")
    assert (folder / "M=4.json").read_text() == four and not list(folder.glob("M=4.stale*"))
    assert read(folder / "M=1.stale.json")["fingerprint"]["seed"] == 0
    for kind, text_before in before.items():
        kept = backups_of(out / kind / table.name)
        assert [k.read_text() for k in kept] == [text_before], kind
    assert "kept the previous" in text


def test_a_table_tune_did_not_write_is_kept_before_it_is_replaced(tmp_path, tiny_model, monkeypatch):
    """A rerun replaces the tables it wrote itself without copies; a table edited since, or a vLLM
    file of its own in the export folder, is first kept, each time, never over an earlier copy."""
    FakeTimer().install(monkeypatch)
    out, export = tmp_path / "out", tmp_path / "vllm"
    tune(tiny_model, out, export_vllm=str(export))
    vllm_file, table = only_file(export), only_file(out / "triton")
    result, text = tune(tiny_model, out, export_vllm=str(export))  # a resume: nothing of its own kept
    assert result.exit_code == 0 and "kept the previous" not in text
    assert not list(out.glob("*/*.bak-*")) and not list(export.glob("*.bak-*"))

    edits = []
    for n in (1, 2):
        doc = read(table)
        doc["configs"]["8192"] = {**doc["configs"]["4"], "us": float(n)}  # a size tune never measured here
        table.write_text(json.dumps(doc))
        edits.append(table.read_text())
        vllm_file.write_text(json.dumps({"8192": {"BLOCK_SIZE_M": 64 * n}}))  # as if vLLM's own
        vllm_own = vllm_file.read_text()
        result, text = tune(tiny_model, out, export_vllm=str(export))
        assert result.exit_code == 0, text
        assert f"kept the previous {table}" in text and f"kept the previous {vllm_file}" in text
        assert [k.read_text() for k in backups_of(table)] == edits
        assert backups_of(vllm_file)[-1].read_text() == vllm_own and len(backups_of(vllm_file)) == n
        assert "8192" not in read(table)["configs"] and "8192" not in read(vllm_file)
        assert not backups_of(out / "backends" / table.name)  # its own, unchanged since: replaced


def test_fast_fp8_accumulation_tunes_a_table_of_its_own(tmp_path, tiny_model, monkeypatch):
    """Fast mode changes which config is fastest (moekit.accumulation): its measurements go to
    journals and tables of their own, and the precise ones stay as they were."""
    FakeTimer().install(monkeypatch)
    out, export = tmp_path / "out", tmp_path / "vllm"
    tune(tiny_model, out, batch_sizes=["1"], export_vllm=str(export))  # precise: no key, so older journals match
    precise_file = next((out / "triton").glob("*.json"))
    (vllm_file,) = export.glob("*.json")
    vllm_before = vllm_file.read_text()
    assert "fp8_accumulation" not in json.loads(precise_file.read_text())["meta"]
    precise_before = precise_file.read_text()
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    again = FakeTimer().install(monkeypatch)
    result, text = tune(tiny_model, out, batch_sizes=["1"], export_vllm=str(export))
    assert result.exit_code == 0 and "set aside" not in text
    assert len(again.calls) >= 4  # measured again: nothing of the precise journal reused
    # vLLM's file names have no mode: the fast export goes to fast/, the precise one is kept
    assert vllm_file.read_text() == vllm_before and (export / "fast" / vllm_file.name).is_file()
    fast_file = precise_file.with_name(precise_file.name.removesuffix(".json") + ",fp8_accumulation=fast.json")
    assert json.loads(fast_file.read_text())["meta"]["fp8_accumulation"] == "fast"
    assert (out / "backends" / fast_file.name).is_file()
    assert precise_file.read_text() == precise_before
    assert not list((out / ".progress").glob("*/M=1.stale.json"))


def test_fast_mode_leaves_the_tables_of_schemes_it_does_not_change(tmp_path, tiny_model, monkeypatch):
    """fp8-block128 scales every K step into float32 in either mode (moekit.accumulation): a tune
    in fast mode is the same measurement, so it reuses the journal and rewrites nothing."""
    FakeTimer().install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, "fp8-block128", batch_sizes=["1"])
    def tables():
        return [*out.glob("triton/*.json"), *out.glob("backends/*.json")]

    def measured():
        return {p.relative_to(out): {k: v for k, v in read(p).items() if k != "meta"} for p in tables()}

    before = measured()
    assert len(before) == 2
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    again = FakeTimer().install(monkeypatch)
    result, text = tune(tiny_model, out, "fp8-block128", batch_sizes=["1"])
    assert result.exit_code == 0 and "set aside" not in text and not again.calls
    assert measured() == before  # the same files (no fast names), the same measurements
    assert all("fp8_accumulation" not in read(p)["meta"] for p in tables())


def test_pdl_off_is_a_condition_of_the_measurements(tmp_path, tiny_model, monkeypatch):
    """MOEKIT_PDL=0 changes the times at decode sizes (BENCHMARKS.md, seventh session): journals
    measured with it off are not reused with it on, and the reverse; on (the default) adds no
    key, so journals measured before the option existed still match."""
    FakeTimer().install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, batch_sizes=["1"])
    assert "pdl" not in json.loads(next((out / "triton").glob("*.json")).read_text())["meta"]
    monkeypatch.setenv("MOEKIT_PDL", "0")
    again = FakeTimer().install(monkeypatch)
    result, text = tune(tiny_model, out, batch_sizes=["1"])
    assert result.exit_code == 0 and "set aside" in text and "pdl" in text
    assert len(again.calls) >= 4
    assert json.loads(next((out / "triton").glob("*.json")).read_text())["meta"]["pdl"] == "off"
    monkeypatch.setenv("MOEKIT_PDL", "off")
    with pytest.raises(TuneInputError, match="MOEKIT_PDL='off': expected 1"):
        tune(tiny_model, out, batch_sizes=["1"])


# ---------------------------------------------------------------------- failing configs


def test_failing_configs_are_recorded_and_skipped(tmp_path, tiny_model, monkeypatch):
    oor = "out of resource: shared memory, Required: 262144, Hardware limit: 232448"
    FakeTimer(fail={triton(FAST_CFG): oor}, run=True).install(monkeypatch)
    real_run = launch.TritonBackend.run

    def wrong_for_other(self, x, weights, topk_weights, topk_ids, config=None):
        out = real_run(self, x, weights, topk_weights, topk_ids, config=config)
        return out * 1.5 if config == OTHER_CFG else out  # fast but wrong

    monkeypatch.setattr(launch.TritonBackend, "run", wrong_for_other)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out)
    assert result.exit_code == 0
    js = journals(out)
    failed = js[1]["configs"][config_key(FAST_CFG)]
    assert failed["error"] == f"RuntimeError: {oor}" and "us" not in failed
    wrong = js[1]["configs"][config_key(OTHER_CFG)]
    assert wrong["error"].startswith("wrong output:") and wrong["rejected_us"] > 0
    assert "skipped: RuntimeError: out of resource" in text
    # not tried again at the next batch size, and never in a table
    assert js[4]["search"]["dropped"] == {config_key(FAST_CFG): "failed at M=1", config_key(OTHER_CFG): "failed at M=1"}
    assert config_key(FAST_CFG) not in js[4]["configs"]
    for entry in read(only_file(out / "triton"))["configs"].values():
        assert KernelConfig.from_dict(entry) not in (FAST_CFG, OTHER_CFG)


# ------------------------------------------------------------------- GEMM2's own launch


FAST_GEMM2 = FAST_CFG.with_gemm2(BLOCK_N=64, num_stages=3)  # space.GEMM2_GRID_CPU's variant of FAST_CFG


def test_gemm2_search_times_the_best_config_with_gemm2_launched_otherwise(tmp_path, tiny_model, monkeypatch):
    """After each size's search, the best config is timed with GEMM2's own launch variants; the
    fastest of all becomes the table's entry (with its GEMM2 fields), vLLM's export falls back to
    a config vLLM can run, and a rerun measures nothing again."""
    timer = FakeTimer(us={triton(FAST_CFG): 50.0, triton(FAST_GEMM2): 40.0}).install(monkeypatch)
    out, export = tmp_path / "out", tmp_path / "vllm"
    result, text = tune(tiny_model, out, gemm2=True, between=False, export_vllm=str(export))
    assert result.exit_code == 0, text
    assert f"{triton(FAST_GEMM2)} at M=1" in timer.calls and f"{triton(FAST_GEMM2)} at M=4" in timer.calls
    assert not any("+" in call for call in timer.calls if config_key(OTHER_CFG) in call)  # only the best's
    js = journals(out)
    for M in (1, 4):
        assert js[M]["gemm2"] == {"base": config_key(FAST_CFG), "variants": 1, "dropped": {}, "complete": True}
    table = read(only_file(out / "triton"))
    for entry in table["configs"].values():
        assert KernelConfig.from_dict(entry) == FAST_GEMM2 and entry["us"] == 40.0
        assert (entry["BLOCK_N2"], entry["num_stages2"]) == (64, 3) and "num_warps2" not in entry
    exported = read(only_file(export))
    assert all(cfg["BLOCK_SIZE_N"] == 2 * FAST_CFG.BLOCK_N for cfg in exported.values())  # FAST_CFG's tile
    assert "GEMM2 has a launch config of its own" in text and "fastest that vLLM can take" in text
    assert "M16 N32 K128 G1 w4 s2 + GEMM2 N64 G1 w4 s3" in text  # the summary names GEMM2's launch

    again = FakeTimer(us={triton(FAST_CFG): 50.0, triton(FAST_GEMM2): 40.0}).install(monkeypatch)
    tune(tiny_model, out, gemm2=True, between=False)
    assert again.calls == []


def test_gemm2_search_times_runs_of_column_tiles(tmp_path, tiny_model, monkeypatch):
    """With runs in the grid (space.GEMM2_RUNS_*), each GEMM2 launch is also timed with programs
    running several column tiles (KernelConfig.N_TILES2); a faster run makes the table's entry."""
    monkeypatch.setattr(space, "GEMM2_RUNS_CPU", (1, 2))
    runs = FAST_GEMM2.with_gemm2(N_TILES=2)
    timer = FakeTimer(us={triton(FAST_CFG): 50.0, triton(FAST_GEMM2): 40.0, triton(runs): 30.0}).install(monkeypatch)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, gemm2=True, between=False)
    assert result.exit_code == 0, text
    assert f"{triton(runs)} at M=1" in timer.calls and config_key(runs).endswith("+N64-G1-w4-s3-r2")
    assert f"{triton(FAST_CFG.with_gemm2(N_TILES=2))} at M=4" in timer.calls  # GEMM1's launch in runs too
    for entry in read(only_file(out / "triton"))["configs"].values():
        assert KernelConfig.from_dict(entry) == runs and entry["N_TILES2"] == 2 and entry["us"] == 30.0
    assert "GEMM2 N64 G1 w4 s3 x2 tiles per program" in text


@pytest.mark.parametrize("accumulation", ["precise", "fast"])
def test_gemm2_step_tries_the_overlapped_gemm2_where_it_runs(accumulation, tmp_path, tiny_model, monkeypatch):
    """On a GPU where the Gluon kernels run (launch.overlap_available, faked here), the GEMM2 step
    also times the overlapped GEMM2 after a 128x128 base (space.OVERLAP2_SEARCH_STAGES), and a
    faster one becomes the table's entry with OVERLAP2 set; in fast mode, where this scheme's
    intermediate gets one scale per row (no promotion in GEMM2), it is not tried."""
    monkeypatch.setattr(space, "OVERLAP2_SEARCH_STAGES", (2, 3))  # the CPU's tune shape has 1 K step of GEMM2: 2 stages fit
    monkeypatch.setattr(launch, "overlap_available", lambda device: True)
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", accumulation)
    tall = KernelConfig(128, 128, 128, 1, 8, 2)
    overlapped = [tall.with_gemm2(BLOCK_N=128, num_warps=8, num_stages=s, OVERLAP=1) for s in space.OVERLAP2_SEARCH_STAGES]
    timer = FakeTimer(us={triton(tall): 50.0, triton(overlapped[0]): 30.0}).install(monkeypatch)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, gemm2=True, between=False, batch_sizes=["128"], space=lambda scheme: [tall])
    assert result.exit_code == 0, text
    tried = [f"{triton(c)} at M=128" in timer.calls for c in overlapped]
    entry = read(only_file(out / "triton"))["configs"]["128"]
    if accumulation == "precise":  # 3 stages would preload 2 steps of the one there is: not tried
        assert tried == [True, False] and KernelConfig.from_dict(entry) == overlapped[0] and entry["OVERLAP2"] == 1
    else:
        assert not any(tried) and "OVERLAP2" not in entry


def test_gemm2_step_also_starts_from_a_close_128_row_base_where_the_overlap_runs(tmp_path, tiny_model, monkeypatch):
    """Where the overlapped GEMM2 runs, the GEMM2 step also starts from the fastest 128x128 8-warp
    config (journal "gemm2_tall") when another config is the fastest alone and it is within
    runner.WIDE_BASE_MARGIN: a 64-row winner cannot be followed by the overlapped GEMM2, and its
    128-row rival with it can win the size. Not where the overlap does not run."""
    monkeypatch.setattr(space, "OVERLAP2_SEARCH_STAGES", (2, 3))  # the CPU's tune shape has 1 K step of GEMM2: 2 stages fit
    monkeypatch.setattr(launch, "overlap_available", lambda device: True)
    short, tall = KernelConfig(64, 128, 128, 1, 8, 2), KernelConfig(128, 128, 128, 1, 8, 2)
    overlapped = tall.with_gemm2(BLOCK_N=128, num_warps=8, num_stages=space.OVERLAP2_SEARCH_STAGES[0], OVERLAP=1)
    timer = FakeTimer(us={triton(short): 45.0, triton(tall): 50.0, triton(overlapped): 40.0}).install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, gemm2=True, between=False, batch_sizes=["128"], space=lambda scheme: [short, tall])
    j = journals(out)[128]
    assert j["gemm2"]["base"] == config_key(short) and j["gemm2_tall"]["base"] == config_key(tall)
    assert f"{triton(overlapped)} at M=128" in timer.calls
    assert KernelConfig.from_dict(read(only_file(out / "triton"))["configs"]["128"]) == overlapped
    monkeypatch.setattr(launch, "overlap_available", lambda device: False)
    out2 = tmp_path / "out2"
    FakeTimer(us={triton(short): 45.0, triton(tall): 50.0}).install(monkeypatch)
    tune(tiny_model, out2, gemm2=True, between=False, batch_sizes=["128"], space=lambda scheme: [short, tall])
    assert "gemm2_tall" not in journals(out2)[128]


def test_gemm2_tall_base_may_be_the_128_row_gluon_gemm1(tmp_path):
    """runner.gemm2_bases: the "gemm2_tall" base is the fastest 128x128 8-warp config whether its
    GEMM1 runs in Triton or in Gluon (OVERLAP on 128 rows, which the overlapped GEMM2 can follow);
    a 64-row Gluon GEMM1 is never one, and a base slower than WIDE_BASE_MARGIN is not taken."""
    from moekit.tune.journal import Journal
    from moekit.tune.runner import WIDE_BASE_MARGIN, gemm2_bases

    short = KernelConfig(64, 128, 128, 1, 8, 4, OVERLAP=1)
    tall_gluon, tall_triton = KernelConfig(128, 128, 128, 8, 8, 4, OVERLAP=1), KernelConfig(128, 128, 128, 8, 8, 4)

    def bases(times):
        j = Journal(tmp_path / "j.json", {"configs": {config_key(c): {"config": c.to_dict(), "us": us}
                                                      for c, us in times.items()}})
        return dict(gemm2_bases(j, tall=True))

    assert bases({short: 40.0, tall_gluon: 44.0, tall_triton: 47.0}) == {"gemm2": short, "gemm2_tall": tall_gluon}
    assert bases({short: 40.0, tall_gluon: 48.0, tall_triton: 47.0}) == {"gemm2": short, "gemm2_tall": tall_triton}
    assert bases({short: 40.0, tall_gluon: 40.0 * WIDE_BASE_MARGIN + 1}) == {"gemm2": short}
    assert bases({tall_gluon: 40.0, short: 41.0}) == {"gemm2": tall_gluon}  # the fastest is already tall


def test_gemm2_narrow_base_is_the_fastest_narrower_tiled_config(tmp_path):
    """runner.gemm2_bases: "gemm2_narrow" is the fastest plain tiled config with a narrower column
    block than the fastest's (a narrow GEMM1 may want a wide GEMM2 launch), within
    WIDE_BASE_MARGIN; never a wider one, a GEMV config, or a config that is a base already."""
    from moekit.tune.journal import Journal
    from moekit.tune.runner import WIDE_BASE_MARGIN, gemm2_bases

    wide, same_width = KernelConfig(16, 128, 128, 1, 4, 5), KernelConfig(16, 128, 128, 8, 4, 3)
    n64, n32 = KernelConfig(16, 64, 128, 1, 4, 3), KernelConfig(16, 32, 128, 1, 4, 3)
    n64_16_warps = KernelConfig(16, 64, 128, 1, space.WIDE_TILE_WARPS, 3)
    gemv = KernelConfig(16, 8, 512, 1, 4, 1, GEMV=1)

    def bases(times):
        j = Journal(tmp_path / "j.json", {"configs": {config_key(c): {"config": c.to_dict(), "us": us}
                                                      for c, us in times.items()}})
        return gemm2_bases(j)

    assert bases({wide: 140.0, n64: 147.0, n32: 150.0}) == [("gemm2", wide), ("gemm2_narrow", n64)]
    assert bases({wide: 140.0, same_width: 141.0, n64: 147.0}) == [("gemm2", wide), ("gemm2_narrow", n64)]  # narrower only
    assert bases({wide: 140.0, n64: 151.0, n32: 150.0}) == [("gemm2", wide), ("gemm2_narrow", n32)]
    assert bases({wide: 140.0, n64: 140.0 * WIDE_BASE_MARGIN + 1}) == [("gemm2", wide)]
    assert bases({n64: 140.0, wide: 141.0}) == [("gemm2", n64)]  # only narrower than the fastest
    assert bases({wide: 140.0, n64_16_warps: 145.0}) == [("gemm2", wide), ("gemm2_wide", n64_16_warps)]  # once
    assert bases({gemv: 40.0, n64: 41.0}) == [("gemm2", gemv)]  # a GEMV fastest: its GEMM2 alone


def test_gemm1_in_wider_k_steps_is_a_search_config_not_a_gemm2_variant(tmp_path):
    """A config whose only GEMM2 field is its K step (GEMM1 in steps of 256, GEMM2 in 128: the
    search space's GEMM1_WIDE_K_*) is a base of the GEMM2 step like any plain config, and its
    variants keep GEMM2's K step; a variant equal to the base is not timed again."""
    from moekit.tune.journal import Journal
    from moekit.tune.runner import gemm2_bases

    wide_k = KernelConfig(16, 128, 256, 1, 8, 3).with_gemm2(BLOCK_K=128)
    plain, variant = KernelConfig(16, 128, 128, 1, 4, 5), KernelConfig(16, 128, 128, 1, 4, 5).with_gemm2(BLOCK_N=64)
    assert wide_k.has_gemm2 and not wide_k.is_gemm2_variant and variant.is_gemm2_variant
    assert wide_k.with_gemm2(BLOCK_N=64).is_gemm2_variant
    j = Journal(tmp_path / "j.json", {"configs": {config_key(c): {"config": c.to_dict(), "us": us}
                                                  for c, us in ((wide_k, 170.0), (plain, 180.0), (variant, 160.0))}})
    assert gemm2_bases(j) == [("gemm2", wide_k)]  # the variant (faster still) is no base
    launches, _ = space.gemm2_variants(wide_k, FP8_CHANNEL_TOKEN, space.gemm2_grid(torch.device("cuda")),
                                       space.HOPPER_SHARED_MEMORY, True, intermediate=1408)
    assert launches and wide_k not in launches
    assert all(c.is_gemm2_variant and c.gemm2().BLOCK_K == 128 and c.BLOCK_K == 256 for c in launches)


def test_gemm2_bases_leave_out_a_timing_the_decision_timing_found_misread(tmp_path):
    """runner.MISREAD_FACTOR: an older harness's separate timing (127 µs) that the decision
    timing found at 195 (1.53x, where the others decided read 1.04x) is no base, so the honest
    fastest (186) is, and the narrower config within 1.25x of it is the narrow base. A decision
    time within the factor of the others' ratio changes nothing, nor does a routing spread that
    moves every decided config alike (1.2-1.27x), nor a misread where nothing else is left."""
    from moekit.tune.journal import Journal
    from moekit.tune.runner import gemm2_bases

    misread, honest, narrow = (KernelConfig(16, 128, 128, 16, 8, 5), KernelConfig(16, 128, 128, 1, 4, 5),
                               KernelConfig(16, 64, 128, 8, 4, 3))
    configs = {config_key(c): {"config": c.to_dict(), "us": us} for c, us in ((misread, 127.1), (honest, 185.6), (narrow, 187.8))}

    def bases(decided):
        data = {"configs": configs, "decision": {"config": config_key(honest), "triton_us": decided}}
        return gemm2_bases(Journal(tmp_path / "j.json", data))

    assert bases({config_key(misread): 194.7, config_key(honest): 192.8}) == [("gemm2", honest), ("gemm2_narrow", narrow)]
    assert bases({config_key(misread): 150.0, config_key(honest): 192.8}) == [("gemm2", misread)]  # 1.18x: kept
    spread = {config_key(misread): 127.1 * 1.27, config_key(honest): 185.6 * 1.2, config_key(narrow): 187.8 * 1.22}
    assert bases(spread) == [("gemm2", misread)]  # every config moved alike: the routings, not a misread
    variant = misread.with_gemm2(BLOCK_N=64, num_warps=4, num_stages=4)  # decided at 1.04x: the lower median
    only = Journal(tmp_path / "only.json", {
        "configs": {config_key(misread): configs[config_key(misread)],
                    config_key(variant): {"config": variant.to_dict(), "us": 180.0}},
        "decision": {"triton_us": {config_key(misread): 194.7, config_key(variant): 187.2}}})
    assert gemm2_bases(only) == [("gemm2", misread)]  # misread, but the only plain config: still the base

def test_gemm2_step_pairs_a_narrow_gemm1_with_a_wide_gemm2(tmp_path, tiny_model, monkeypatch):
    """End to end: the fastest plain config is 64 columns wide (OTHER_CFG, 50 µs); the 32-wide
    FAST_CFG (55, within 1.25x) is the "gemm2_narrow" base, so its variant with a 64-wide GEMM2
    launch is timed and, at 30 µs, becomes the table's entry."""
    FakeTimer(us={triton(OTHER_CFG): 50.0, triton(FAST_CFG): 55.0, triton(FAST_GEMM2): 30.0}).install(monkeypatch)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, gemm2=True, between=False, space=lambda scheme: [FAST_CFG, OTHER_CFG])
    assert result.exit_code == 0, text
    for M, j in journals(out).items():
        assert (j["gemm2"]["base"], j["gemm2_narrow"]["base"]) == (config_key(OTHER_CFG), config_key(FAST_CFG)), M
        assert j["gemm2_narrow"]["complete"] and config_key(FAST_GEMM2) in j["configs"], (M, sorted(j["configs"]))
    for entry in read(only_file(out / "triton"))["configs"].values():
        assert KernelConfig.from_dict(entry) == FAST_GEMM2, entry


def test_a_gemm2_base_no_longer_taken_leaves_no_record(tmp_path, tiny_model, monkeypatch):
    """A rerun whose bases changed (here the narrow config no longer within the margin) drops the
    journal's record of the base it no longer takes, so that a record left incomplete is not
    reported as missing for ever (progress.uncovered); the variants measured stay as configs."""
    FakeTimer(us={triton(OTHER_CFG): 50.0, triton(FAST_CFG): 55.0, triton(FAST_GEMM2): 30.0}).install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, gemm2=True, between=False, space=lambda scheme: [FAST_CFG, OTHER_CFG])
    folder = only_file_dir(out / ".progress")
    for path in folder.glob("M=*.json"):  # the narrow config's separate time read slower since
        data = read(path)
        data["configs"][config_key(FAST_CFG)]["us"] = 90.0
        data["gemm2_narrow"]["complete"] = False
        path.write_text(json.dumps(data))
    FakeTimer(us={triton(OTHER_CFG): 50.0, triton(FAST_CFG): 90.0, triton(FAST_GEMM2): 30.0}).install(monkeypatch)
    result, text = tune(tiny_model, out, gemm2=True, between=False, search_space="none")
    assert result.exit_code == 0, text
    for M, j in journals(out).items():
        assert "gemm2_narrow" not in j and j["gemm2"]["base"] == config_key(OTHER_CFG), M
        assert config_key(FAST_GEMM2) in j["configs"], M
    assert "GEMM2's launch variants" not in text


@pytest.mark.parametrize("kept", [True, False])
def test_gemm2_search_keeps_a_where_the_intermediate_fits(tmp_path, tiny_model, monkeypatch, kept):
    """With runs keeping A in the grid (the GPU's has runs of 8 and 16; here the CPU's, patched to
    runs of 2), the GEMM2 step times them after the best config where the intermediate fits
    (KernelConfig.keep_a2_fits), and the table takes the fastest; where it does not (here: no K
    step fits, since the CPU's tune shrinks every shape to an intermediate of 128), never."""
    monkeypatch.setattr(space, "GEMM2_KEEP_A_RUNS_CPU", (2,))
    if not kept:
        monkeypatch.setattr(KernelConfig, "KEEP_A2_STEPS", 0)
    keep_a = FAST_CFG.with_gemm2(BLOCK_N=64, num_stages=3, N_TILES=2, KEEP_A=1)
    timer = FakeTimer(us={triton(FAST_CFG): 50.0, triton(FAST_GEMM2): 40.0, triton(keep_a): 30.0}).install(monkeypatch)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, gemm2=True, between=False)
    assert result.exit_code == 0, text
    assert any("+" in call for call in timer.calls)  # the GEMM2 step ran
    assert any(call.endswith("-ka at M=1") for call in timer.calls) is kept
    if kept:
        assert f"{triton(keep_a)} at M=1" in timer.calls
        assert all(KernelConfig.from_dict(e) == keep_a for e in read(only_file(out / "triton"))["configs"].values())
        assert "GEMM2 N64 G1 w4 s3 x2 tiles per program keeping A" in text


def test_gemm2_search_off_and_under_search_space_none(tmp_path, tiny_model, monkeypatch):
    """--no-gemm2-search times no variant; a later run with --search-space none times only the
    variants of the best config found before."""
    first = FakeTimer(us={triton(FAST_CFG): 50.0}).install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, between=False)
    assert first.calls and not any("+" in call for call in first.calls)
    second = FakeTimer(us={triton(FAST_CFG): 50.0, triton(FAST_GEMM2): 60.0}).install(monkeypatch)
    tune(tiny_model, out, between=False, search_space="none", gemm2=True)
    assert sorted(second.calls) == [f"{triton(FAST_GEMM2)} at M={M}" for M in (1, 4)]
    for entry in read(only_file(out / "triton"))["configs"].values():
        assert KernelConfig.from_dict(entry) == FAST_CFG  # the variant was slower


OTHER_GEMM2 = OTHER_CFG.with_gemm2(BLOCK_N=32, num_stages=2)  # space.GEMM2_GRID_CPU's variant of OTHER_CFG


def test_gemm2_step_starts_from_the_best_config_of_the_search_space(tmp_path, tiny_model, monkeypatch):
    """A later search that finds a better plain config gets that config's variants timed, even
    where a variant of the earlier best is still the fastest entry; and a variant's time is no
    neighbour result for the next size's pruning (A at 50, its variant at 30: A is not dropped
    at the next size as 1.67x "the best there")."""
    us = {triton(FAST_CFG): 50.0, triton(FAST_GEMM2): 30.0}
    FakeTimer(us=us).install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, gemm2=True, between=False, space=lambda scheme: [FAST_CFG])
    js = journals(out)
    assert config_key(FAST_CFG) in js[4]["configs"] and not js[4]["search"]["dropped"]

    us.update({triton(OTHER_CFG): 45.0, triton(OTHER_GEMM2): 20.0})
    second = FakeTimer(us=us).install(monkeypatch)
    tune(tiny_model, out, gemm2=True, between=False)
    assert f"{triton(OTHER_GEMM2)} at M=1" in second.calls
    assert all(js["gemm2"]["base"] == config_key(OTHER_CFG) for js in journals(out).values())
    for entry in read(only_file(out / "triton"))["configs"].values():
        assert KernelConfig.from_dict(entry) == OTHER_GEMM2


def test_gemm2_step_on_a_gemv_base_varies_its_column_block_warps_and_depth(tmp_path, tiny_model, monkeypatch):
    """Where the fastest config is one of the GEMV path, the GEMM2 step times it with GEMM2 on its
    own column block, warps and K-loop depth (space.gemv_gemm2_variants), not the tiled grid; the fastest of
    all becomes the table's entry, and the summary names GEMM2's launch."""
    # K steps of 128: the tiny model's hidden size (a wider step is pruned as dominated)
    base = KernelConfig(BLOCK_M=16, BLOCK_N=8, BLOCK_K=128, GROUP_M=1, num_warps=2, num_stages=1, GEMV=1)
    variants, _ = space.gemv_gemm2_variants(base, FP8_CHANNEL_TOKEN, tiny_model_top_k(tiny_model))
    best = base.with_gemm2(BLOCK_N=16, num_warps=4)
    assert best in variants and all(v.GEMV and v.gemm1() == base for v in variants)
    timer = FakeTimer(us={triton(base): 30.0, triton(FAST_CFG): 50.0, triton(best): 20.0}).install(monkeypatch)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, gemm2=True, between=False, space=lambda scheme: [FAST_CFG, base])
    assert result.exit_code == 0, text
    # at M = 1 the GEMV path may win (at M = 4 its 8 pairs on 4 experts prune it: the tiled grid there)
    timed = {call.split(" at M=")[0] for call in timer.calls if "+" in call and call.endswith("M=1")}
    assert timed == {triton(v) for v in variants}  # the GEMV variants, none of the tiled grid
    assert KernelConfig.from_dict(read(only_file(out / "triton"))["configs"]["1"]) == best
    assert {k: read(only_file(out / "triton"))["configs"]["1"][k] for k in ("BLOCK_N2", "num_warps2")} == {"BLOCK_N2": 16, "num_warps2": 4}
    assert "GEMV N8 K128 w2 + GEMM2 N16 w4" in text


def tiny_model_top_k(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["num_experts_per_tok"]


WIDE_CFG = KernelConfig(16, 32, 128, 1, space.WIDE_TILE_WARPS, 2)  # 16 warps (warps mean nothing to the interpreter)
WIDE_GEMM2 = WIDE_CFG.with_gemm2(BLOCK_N=32, num_warps=4, num_stages=2)  # its variant in space.GEMM2_GRID_CPU


@pytest.mark.parametrize("wide_us, timed", [(55.0, True), (70.0, False)])
def test_gemm2_step_also_starts_from_a_close_sixteen_warp_config(wide_us, timed, tmp_path, tiny_model, monkeypatch):
    """A 16-warp GEMM1 wins only with GEMM2 on a launch of its own (runner.WIDE_BASE_MARGIN): its
    variants are timed when its plain time is within 1.25x of the best plain config's (55 against
    50), and then its 30 µs variant makes the table; at 70 (1.4x) they are not."""
    FakeTimer(us={triton(FAST_CFG): 50.0, triton(WIDE_CFG): wide_us, triton(WIDE_GEMM2): 30.0}).install(monkeypatch)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, gemm2=True, between=False, space=lambda scheme: [FAST_CFG, WIDE_CFG])
    assert result.exit_code == 0, text
    for M, j in journals(out).items():
        assert j["gemm2"]["base"] == config_key(FAST_CFG)
        assert (config_key(WIDE_GEMM2) in j["configs"]) is timed, (M, sorted(j["configs"]))
        if timed:
            assert j["gemm2_wide"] == {"base": config_key(WIDE_CFG), "variants": 2, "dropped": {}, "complete": True}
        else:
            assert "gemm2_wide" not in j
    for entry in read(only_file(out / "triton"))["configs"].values():  # FAST_CFG's variants: the default 100 µs
        assert KernelConfig.from_dict(entry) == (WIDE_GEMM2 if timed else FAST_CFG), entry


def test_gemm2_step_keeps_to_the_size_share_of_the_budget(tmp_path, tiny_model, monkeypatch):
    """10 s per measurement, 100 s: the baseline (default config + 2 backends at 2 sizes) takes 60;
    M=1 gets half of the 40 left for its search and GEMM2 step, M=4 the rest, so M=4 is searched
    too; the GEMM2 variants cut short are reported."""
    monkeypatch.setattr(space, "GEMM2_GRID_CPU", ((32, 4, 2), (64, 4, 3), (32, 2, 3), (64, 2, 2), (32, 4, 4)))
    FakeTimer(us={triton(FAST_CFG): 50.0}, step=10.0).install(monkeypatch)
    out = tmp_path / "out"
    result, _text = tune(tiny_model, out, budget="100s", backends=["torch", "reference"], gemm2=True, between=False)
    assert result.exit_code == 0
    js = journals(out)
    for M in (1, 4):
        searched = [k for k in js[M]["configs"] if "+" not in k and k != js[M]["default"]]
        assert searched, (M, js[M]["configs"])
    assert any("GEMM2's launch variants" in line or "part of the search" in line for line in result.not_covered)


def six_config_space(scheme):
    """interpreter_space's two configs and four more: a search longer than the budget below."""
    more = [KernelConfig(16, n, 128, g, w, st) for n, g, w, st in ((64, 1, 4, 2), (32, 8, 4, 3), (32, 1, 2, 2), (64, 8, 2, 3))]
    return interpreter_space(scheme) + [c for c in more if not c.problems(scheme)]


def test_a_search_that_fills_its_share_leaves_the_gemm2_step_its_reserve(tmp_path, tiny_model, monkeypatch):
    """10 s per measurement, 140 s: the baseline takes 60, M=1's share is 40, its search of six
    configs stops at 30 of it (runner.GEMM2_RESERVE) with configs left, and the GEMM2 step
    measures a variant in the 10 s kept for it; without the reserve the search took it all."""
    monkeypatch.setattr(space, "GEMM2_GRID_CPU", ((32, 4, 2), (64, 4, 3), (32, 2, 3)))
    FakeTimer(us={triton(FAST_CFG): 50.0}, step=10.0).install(monkeypatch)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, budget="140s", backends=["torch", "reference"], gemm2=True, between=False,
                        space=six_config_space)
    assert result.exit_code == 0, text
    j = journals(out)[1]
    assert j["search"]["complete"] is False  # the search alone would have filled the share
    searched = [k for k, v in j["configs"].items() if "+" not in k and "us" in v and k != j["default"]]
    variants = [k for k, v in j["configs"].items() if "+" in k and "us" in v]
    assert len(searched) == 3 and len(variants) == 1, sorted(j["configs"])


def test_a_search_stopped_by_its_budget_cancels_its_queued_compiles(tmp_path, tiny_model, monkeypatch):
    """Compiles submitted for configs a search did not get to are cancelled when it stops, so
    the next batch size's compiles do not wait behind them."""

    class Helpers:  # runner.Precompiler with helpers that never start: every compile stays queued
        def __init__(self, *args, **kwargs):
            self.queued: list[tuple[int, str, concurrent.futures.Future]] = []

        def submit(self, shape, scheme, M, configs):
            futures = [concurrent.futures.Future() for _ in configs]
            self.queued += [(M, config_key(c), f) for c, f in zip(configs, futures)]
            return futures

        cancel = staticmethod(precompile.Precompiler.cancel)

        def close(self):
            pass

    made = []
    monkeypatch.setattr(runner, "Precompiler", lambda *a, **k: made.append(Helpers()) or made[-1])
    FakeTimer(us={triton(FAST_CFG): 50.0}, step=10.0).install(monkeypatch)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, budget="100s", backends=["torch", "reference"], between=False,
                        space=six_config_space)
    assert result.exit_code == 0, text
    js = journals(out)
    queued = [(M, key, f) for helpers in made for M, key, f in helpers.queued]
    not_measured = [f for M, key, f in queued if key not in js[M]["configs"]]
    assert not_measured and all(f.cancelled() for f in not_measured)


def test_the_cli_turns_the_gemm2_search_off():
    from moekit.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["tune", "--model", "x"]).gemm2_search is True
    assert parser.parse_args(["tune", "--model", "x", "--no-gemm2-search"]).gemm2_search is False


@pytest.mark.parametrize("block_m, block_n, warps, promoted, collapsed", [
    # variants measured on an H200 (BENCHMARKS.md, eighth session): 3-10x slower past 128 registers
    (128, 256, 4, False, True),  # GLM-4.5V M = 8192 fast: 2.8 ms against 0.62
    (128, 128, 4, True, True),  # Mixtral M = 1024 precise: 2.2 ms against 0.36
    (64, 256, 4, True, True),  # GLM-4.5V M = 4096 precise: 1.4-2.3 ms against 0.47
    (128, 256, 8, True, True),  # Mixtral M = 4096 precise: 2.8-3.8 ms against 1.16
    (64, 256, 4, False, False),  # GLM-4.5V M = 4096 fast: 0.49 ms, not collapsed
    (128, 256, 8, False, False),  # Mixtral M = 4096 fast: the fastest, 0.75 ms
    (64, 128, 4, True, False),  # GLM-4.5V M = 4096 precise: the fastest, 0.47 ms
])
def test_gemm2_variants_drop_what_collapsed_when_measured(block_m, block_n, warps, promoted, collapsed):
    base = KernelConfig(block_m, 128 if block_n != 128 else 64, 128, 8, 8, 4)
    kept, dropped = space.gemm2_variants(base, FP8_CHANNEL_TOKEN, [(block_n, warps, 3, 1, 0)], 227 * 1024, promoted)
    variant = base.with_gemm2(BLOCK_N=block_n, num_warps=warps, num_stages=3)
    assert (variant in kept) is not collapsed
    assert (config_key(variant) in dropped and "registers" in dropped[config_key(variant)]) is collapsed


def test_gemm2_variants_rules():
    base = KernelConfig(64, 128, 128, 8, 8, 4)
    grid = [(128, 8, 4, 1, 0), (256, 8, 3, 1, 0), (64, 4, 5, 1, 0), (128, 8, 8, 1, 0), (128, 8, 4, 8, 0), (128, 8, 4, -1, 0)]
    kept, dropped = space.gemm2_variants(base, FP8_BLOCK128, grid, 100 * 1024, True)  # an Ada-sized limit
    assert base not in kept and base.with_gemm2(num_stages=4) == base  # GEMM1's own launch: not a variant
    assert base.with_gemm2(N_TILES=8) in kept  # GEMM1's launch in runs of 8 column tiles: a variant
    assert "must be 0 or positive" in dropped[config_key(base.with_gemm2(N_TILES=-1))]
    assert "must divide 128" in dropped[config_key(base.with_gemm2(BLOCK_N=256, num_stages=3))]
    assert kept[0] == base.with_gemm2(BLOCK_N=64, num_warps=4, num_stages=5)
    assert config_key(kept[1]) == "M64-N128-K128-G8-w8-s4+N128-G8-w8-s4-r8"
    assert "shared memory" in dropped[config_key(base.with_gemm2(num_stages=8))]  # 7 stages of 24 KiB
    assert space.gemm2_partial_accumulator(FP8_CHANNEL_TOKEN, "precise")
    assert not space.gemm2_partial_accumulator(FP8_CHANNEL_TOKEN, "fast")
    assert space.gemm2_partial_accumulator(FP8_BLOCK128, "fast")  # block scales: added step by step
    assert not space.gemm2_partial_accumulator(BF16, "precise")


# ------------------------------------------------------------------------------- budget


def test_budget_stops_cleanly_and_a_rerun_finishes(tmp_path, tiny_model, monkeypatch):
    # 10 s per measurement; the baseline (default config + 2 backends at 2 sizes) takes 60 s; the
    # search of M=1 gets half of the 15 s left, M=4 the rest: one config of two each
    times = {triton(FAST_CFG): 50.0}
    first = FakeTimer(us=times, step=10.0).install(monkeypatch)
    out = tmp_path / "out"
    others = ["torch", "reference"]
    result, text = tune(tiny_model, out, budget="75s", backends=others)
    assert result.exit_code == 0
    assert len(first.calls) == 8
    searches, between = result.not_covered[:2], result.not_covered[2:]
    assert all("part of the search" in line for line in searches)
    # the sizes between come after every search: none left for them
    assert between == ["tiny-moe (fp8-channel-token): M=2 (between): not measured: triton, torch, reference"]
    assert "not covered" in text
    b = read(only_file(out / "backends"))
    assert list(b["batch_sizes"]) == SIZES  # the decision table is complete: the baseline came first
    assert read(only_file(out / "triton"))["meta"]["incomplete_batch_sizes"]

    second = FakeTimer(us=times, step=10.0).install(monkeypatch)
    result, _ = tune(tiny_model, out, backends=others)
    assert result.not_covered == []
    assert second.calls and set(second.calls).isdisjoint(first.calls)


def test_a_size_the_budget_cut_short_is_left_out_of_the_decision_table(tmp_path, tiny_model, monkeypatch):
    """A size is decided only from triton and every backend asked for there: a winner among the
    backends a budget cut left timed would be trusted by auto as a comparison that never ran."""
    default = triton(default_config(SHAPE, FP8_CHANNEL_TOKEN, 1))
    first = FakeTimer(step=10.0).install(monkeypatch)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, budget="5s", backends=["torch"], batch_sizes=["1"])
    assert result.exit_code == 0 and first.calls == [f"{default} at M=1"]
    assert "1" in read(only_file(out / "triton"))["configs"]  # what was tuned is kept
    assert not (out / "backends").exists()
    # no size decided, no table written: auto does not answer from decided sizes there, it takes
    # another table found for the problem (the shipped ones) or its heuristic, and the note says so
    note = next(line for line in text.splitlines() if "decision table:" in line)
    assert "no batch size decided, none written (left undecided at M=1 (torch not timed))" in note
    assert "another decision table it finds" in note and "heuristic" in note and "decided sizes around" not in note
    # a rerun times the rest and decides the size
    FakeTimer(us={"backend torch": 50.0}).install(monkeypatch)
    tune(tiny_model, out, backends=["torch"], batch_sizes=["1"])
    decided = only_file(out / "backends")
    assert read(decided)["batch_sizes"]["1"] == {"us": {"triton": 100.0, "torch": 50.0}, "winner": "torch"}
    # a run asked for one more backend got to the size and was cut before timing it (the timing
    # left out): that decision no longer answers there; the table is kept aside, not lost
    monkeypatch.setattr(runner.Worker, "_measure_backend", lambda self, p, j, name, inputs: None)
    result, text = tune(tiny_model, out, backends=["torch", "reference"], batch_sizes=["1"], search_space="none")
    assert not decided.exists() and len(backups_of(decided)) == 1
    assert "left undecided at M=1 (reference not timed)" in text


def test_a_size_the_budget_never_reached_keeps_its_decision(tmp_path, tiny_model, monkeypatch):
    """What a size was asked for is recorded when a run gets to its step 1: a run that asks for
    one more backend and is cut before reaching a size leaves that size decided as the run
    before decided it (complete for what that run asked)."""
    FakeTimer(us={"backend torch": 50.0}).install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, backends=["torch"], between=False)  # M = 1 and 4, both decided
    table = only_file(out / "backends")
    assert list(read(table)["batch_sizes"]) == ["1", "4"]
    FakeTimer(step=10.0).install(monkeypatch)  # M=1's reference takes the whole budget: M=4 is never reached
    result, text = tune(tiny_model, out, budget="5s", backends=["torch", "reference"], between=False)
    assert list(read(table)["batch_sizes"]) == ["1", "4"]
    assert set(read(table)["batch_sizes"]["1"]["us"]) == {"triton", "torch", "reference"}
    assert set(read(table)["batch_sizes"]["4"]["us"]) == {"triton", "torch"}
    assert "left undecided" not in text


def test_a_size_an_earlier_run_left_undecided_stays_so(tmp_path, tiny_model, monkeypatch):
    """The tables are rebuilt from every journal in --out: one a budget cut left short, at a size
    the next run does not measure, still decides nothing."""
    FakeTimer(step=10.0).install(monkeypatch)  # M=1's three timings, then M=4's default config: 40 s
    out = tmp_path / "out"
    tune(tiny_model, out, budget="35s", backends=["torch", "reference"], between=False)
    assert list(read(only_file(out / "backends"))["batch_sizes"]) == ["1"]
    FakeTimer().install(monkeypatch)
    result, text = tune(tiny_model, out, backends=["torch", "reference"], batch_sizes=["1"])
    assert list(read(only_file(out / "backends"))["batch_sizes"]) == ["1"]
    assert "left undecided at M=4 (torch, reference not timed)" in text
    assert "(beyond the decided M=1: from another decision table found for this problem there" in text


# -------------------------------------------------------------- the decision timing


def test_decision_timing_makes_the_decision_table(tmp_path, tiny_model, monkeypatch):
    """After the search at each size: triton's best config and every other backend timed again
    in the same rounds over several routings; the decision table holds those times."""
    decisions_on(monkeypatch)
    timer = FakeTimer(us={triton(FAST_CFG): 50.0, "backend torch": 80.0}, run=True).install(monkeypatch)
    rotations = []

    def many(fns, **kw):
        rotations.append(kw["before_each"])
        out = timer.many(fns, **kw)
        out["torch"] = Timing.from_samples([30.0], "fake")  # faster over several routings than alone
        return out

    monkeypatch.setattr(runner, "measure_times", many)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, backends=["torch"], between=False)
    assert result.exit_code == 0, text
    assert len(rotations) == 2 and all(len(r) == 4 for r in rotations)  # --routings default
    table = read(only_file(out / "backends"))
    assert table["meta"]["routings"] == 4
    for m in ("1", "4"):
        assert table["batch_sizes"][m] == {"us": {"triton": 50.0, "torch": 30.0}, "winner": "torch"}
        j = journals(out)[int(m)]
        decision = j["decision"]
        # every config that ran (the interpreter space's and the default: at most CONFIRMED_CONFIGS)
        timed = {k for k, v in j["configs"].items() if "us" in v}
        assert len(timed) <= output.CONFIRMED_CONFIGS
        assert set(decision["candidates"]) == timed and decision["candidates"][0] == config_key(FAST_CFG)
        assert decision["triton_us"] == {k: 50.0 if k == config_key(FAST_CFG) else 100.0 for k in timed}
        assert {k: decision[k] for k in ("config", "routings", "us")} == {
            "config": config_key(FAST_CFG), "routings": 4, "us": {"triton": 50.0, "torch": 30.0}}
    # nothing changed: nothing timed again
    again = FakeTimer().install(monkeypatch)
    tune(tiny_model, out, backends=["torch"], search_space="none", between=False)
    assert again.calls == []
    # another number of routings: the decision timing alone is redone, at every size
    third = FakeTimer(us={"backend torch": 20.0}).install(monkeypatch)
    tune(tiny_model, out, backends=["torch"], search_space="none", between=False, routings=2)
    assert sorted(third.calls) == sorted(f"decision: {w} at M={m}" for m in (1, 4)
                                         for w in [*(f"triton {k}" for k in journals(out)[m]["decision"]["candidates"]),
                                                   "backend torch"])
    assert read(only_file(out / "backends"))["batch_sizes"]["4"]["us"]["torch"] == 20.0


def test_decision_timing_follows_a_better_config_and_reports_failures(tmp_path, tiny_model, monkeypatch):
    decisions_on(monkeypatch)
    FakeTimer(us={triton(OTHER_CFG): 50.0}).install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, backends=["torch"], between=False)
    assert journals(out)[1]["decision"]["config"] == config_key(OTHER_CFG)
    path = only_file_dir(out / ".progress") / "M=1.json"
    data = read(path)
    data["configs"][config_key(FAST_CFG)]["us"] = 1.0  # as if a later search had found it
    path.write_text(json.dumps(data))
    again = FakeTimer(us={triton(FAST_CFG): 40.0}, fail={"backend torch": "out of memory"}).install(monkeypatch)
    _result, text = tune(tiny_model, out, backends=["torch"], search_space="none", between=False)
    candidates = journals(out)[1]["decision"]["candidates"]
    assert candidates[0] == config_key(FAST_CFG) and journals(out)[1]["decision"]["config"] == config_key(FAST_CFG)
    assert sorted(again.calls) == sorted([*(f"decision: triton {k} at M=1" for k in candidates),
                                          "decision: backend torch at M=1"])
    entry = read(only_file(out / "backends"))["batch_sizes"]["1"]
    assert entry["winner"] == "triton" and entry["errors"] == {"torch": "RuntimeError: out of memory"}
    assert "torch failed in the decision timing" in text


def test_decision_timing_runs_the_real_backends_over_the_routings(tmp_path, tiny_model, monkeypatch):
    decisions_on(monkeypatch)
    runs = []
    original = runner.make_routings

    def spy(*args, **kw):
        rotation = original(*args, **kw)
        runs.append(rotation)
        return rotation

    monkeypatch.setattr(runner, "make_routings", spy)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, backends=["torch"], batch_sizes=["3"], search_space="none", routings=2)
    assert result.exit_code == 0, text
    default = triton(default_config(SHAPE, FP8_CHANNEL_TOKEN, 3))  # the one config --search-space none times
    assert len(runs) == 1 and runs[0].calls == {default: 1, "torch": 1}  # reps=1: one timed call each
    entry = read(only_file(out / "backends"))["batch_sizes"]["3"]
    assert set(entry["us"]) == {"triton", "torch"} and all(v > 0 for v in entry["us"].values())


def test_decision_timing_keeps_separate_failures_and_records_its_own(tmp_path, tiny_model, monkeypatch):
    decisions_on(monkeypatch)
    # torch gave a wrong output in its separate timing: the decision does not run it again
    timer = FakeTimer(us={triton(FAST_CFG): 50.0}, fail={"backend torch": "wrong output"}).install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, backends=["torch"], between=False)
    assert not [c for c in timer.calls if c.startswith("decision: backend torch")]
    entry = read(only_file(out / "backends"))["batch_sizes"]["1"]
    assert entry["errors"]["torch"] == "RuntimeError: wrong output" and "torch" not in entry["us"]
    # a decision that still names a backend the separate timing refused (an older journal): refused
    path = only_file_dir(out / ".progress") / "M=4.json"
    data = read(path)
    data["decision"]["us"]["torch"] = 1.0
    path.write_text(json.dumps(data))
    FakeTimer().install(monkeypatch)
    tune(tiny_model, out, backends=["torch"], search_space="none", between=False)
    assert read(only_file(out / "backends"))["batch_sizes"]["4"]["winner"] == "triton"

    # the whole timing fails (a CUDA error mid-way, say): recorded, the separate timings stand
    out2 = tmp_path / "out2"
    FakeTimer(us={triton(FAST_CFG): 50.0, "backend torch": 80.0}).install(monkeypatch)

    def broken(fns, **kw):
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(runner, "measure_times", broken)
    result, text = tune(tiny_model, out2, backends=["torch"], between=False)
    assert result.exit_code == 0 and "the decision timing failed" in text
    assert journals(out2)[1]["decision"]["error"].startswith("RuntimeError: CUDA error")
    assert read(only_file(out2 / "backends"))["batch_sizes"]["1"]["us"] == {"triton": 50.0, "torch": 80.0}
    calls = []
    monkeypatch.setattr(runner, "measure_times", lambda fns, **kw: calls.append(1))
    tune(tiny_model, out2, backends=["torch"], search_space="none", between=False)
    assert calls == []  # a failed decision is not retried for the same config and routings


def test_a_decision_timing_that_broke_the_device_is_timed_again(tmp_path, tiny_model, monkeypatch):
    """Failures in a decision timing that left the CUDA context broken are the break's, not the
    backends' own: the decision is taken back and counted as a death, so a rerun times it again
    (and MAX_DEATHS such runs record it failed), rather than the decision table keeping torch's
    error at that size for good."""
    decisions_on(monkeypatch)
    timer = FakeTimer(us={triton(FAST_CFG): 50.0, "backend torch": 80.0})
    timer.install(monkeypatch)
    broken = {"on": True}

    def many(fns, **kw):
        out = timer.many(fns, **kw)
        if broken["on"]:
            out["torch"] = RuntimeError("CUDA error: an illegal memory access was encountered")
        return out

    def check_device(self, what):
        if broken["on"]:
            raise runner.DeviceBroken(f"the CUDA context is unusable after {what}")

    monkeypatch.setattr(runner, "measure_times", many)
    monkeypatch.setattr(runner.Worker, "_check_device", check_device)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, backends=["torch"], batch_sizes=["1"], between=False)
    assert result.exit_code == 1 and "unusable" in text
    j = journals(out)[1]
    assert "decision" not in j and list(j["in_flight"].values()) == [1]  # counted as a death
    broken["on"] = False
    tune(tiny_model, out, backends=["torch"], batch_sizes=["1"], between=False)
    j = journals(out)[1]
    assert j["decision"]["us"]["torch"] == 80.0 and "errors" not in j["decision"] and j["in_flight"] == {}
    entry = read(only_file(out / "backends"))["batch_sizes"]["1"]
    assert "errors" not in entry and set(entry["us"]) == {"triton", "torch"}


def test_a_decision_for_an_older_config_is_not_used(tmp_path, tiny_model, monkeypatch):
    decisions_on(monkeypatch)
    FakeTimer(us={triton(FAST_CFG): 50.0, "backend torch": 80.0}).install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, backends=["torch"], between=False)
    path = only_file_dir(out / ".progress") / "M=1.json"
    data = read(path)
    data["decision"] = {"config": config_key(OTHER_CFG), "routings": 4, "us": {"triton": 5.0, "torch": 1.0}}
    path.write_text(json.dumps(data))
    assert output.backend_table([read(path)])["batch_sizes"]["1"]["us"] == {"triton": 50.0, "torch": 80.0}


def test_the_table_takes_the_fastest_config_of_the_decision_timing(tmp_path, tiny_model, monkeypatch):
    """The separate timings (one routing, one config at a time) ranked configs wrongly on an H100
    (output.CONFIRMED_CONFIGS): the decision timing confirms the fastest few, and the triton table
    and the decision table take the fastest there. A candidate failing there is recorded and
    left out; the run goes on."""
    decisions_on(monkeypatch)
    monkeypatch.setattr(output, "CONFIRMED_CONFIGS", 2)
    default4 = default_config(SHAPE, FP8_CHANNEL_TOKEN, 4)
    separate = {triton(FAST_CFG): 10.0, triton(OTHER_CFG): 20.0, triton(default4): 30.0}
    timer = FakeTimer(us=separate).install(monkeypatch)
    # in the decision timing OTHER_CFG is the faster, the default (third separately) is not timed
    over_routings: dict[str, float | Exception] = {triton(FAST_CFG): 90.0, triton(OTHER_CFG): 60.0}

    def many(fns, **kw):
        out = timer.many(fns, **kw)
        for name, us in over_routings.items():
            if name in out:
                out[name] = us if isinstance(us, Exception) else Timing.from_samples([us], "fake")
        return out

    monkeypatch.setattr(runner, "measure_times", many)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, backends=["torch"], batch_sizes=["4"], between=False)
    assert result.exit_code == 0, text
    decision = journals(out)[4]["decision"]
    assert decision["candidates"] == [config_key(FAST_CFG), config_key(OTHER_CFG)]
    assert decision["config"] == config_key(OTHER_CFG) and decision["us"]["triton"] == 60.0
    assert f"decision: {triton(default4)} at M=4" not in timer.calls
    entry = read(only_file(out / "triton"))["configs"]["4"]
    assert KernelConfig.from_table_entry(entry) == OTHER_CFG
    assert read(only_file(out / "backends"))["batch_sizes"]["4"]["us"]["triton"] == 60.0
    assert re.search(r"4\s+M16 N64 K128 G8 w4 s3", text)  # the summary names the table's config

    # OTHER_CFG fails in the decision timing: recorded, FAST_CFG is the table's
    out2 = tmp_path / "out2"
    over_routings[triton(OTHER_CFG)] = RuntimeError("unspecified launch failure")
    monkeypatch.setattr(runner.Worker, "_check_device", lambda self, what: None)
    result, text = tune(tiny_model, out2, backends=["torch"], batch_sizes=["4"], between=False)
    decision = journals(out2)[4]["decision"]
    assert decision["config"] == config_key(FAST_CFG)
    assert decision["triton_errors"] == {config_key(OTHER_CFG): "RuntimeError: unspecified launch failure"}
    assert "errors" not in decision and f"triton {config_key(OTHER_CFG)} failed in the decision timing" in text
    assert KernelConfig.from_table_entry(read(only_file(out2 / "triton"))["configs"]["4"]) == FAST_CFG


def test_decision_timing_at_the_sizes_between(tmp_path, tiny_model, monkeypatch):
    decisions_on(monkeypatch)
    timer = FakeTimer(us={triton(FAST_CFG): 50.0, "backend torch": 80.0}).install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, backends=["torch"])
    assert f"decision: {triton(FAST_CFG)} at M=2" in timer.calls and "decision: backend torch at M=2" in timer.calls
    assert journals(out)[2]["decision"]["config"] == config_key(FAST_CFG)
    assert read(only_file(out / "backends"))["meta"]["routings"] == 4


def test_bad_routings_are_refused(tmp_path, tiny_model):
    with pytest.raises(TuneInputError, match="--routings must be an integer >= 1, got 0"):
        tune(tiny_model, tmp_path / "out", routings=0)


# -------------------------------------------------------------- sizes between the tuned ones


def test_between_sizes_are_geometric_midpoints():
    assert between_sizes([1, 2, 4, 8, 16]) == [3, 6, 11]  # none strictly between 1 and 2
    # from 64 tokens up, multiples of 8 (the sizes engines capture CUDA graphs for)
    assert between_sizes([512, 1024, 2048, 8192]) == [728, 1448, 4096]
    assert between_sizes([4]) == [] and between_sizes([4, 4, 1]) == [2]


def test_between_size_can_change_the_winner(tmp_path, tiny_model, monkeypatch):
    # triton wins at 1 and 4, torch only at the size between: the decision table holds all three
    # and auto's nearest-size rule runs torch there
    timer = FakeTimer(us={triton(FAST_CFG): 50.0, "backend torch": 80.0}).install(monkeypatch)
    original = timer.__call__

    def timing(fn, *, reps, warmup, device, what):
        if what == "backend torch at M=2":
            return Timing.from_samples([10.0], "fake")
        return original(fn, reps=reps, warmup=warmup, device=device, what=what)

    monkeypatch.setattr(runner, "measure_time", timing)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, backends=["torch"])
    assert result.exit_code == 0 and result.not_covered == [], text
    decisions = read(only_file(out / "backends"))["batch_sizes"]
    assert [decisions[m]["winner"] for m in ("1", "2", "4")] == ["triton", "torch", "triton"]
    assert decisions["2"]["us"] == {"triton": 50.0, "torch": 10.0}  # triton with the neighbours' best config
    assert "between: M=2 torch 10.0" in text
    configs = read(only_file(out / "triton"))["configs"]
    assert list(configs) == ["1", "2", "4"] and config_key(KernelConfig.from_dict(configs["2"])) == config_key(FAST_CFG)
    # FAST_CFG won the search at 1 and at 4: the one config timed at 2
    assert journals(out)[2]["between_configs"] == [config_key(FAST_CFG)]


def test_a_size_between_beyond_the_gemv_bound_takes_only_tiled_neighbours(tmp_path, tiny_model, monkeypatch):
    """A GEMV config wins at M = 1; at the size between (2: 4 pairs on the tiny model's 4 experts,
    beyond config.gemv_may_win) the backend's lookup would never run it, so only the tiled
    neighbour is timed there and the table holds it."""
    gemv = KernelConfig(BLOCK_M=16, BLOCK_N=8, BLOCK_K=128, GROUP_M=1, num_warps=2, num_stages=1, GEMV=1)
    # FAST_CFG within 1.5x of the GEMV config at M = 1, so the pruned search times it at M = 4
    FakeTimer(us={triton(gemv): 30.0, triton(FAST_CFG): 40.0}).install(monkeypatch)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, space=lambda scheme: [FAST_CFG, gemv])
    assert result.exit_code == 0, text
    js = journals(out)
    assert js[1]["configs"][config_key(gemv)]["us"] == 30.0  # within the bound at M = 1
    assert js[2]["between_configs"] == [config_key(FAST_CFG)] and config_key(gemv) not in js[2]["configs"]
    configs = read(only_file(out / "triton"))["configs"]
    assert KernelConfig.from_dict(configs["1"]) == gemv and KernelConfig.from_dict(configs["2"]) == FAST_CFG


def test_a_gemv_timing_beyond_its_bound_in_an_older_journal_is_never_the_tables(tmp_path):
    """Journals of earlier runs hold GEMV timings beyond config.gemv_may_win (a size between took a
    GEMV neighbour, or the full search timed it): the backend would never run it there, so it is
    neither a decision candidate nor the chosen config, however fast it read."""
    gemv = KernelConfig(BLOCK_M=16, BLOCK_N=8, BLOCK_K=128, GROUP_M=1, num_warps=2, num_stages=1, GEMV=1)
    problem = {"num_experts": 8, "hidden": 4096, "intermediate": 14336, "top_k": 2, "scheme": "fp8-channel-token"}
    configs = {config_key(gemv): {"config": gemv.to_dict(), "us": 10.0},
               config_key(FAST_CFG): {"config": FAST_CFG.to_dict(), "us": 50.0}}
    beyond = {"problem": problem, "batch_size": 3, "configs": configs}  # 6 pairs on 8 experts: beyond E / 2
    assert output.decision_candidates(beyond) == [config_key(FAST_CFG)]
    assert output.chosen_config(beyond)[0] == config_key(FAST_CFG) and output.best_config(beyond)[0] == config_key(FAST_CFG)
    within = {**beyond, "batch_size": 2}  # 4 pairs: within the bound, the GEMV config counts
    assert output.decision_candidates(within) == [config_key(gemv), config_key(FAST_CFG)]
    assert output.chosen_config(within)[0] == config_key(gemv)


def test_the_gemm2_step_never_starts_from_a_gemv_timing_beyond_its_bound(tmp_path):
    """runner.gemm2_bases reads the journal as the table does (output.runs_here): an older
    journal's GEMV timing beyond config.gemv_may_win is no base, so no GEMV GEMM2 variant is timed
    where the backend would never run one; within the bound it is the only base."""
    from moekit.tune.journal import Journal
    from moekit.tune.runner import gemm2_bases

    gemv = KernelConfig(BLOCK_M=16, BLOCK_N=8, BLOCK_K=128, GROUP_M=1, num_warps=2, num_stages=1, GEMV=1)
    problem = {"num_experts": 8, "hidden": 4096, "intermediate": 14336, "top_k": 2, "scheme": "fp8-channel-token"}
    configs = {config_key(gemv): {"config": gemv.to_dict(), "us": 10.0},
               config_key(FAST_CFG): {"config": FAST_CFG.to_dict(), "us": 50.0}}

    def bases(M):
        return gemm2_bases(Journal(tmp_path / f"M={M}.json", {"problem": problem, "batch_size": M, "configs": configs}))

    assert bases(3) == [("gemm2", FAST_CFG)]  # 6 pairs on 8 experts: beyond E / 2
    assert bases(2) == [("gemm2", gemv)]  # 4 pairs: within the bound


def test_between_triton_is_timed_again_when_a_search_finds_a_better_config(tmp_path, tiny_model, monkeypatch):
    out = tmp_path / "out"
    FakeTimer(us={triton(OTHER_CFG): 50.0}).install(monkeypatch)
    tune(tiny_model, out, backends=["torch"])
    assert journals(out)[2]["between_configs"] == [config_key(OTHER_CFG)]
    # a new run (here: no search, only the baseline) leaves the tuned configs as they are: nothing new
    rerun = FakeTimer().install(monkeypatch)
    tune(tiny_model, out, backends=["torch"], search_space="none")
    assert rerun.calls == []
    # the table still says which search its configs came from
    meta = read(only_file(out / "triton"))["meta"]
    assert (meta["search_space"], meta["neighbour_margin"]) == ("pruned", space.NEIGHBOUR_MARGIN)
    # now the M=1 journal holds a faster config: the between size times that one too (OTHER_CFG,
    # still the best at 4, keeps its time there), and the faster of the two is its config
    path = only_file_dir(out / ".progress") / "M=1.json"
    data = read(path)
    data["configs"][config_key(FAST_CFG)]["us"] = 1.0
    path.write_text(json.dumps(data))
    again = FakeTimer(us={triton(FAST_CFG): 40.0}).install(monkeypatch)
    tune(tiny_model, out, backends=["torch"], search_space="none")
    assert again.calls == [f"{triton(FAST_CFG)} at M=2"]
    assert journals(out)[2]["between_configs"] == [config_key(FAST_CFG), config_key(OTHER_CFG)]
    configs = read(only_file(out / "triton"))["configs"]
    assert config_key(KernelConfig.from_dict(configs["2"])) == config_key(FAST_CFG) and configs["2"]["us"] == 40.0
    assert read(only_file(out / "backends"))["batch_sizes"]["2"]["us"]["triton"] == 40.0


def test_a_journal_of_the_single_config_rule_is_brought_up_to_date(tmp_path, tiny_model, monkeypatch):
    # journals written before both neighbours' configs were timed hold triton as a backend
    out = tmp_path / "out"
    FakeTimer(us={triton(OTHER_CFG): 50.0}).install(monkeypatch)
    tune(tiny_model, out, backends=["torch"])
    path = only_file_dir(out / ".progress") / "M=2.json"
    data = read(path)
    data.pop("between_configs")
    data["configs"] = {}
    data["between_config"] = config_key(OTHER_CFG)
    data["backends"]["triton"] = {"us": 77.0}
    path.write_text(json.dumps(data))
    again = FakeTimer(us={triton(OTHER_CFG): 60.0}).install(monkeypatch)
    tune(tiny_model, out, backends=["torch"], search_space="none")
    assert again.calls == [f"{triton(OTHER_CFG)} at M=2"]  # torch's time kept
    j = journals(out)[2]
    assert "between_config" not in j and "triton" not in j["backends"] and "torch" in j["backends"]
    assert read(only_file(out / "backends"))["batch_sizes"]["2"]["us"]["triton"] == 60.0


def test_a_size_between_is_measured_as_soon_as_both_neighbours_are_searched(tmp_path, tiny_model, monkeypatch):
    # so that a budget cut later still leaves the earlier ones measured
    timer = FakeTimer().install(monkeypatch)
    result, _ = tune(tiny_model, tmp_path / "out", backends=["torch"], batch_sizes=["1", "4", "16"])
    assert result.exit_code == 0 and result.not_covered == []
    first_at_16 = min(i for i, c in enumerate(timer.calls) if c.startswith("triton ") and c.endswith(" at M=16")
                      and c != f"{triton(default_config(SHAPE, FP8_CHANNEL_TOKEN, 16))} at M=16")
    def triton_calls(M):
        return [i for i, c in enumerate(timer.calls) if c.startswith("triton ") and c.endswith(f" at M={M}")]

    assert max(triton_calls(2)) < first_at_16 < min(triton_calls(8))
    at_2 = [timer.calls[i] for i in triton_calls(2)]
    assert len(at_2) == len(set(at_2))  # not again in the last pass


def test_search_space_none_times_only_the_baseline_and_no_between_turns_it_off(tmp_path, tiny_model, monkeypatch):
    timer = FakeTimer().install(monkeypatch)
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, backends=["torch"], search_space="none", between=False)
    assert result.exit_code == 0
    default = {M: triton(default_config(SHAPE, FP8_CHANNEL_TOKEN, M)) for M in (1, 4)}
    assert sorted(timer.calls) == sorted([f"{default[1]} at M=1", "backend torch at M=1",
                                          f"{default[4]} at M=4", "backend torch at M=4"])
    assert sorted(journals(out)) == [1, 4]
    assert all(j.get("search") is None for j in journals(out).values())  # the journals keep no search record
    # nothing searched, said so once; not as "not covered (rerun the same command ...)": a rerun
    # of the same command never searches
    text = " ".join(text.split())
    assert result.not_covered == [] and "not covered" not in text
    assert f"no search ran (--search-space none): the triton configs are those earlier runs left in {out}" in text
    assert "--search-space pruned searches" in text


# ------------------------------------------------------------------------ worker processes


def test_batch_sizes_spread_over_worker_processes(tmp_path, tiny_model):
    devices = ["cuda:0", "cuda:0"] if CUDA else ["cpu", "cpu"]
    out = tmp_path / "out"
    result, text = tune(tiny_model, out, scheme="bf16", devices=devices, backends=["torch"])
    assert result.exit_code == 0, text
    assert "2 worker processes" in text
    assert list(read(only_file(out / "triton"))["configs"]) == ["1", "2", "4"]
    assert list(read(only_file(out / "backends"))["batch_sizes"]) == ["1", "2", "4"]  # 2: between, after the workers


@pytest.mark.parametrize("scheme", ["bf16", "fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token", "fp8-block128"])
def test_helpers_compile_with_the_workers_shapes_and_dtypes(scheme):
    """The helpers' empty weights have exactly the shapes and dtypes of the weights the worker
    measures with (Triton specializes on them, so anything else compiles other kernels)."""
    s = get_scheme(scheme)
    real = make_weights(SHAPE, s, torch.device("cpu"))
    empty = empty_weights(SHAPE, s, torch.device("cpu"), torch.bfloat16)
    want = {k: (v.shape, v.dtype, v.stride()) for k, v in real.tensors().items()}
    assert {k: (v.shape, v.dtype, v.stride()) for k, v in empty.tensors().items()} == want


def test_compile_only_compiles_and_launches_nothing(monkeypatch):
    """Inside compile_only a kernel is compiled (warmup) but never launched; under the interpreter,
    which compiles nothing, nothing happens at all; outside it, kernels launch as usual."""
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(("launch", grid, a, k))

        def warmup(self, *a, grid, **k):
            calls.append(("warmup", grid, a, k))

    from moekit import env

    monkeypatch.setattr(env, "interpreting", lambda: False)  # one rule for every module
    launch._launch(Kernel(), (2,), 1, BLOCK=3)
    from moekit.backends.compile_only import compile_only

    with compile_only():
        launch._launch(Kernel(), (4,), 5, BLOCK=6)
        monkeypatch.setattr(env, "interpreting", lambda: True)
        launch._launch(Kernel(), (7,), 8)
    launch._launch(Kernel(), (9,))
    fusion = {"enable_fp_fusion": True}  # every compile on a GPU asks for it (backends.triton_options)
    assert calls == [("launch", (2,), (1,), {"BLOCK": 3, **fusion}), ("warmup", (4,), (5,), {"BLOCK": 6, **fusion}),
                     ("launch", (9,), (), {})]


def test_precompiler_reports_errors_and_runs_the_space(tmp_path):
    """The helper pool runs every config it is given and returns the error of one that cannot run."""
    pool = precompile.Precompiler(torch.device("cpu"), torch.bfloat16, helpers=1)
    try:
        good = interpreter_space(FP8_CHANNEL_TOKEN)
        bad = KernelConfig(16, 48, 128, 1, 4, 2)  # BLOCK_N not a power of two
        results = [f.result(timeout=120) for f in pool.submit(SHAPE, FP8_CHANNEL_TOKEN, 4, [*good, bad])]
        # The helper kept busy first (its compiles take milliseconds under the interpreter: on a
        # loaded machine it finished all of them before cancel() ran). ProcessPoolExecutor's call
        # queue holds max_workers + 1 calls, marked running: once the helper has taken `busy` from
        # it, two of the queued ones (one before; CI saw two), and the rest can be cancelled.
        busy = pool._pool.submit(time.sleep, 3)
        queued = pool.submit(SHAPE, FP8_CHANNEL_TOKEN, 4, [*good, *good, *good])
        pool.cancel(queued)
        assert sum(f.cancelled() for f in queued) >= len(queued) - 2
        busy.result(timeout=120)
        assert all(f.cancelled() or f.result(timeout=120) is None for f in queued)
    finally:
        pool.close()
    assert results[:-1] == [None] * len(good)
    assert "BLOCK_N=48" in results[-1]
    assert pool.submit(SHAPE, FP8_CHANNEL_TOKEN, 4, good) == []


def test_tune_with_compile_helpers_writes_the_same_tables(tmp_path, tiny_model, monkeypatch):
    """Helpers change only where compilation happens, never what is measured or written."""
    winner = interpreter_space(FP8_CHANNEL_TOKEN)[1]
    FakeTimer(us={triton(winner): 50.0}).install(monkeypatch)
    tables = []
    for helpers in (0, 1):
        out = tmp_path / f"out{helpers}"
        result, text = tune(tiny_model, out, compile_workers=helpers)
        assert result.exit_code == 0, text
        tables.append({m: KernelConfig.from_dict(c) for m, c in read(only_file(out / "triton"))["configs"].items()})
    assert tables[0] == tables[1] == {m: winner for m in ("1", "2", "4")}  # 2: between, the same winner


def test_split_batch_sizes_into_contiguous_runs():
    assert runner.split_batch_sizes([8, 1, 2, 4, 16], 2) == [[1, 2, 4], [8, 16]]
    assert runner.split_batch_sizes([1, 2], 8) == [[1], [2]]
    assert runner.split_batch_sizes([1, 2, 3], 1) == [[1, 2, 3]]


# ------------------------------------------------------------------------ the search space


def test_hopper_space_holds_only_runnable_configs():
    for scheme, full in ((FP8_CHANNEL_TOKEN, False), (FP8_BLOCK128, True), (BF16, False)):
        configs = space.hopper_space(scheme, full=full)
        assert configs and all(not c.problems(scheme) for c in configs)
        assert {c.GROUP_M for c in configs} == ({1, 8, 16, 32} if full else {1, 8, 16})
    assert max(c.BLOCK_N for c in space.hopper_space(FP8_BLOCK128)) == 128
    tiled = [c for c in space.hopper_space(FP8_CHANNEL_TOKEN) if not c.GEMV]
    assert {c.BLOCK_K for c in tiled} == {128, space.GEMM1_WIDE_K_STEP}
    # GEMM1's wider steps: on decode tiles only, with GEMM2 in 128-long steps; none for 1x128-group schemes
    wide = [c for c in tiled if c.BLOCK_K > 128]
    assert wide and all(c.BLOCK_K2 == 128 and c.BLOCK_M in space.GEMM1_WIDE_K_ROWS for c in wide)
    assert {c.BLOCK_K for c in space.hopper_space(FP8_BLOCK128) if not c.GEMV} == {128}
    assert {c.BLOCK_K for c in space.hopper_space(BF16) if not c.GEMV} == {64, 128, 256}
    # the GEMV path's configs, in every scheme's space, keys that say so
    for scheme in (FP8_CHANNEL_TOKEN, FP8_BLOCK128, BF16):
        gemv = [c for c in space.hopper_space(scheme) if c.GEMV]
        assert gemv == space.gemv_space() and all(config_key(c).startswith("gemv-") for c in gemv)
    assert len({config_key(c) for c in space.hopper_space(FP8_CHANNEL_TOKEN)}) == len(space.hopper_space(FP8_CHANNEL_TOKEN))


def test_sixteen_warps_only_on_wide_tiles():
    """Four warpgroups on 128x128 tiles only, a 64x64 share each (space.WIDE_TILE_WARPS)."""
    for scheme in (FP8_CHANNEL_TOKEN, FP8_BLOCK128, BF16):
        wide = [c for c in space.hopper_space(scheme) if c.num_warps == space.WIDE_TILE_WARPS]
        assert wide, scheme.name
        assert all((c.BLOCK_M, c.BLOCK_N) == (128, 128) and not c.GEMV for c in wide)
    # the DeepSeek-V3 M = 8192 winner (BENCHMARKS.md, thirteenth session) is searched there
    winner = KernelConfig(128, 128, 128, 1, 16, 4)
    deepseek = MoEShape(num_experts=256, hidden=7168, intermediate=256, top_k=8)
    kept, _ = space.static_prune(space.hopper_space(FP8_BLOCK128), deepseek, FP8_BLOCK128, 8192, space.HOPPER_SHARED_MEMORY)
    assert winner in kept


def test_overlapped_gemm1_searched_on_its_tile_for_its_schemes():
    """space.OVERLAP_SEARCH_STAGES on KernelConfig.OVERLAP_TILE's 64 rows and
    OVERLAP_TALL_SEARCH_STAGES on its 128, every grouping, for the FP8 schemes with per-token or
    1x128-group activations only; they survive static pruning at prefill sizes."""
    for scheme in (FP8_CHANNEL_TOKEN, FP8_BLOCK128):
        for full, groups in ((False, 3), (True, 4)):
            overlap = [c for c in space.hopper_space(scheme, full=full) if c.OVERLAP]
            assert len(overlap) == groups * PER_GROUPING, (scheme.name, full)
            assert all(c.problems(scheme) == [] and (c.BLOCK_N, c.num_warps) == (128, 8) for c in overlap)
            assert sorted({(c.BLOCK_M, c.num_stages) for c in overlap}) == sorted(
                [(64, s) for s in space.OVERLAP_SEARCH_STAGES] + [(128, s) for s in space.OVERLAP_TALL_SEARCH_STAGES])
    for scheme in (BF16, get_scheme("fp8-tensor-dynamic"), get_scheme("fp8-tensor-static")):
        assert not any(c.OVERLAP for c in space.hopper_space(scheme, full=True)), scheme.name
    deepseek = MoEShape(num_experts=256, hidden=7168, intermediate=256, top_k=8)
    kept, _ = space.static_prune(space.hopper_space(FP8_BLOCK128), deepseek, FP8_BLOCK128, 8192, space.HOPPER_SHARED_MEMORY)
    assert sum(c.OVERLAP for c in kept) == 3 * PER_GROUPING
    kept, _ = space.static_prune(space.hopper_space(FP8_BLOCK128), deepseek, FP8_BLOCK128, 64, space.HOPPER_SHARED_MEMORY)
    assert {c.BLOCK_M for c in kept if c.OVERLAP} == {64}  # 64 tokens: no expert gets 128 rows


# overlapped GEMM1 configs per grouping: 64-row and 128-row stage counts
PER_GROUPING = len(space.OVERLAP_SEARCH_STAGES) + len(space.OVERLAP_TALL_SEARCH_STAGES)


def test_overlapped_gemm1_dropped_where_it_runs_as_its_twin(monkeypatch):
    """static_prune drops the overlapped configs where launch._overlapped would run their Triton
    twin (fast mode's per-row intermediate of a per-token scheme, K not in whole 128-long steps),
    and default_space searches them on Hopper only (launch.overlap_available); vLLM's export
    refuses them."""
    from moekit.backends.base import assume_capability
    from moekit.tune.output import vllm_config

    glm = MoEShape(num_experts=128, hidden=4096, intermediate=704, top_k=8)
    odd_hidden = MoEShape(num_experts=128, hidden=4096 + 64, intermediate=704, top_k=8)

    def overlap_kept(shape, scheme):
        kept, dropped = space.static_prune(space.hopper_space(scheme), shape, scheme, 4096, space.HOPPER_SHARED_MEMORY)
        return sum(c.OVERLAP for c in kept), [why for why in dropped.values() if "Triton twin" in why]

    assert overlap_kept(glm, FP8_CHANNEL_TOKEN) == (3 * PER_GROUPING, [])
    kept, why = overlap_kept(odd_hidden, FP8_CHANNEL_TOKEN)
    assert kept == 0 and "hidden 4160 is not a whole number" in why[0]
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    kept, why = overlap_kept(glm, FP8_CHANNEL_TOKEN)
    assert kept == 0 and "quantizes this scheme's intermediate per row" in why[0]
    assert overlap_kept(glm, FP8_BLOCK128)[0] == 3 * PER_GROUPING  # block scales: the same kernels
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the space of a real GPU tune
    if launch.gk is not None:
        with assume_capability((9, 0)):
            assert any(c.OVERLAP for c in space.default_space(torch.device("cuda"), "pruned")(FP8_BLOCK128))
    with assume_capability((8, 9)):
        assert not any(c.OVERLAP for c in space.default_space(torch.device("cuda"), "pruned")(FP8_BLOCK128))
    cfg = KernelConfig(64, 128, 128, 8, 8, 4, OVERLAP=1)
    assert vllm_config(cfg, FP8_CHANNEL_TOKEN)[0] is None and "OVERLAP=1" in vllm_config(cfg, FP8_CHANNEL_TOKEN)[1]
    assert vllm_config(dataclasses.replace(cfg, OVERLAP=0), FP8_CHANNEL_TOKEN)[0] is not None


def test_gemm2_variants_keep_a_where_the_intermediate_fits_two_k_steps(monkeypatch):
    """The grid's launches keeping A (KernelConfig.KEEP_A2) are variants only where the intermediate
    fits the two K steps of 128 where they won (DeepSeek-V3 at TP8: 256; GLM-4.5V at TP2: 704, six
    steps the kernel holds, lost) and their kept A with one weight tile per K step in each of
    num_stages stages and the output tile fits the shared memory (kept_a_shared_memory_bytes),
    and the GPU's grid has them with runs of 8 and 16 beside every launch of its own."""
    base = KernelConfig(64, 128, 128, 8, 8, 4)
    grid = [(64, 8, 3, 8, 0), (64, 8, 3, 16, 1), (128, 8, 3, 16, 1)]
    kept_a = base.with_gemm2(BLOCK_N=64, num_stages=3, N_TILES=16, KEEP_A=1)
    wide = base.with_gemm2(BLOCK_N=128, num_stages=3, N_TILES=16, KEEP_A=1)
    for intermediate, fits in ((256, True), (128, True), (257, False), (704, False), (None, False)):
        kept, dropped = space.gemm2_variants(base, FP8_BLOCK128, grid, space.HOPPER_SHARED_MEMORY, True,
                                             intermediate=intermediate)
        assert base.with_gemm2(BLOCK_N=64, num_stages=3, N_TILES=8) in kept
        assert (kept_a in kept) is fits and (wide in kept) is fits and config_key(kept_a) not in dropped, intermediate
    # searched at six steps, the shared memory decides: 48 KiB of A, 3 stages of 96 KiB and a 16 KiB output tile
    monkeypatch.setattr(space, "GEMM2_KEEP_A_SEARCH_STEPS", 6)
    kept, dropped = space.gemm2_variants(base, FP8_BLOCK128, grid, space.HOPPER_SHARED_MEMORY, True, intermediate=704)
    assert kept_a in kept and wide not in kept
    assert dropped[config_key(wide)] == "shared memory: GEMM2 needs about 352 KiB, the device has 227 KiB"
    # the estimate: A's K steps by its rows, num_stages stages of a weight tile per K step (bf16: 2
    # bytes), and the 16-bit output tile; 200 KiB at GLM-4.5V's six steps, as Triton 3.9 (CPU) and 3.6 (H100) compiled it
    g2 = kept_a.gemm2()
    assert space.kept_a_shared_memory_bytes(g2, FP8_BLOCK128, 704) == 64 * 768 + 3 * 768 * 64 + 64 * 64 * 2 == 200 * 1024
    assert space.kept_a_shared_memory_bytes(g2, FP8_BLOCK128, 256) == 64 * 256 + 3 * 256 * 64 + 64 * 64 * 2
    assert space.kept_a_shared_memory_bytes(g2, BF16, 200) == 2 * (64 * 256 + 3 * 256 * 64) + 64 * 64 * 2
    gpu = space.gemm2_grid(torch.device("cuda"))
    launches = {entry[:3] for entry in gpu}
    assert {entry for entry in gpu if entry[4]} == {launch + (runs, 1) for launch in launches
                                                                     for runs in space.GEMM2_KEEP_A_RUNS_GPU}
    assert all(entry[3] >= 2 for entry in space.gemm2_grid(torch.device("cpu")) if entry[4])


def test_overlapped_gemm2_tried_on_128_row_bases_where_it_runs(monkeypatch):
    """gemm2_variants adds the overlapped GEMM2 (its tile, OVERLAP2_SEARCH_STAGES, the base's
    grouping) when asked, after a 128x128 GEMM1 base only (it reads whole 1x128 groups of the
    intermediate, and its rows are the base's); overlap2_idle says where it would run as its
    Triton twin; vLLM's export refuses it (GEMM2 has a launch of its own)."""
    from moekit.tune.output import vllm_config

    grid = [(128, 8, 4, 1, 0)]
    tall = KernelConfig(128, 128, 128, 16, 8, 3)
    kept, _ = space.gemm2_variants(tall, FP8_CHANNEL_TOKEN, grid, space.HOPPER_SHARED_MEMORY, True, overlap_k_steps=112)
    overlapped = [c for c in kept if c.OVERLAP2]
    assert [config_key(c) for c in overlapped] == [f"M128-N128-K128-G16-w8-s3+N128-G16-w8-s{s}-ov"
                                                   for s in space.OVERLAP2_SEARCH_STAGES]
    assert all(c.problems(FP8_CHANNEL_TOKEN) == [] for c in overlapped)
    assert not any(c.OVERLAP2 for c in space.gemm2_variants(tall, FP8_CHANNEL_TOKEN, grid, space.HOPPER_SHARED_MEMORY,
                                                            True)[0])  # not asked for
    for base in (KernelConfig(64, 128, 128, 8, 8, 4), KernelConfig(128, 64, 128, 8, 8, 4),
                 KernelConfig(64, 128, 128, 8, 8, 4, OVERLAP=1)):
        kept, _ = space.gemm2_variants(base, FP8_BLOCK128, grid, space.HOPPER_SHARED_MEMORY, True, overlap_k_steps=6)
        assert not any(c.OVERLAP2 for c in kept), base
    wide = KernelConfig(128, 128, 128, 8, 16, 4)  # GEMM1 on 16 warps: GEMM2's own 8
    assert wide.with_gemm2(num_warps=8, num_stages=5, OVERLAP=1) in space.gemm2_variants(
        wide, FP8_CHANNEL_TOKEN, grid, space.HOPPER_SHARED_MEMORY, True, overlap_k_steps=6)[0]
    # as many stages as launch._overlapped2 runs in Gluon: DeepSeek-V3's 2 steps take none of 4 / 5
    # (3 K steps would take 4 stages), else the variant would be its Triton twin under a Gluon key
    for k_steps, stages in ((2, []), (3, [4]), (4, [4, 5])):
        kept, _ = space.gemm2_variants(tall, FP8_BLOCK128, grid, space.HOPPER_SHARED_MEMORY, True, overlap_k_steps=k_steps)
        assert [c.gemm2().num_stages for c in kept if c.OVERLAP2] == stages, k_steps
        assert all(launch._overlapped2(c.gemm2(), 4, 128 * k_steps, torch.device("cuda"))
                   for c in kept if c.OVERLAP2) or not launch.overlap_available(torch.device("cuda"))
    mixtral = MoEShape(num_experts=8, hidden=4096, intermediate=14336, top_k=2)
    glm = MoEShape(num_experts=128, hidden=4096, intermediate=704, top_k=8)
    assert space.overlap2_idle(mixtral, FP8_CHANNEL_TOKEN) is None
    assert "704" in space.overlap2_idle(glm, FP8_CHANNEL_TOKEN)
    for scheme in (BF16, get_scheme("fp8-tensor-dynamic"), get_scheme("fp8-tensor-static")):
        assert "not FP8 with 1x128 group scales" in space.overlap2_idle(mixtral, scheme)
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    assert "per row" in space.overlap2_idle(mixtral, FP8_CHANNEL_TOKEN)
    assert space.overlap2_idle(mixtral, FP8_BLOCK128) is None  # block scales: the same kernels in both modes
    assert vllm_config(overlapped[0], FP8_CHANNEL_TOKEN)[0] is None and "OVERLAP2=1" in vllm_config(overlapped[0], FP8_CHANNEL_TOKEN)[1]


def test_config_from_key_inverts_config_key():
    """Every config the tuner can time: the search spaces, and GEMM2's launch variants of their
    16-warp configs (the grid with runs)."""
    grid = space.gemm2_grid(torch.device("cuda"))  # the GPU's grid (no GPU needed to name it)
    configs = []
    for scheme in (FP8_CHANNEL_TOKEN, FP8_BLOCK128, BF16):
        searched = space.hopper_space(scheme, full=True)
        configs += searched
        for base in (c for c in searched if c.num_warps == space.WIDE_TILE_WARPS):
            configs += space.gemm2_variants(base, scheme, grid, space.HOPPER_SHARED_MEMORY, True, overlap_k_steps=8,
                                            intermediate=256)[0]
        for base, top_k in itertools.product((c for c in searched if c.GEMV), (1, 2, 6, 8)):
            configs += space.gemv_gemm2_variants(base, scheme, top_k)[0]
    assert any(c.has_gemm2 and c.N_TILES2 for c in configs) and any(c.OVERLAP2 for c in configs)
    assert any(c.KEEP_A2 for c in configs)
    assert any(c.GEMV and c.has_gemm2 for c in configs)
    assert any(c.GEMV and c.num_stages2 and config_key(c).endswith(f"-s{c.num_stages2}") for c in configs)
    assert any(c.GEMV == 2 and c.has_gemm2 and "-late+" in config_key(c) for c in configs)  # GEMM1 reducing late
    # the joined tile: no search space has it, a table may (runner.Worker._incumbents); its key is its own
    joined = KernelConfig(64, 128, 128, 8, 4, 3, JOIN=1)
    configs += [joined, joined.with_gemm2(BLOCK_N=64)]
    assert config_key(joined) != config_key(dataclasses.replace(joined, JOIN=0))
    for cfg in configs:
        assert space.config_from_key(config_key(cfg)) == cfg, config_key(cfg)
    for bad in ("", "M128-N128", "M128-N128-K128-G8-w8-s4+", "gemv-N8-K512-w2", "m128-n128-k128-g8-w8-s4 ",
                "gemv-N8-K512-w2-s1+N16", "gemv-N8-K512-w2-s1+N0-w4", "gemv-N8-K512-w2-s1+N16-G1-w4-s1",
                "gemv-N8-K512-w2-s1+N16-w4-s0", "gemv-N8-K512-w2-s1-Late", "gemv-N8-K512-w2-late-s3",
                "M128-N128-K128-G8-w8-s4+N0-G8-w8-s4", "M128-N128-K128-G8-w8-s4+N64-G8-w4-s3-r1", "M0-N128-K128-G8-w8-s4"):
        with pytest.raises(ValueError, match="expected M<rows>"):
            space.config_from_key(bad)


def test_static_prune_keeps_the_gemv_path_where_pairs_are_few():
    gemv = space.gemv_space()[0]
    deepseek = MoEShape(256, 7168, 2048, 8, tp=8)
    mixtral = MoEShape(8, 4096, 14336, 2)
    limit = space.HOPPER_SHARED_MEMORY
    for shape, M, kept_there in ((deepseek, 16, True), (deepseek, 32, False), (mixtral, 1, True), (mixtral, 2, True),
                                 (mixtral, 4, False)):
        kept, dropped = space.static_prune([gemv], shape, FP8_BLOCK128, M, limit)
        assert (kept == [gemv]) == kept_there, (shape, M)
        if not kept_there:
            assert dropped[config_key(gemv)].startswith("never run: the GEMV path reads an expert's weights once per pair")
    # the exhaustive search too drops it beyond the bound (the backend would never run it there),
    # and keeps it within
    assert space.static_prune([gemv], mixtral, FP8_BLOCK128, 64, limit, "full")[0] == []
    assert space.static_prune([gemv], mixtral, FP8_BLOCK128, 2, limit, "full")[0] == [gemv]


def test_static_prune_reasons():
    big = MoEShape(128, 4096, 1408, 8, tp=2)
    limit = space.HOPPER_SHARED_MEMORY
    configs = [
        KernelConfig(128, 256, 128, 8, 8, 5),  # 4 x 80 KiB of FP8 tiles in flight: cannot fit
        KernelConfig(128, 256, 128, 8, 8, 3),  # 2 x 80 KiB: fits, but 256 accumulator registers a thread
        KernelConfig(64, 128, 128, 8, 4, 3),  # fine at M=64, dominated at M=1
        KernelConfig(16, 128, 128, 8, 4, 3),
        KernelConfig(16, 128, 128, 16, 4, 3),  # at M=1 every GROUP_M >= 8 gives the same tile order
        KernelConfig(16, 256, 128, 1, 4, 3),  # block weights need BLOCK_N <= 128
    ]
    kept, dropped = space.static_prune(configs, big, FP8_CHANNEL_TOKEN, 1, limit)
    assert kept == [configs[3], configs[5]]
    why = {k: v.split(":")[0] for k, v in dropped.items()}
    assert why == {config_key(configs[0]): "shared memory", config_key(configs[1]): "registers",
                   config_key(configs[2]): "dominated", config_key(configs[4]): "equivalent"}
    assert dropped[config_key(configs[0])].startswith("shared memory: needs at least 320 KiB")
    kept, dropped = space.static_prune(configs, big, FP8_BLOCK128, 1, limit)
    assert kept == [configs[3]] and dropped[config_key(configs[5])].startswith("cannot run: BLOCK_N=256")
    kept, _ = space.static_prune(configs, big, FP8_CHANNEL_TOKEN, 64, limit)
    assert configs[2] in kept and configs[4] in kept
    # the exhaustive search drops only what cannot run
    kept, dropped = space.static_prune(configs, big, FP8_CHANNEL_TOKEN, 1, limit, "full")
    assert kept == [c for c in configs if c is not configs[0]]
    tiny = MoEShape(4, 128, 128, 2)
    _, dropped = space.static_prune([KernelConfig(16, 256, 64, 1, 4, 2)], tiny, BF16, 4, limit)
    assert next(iter(dropped.values())).startswith("dominated: tile wider")


def test_shared_memory_estimate_is_a_lower_bound_of_the_pipeline():
    cfg = KernelConfig(64, 128, 128, 8, 4, 4)
    per_stage = 64 * 128 + 2 * 128 * 128
    assert space.shared_memory_bytes(cfg, FP8_CHANNEL_TOKEN) == 3 * per_stage
    assert space.shared_memory_bytes(cfg, BF16) == 3 * per_stage * 2
    assert space.shared_memory_limit(torch.device("cpu"))[0] == 227 * 1024


def test_gemv_shared_memory_is_the_larger_kernels_pipeline():
    # 2 copies ahead (3 stages) of a step's tiles. GEMM1: one fp8 activation row of 512 and its gate
    # and up tiles (8 x 512 each); GEMM2 at top-8: 8 rows (one 128-group per pair) of the bf16
    # intermediate and of w2 for 8 columns
    gemv = KernelConfig(16, 8, 512, 1, 2, 3, GEMV=1)
    gemm1, gemm2 = 2 * (512 + 2 * 8 * 512), 2 * 8 * 128 * (2 + 8)
    assert space.gemv_shared_memory_bytes(gemv, FP8_CHANNEL_TOKEN, 8) == max(gemm1, gemm2) == gemm2
    assert space.gemv_shared_memory_bytes(gemv.with_gemm2(num_stages=1), FP8_CHANNEL_TOKEN, 8) == gemm1
    assert space.gemv_shared_memory_bytes(dataclasses.replace(gemv, num_stages=1), FP8_CHANNEL_TOKEN, 8) == 0
    # bf16 weights, top-2: GEMM2 reads 16 rows (8 groups per pair) of 32 columns, 264 KiB at 3 stages
    base = KernelConfig(16, 8, 1024, 1, 2, 3, GEMV=1)
    wide = base.with_gemm2(BLOCK_N=32, num_warps=8, num_stages=3)
    assert space.gemv_shared_memory_bytes(wide, BF16, 2) == 2 * 16 * 128 * (2 + 32 * 2) > space.HOPPER_SHARED_MEMORY
    variants, dropped = space.gemv_gemm2_variants(base, BF16, 2)
    assert wide not in variants and dropped[config_key(wide)].startswith("shared memory: its pipeline needs 264 KiB")
    assert wide.with_gemm2(num_stages=1) in variants  # unpipelined, the same tile fits
    kept, dropped = space.static_prune([base], MoEShape(8, 4096, 14336, 2), BF16, 1, 1000)
    assert not kept and dropped[config_key(base)].startswith("shared memory")  # static_prune counts the GEMV pipeline too


def test_the_gemv_space_pipelines_its_k_loops():
    step = [c for c in space.gemv_space() if c.GEMV == 1]  # GEMM1 reducing each step: unpipelined too
    assert {c.num_stages for c in step} == set(space.GEMV_STAGES) and 1 in space.GEMV_STAGES
    tiles = {(c.BLOCK_N, c.BLOCK_K, c.num_warps) for c in step}
    assert len(step) == len(tiles) * len(space.GEMV_STAGES)  # every tile at every depth
    late = space.gemv_late_space()  # reducing once: the pipelined depths alone, every tile at each
    assert {c.num_stages for c in late} == set(space.GEMV_STAGES) - {1}
    assert len(late) == len({(c.BLOCK_N, c.BLOCK_K, c.num_warps) for c in late}) * (len(space.GEMV_STAGES) - 1)


def test_neighbour_prune_margin():
    a, b, c, d, e = (KernelConfig(16, n, 128, 1, 4, 3) for n in (16, 32, 64, 128, 256))
    neighbour = NeighbourResult(8, {config_key(a): 10.0, config_key(b): 15.0, config_key(c): 15.1},
                                {config_key(d): "RuntimeError: boom"}, {config_key(e)})
    f = KernelConfig(32, 64, 128, 1, 4, 3)  # not a candidate at M=8: no evidence against it
    kept, dropped = space.neighbour_prune([a, b, c, d, e, f], neighbour)
    assert kept == [a, b, f]
    assert dropped[config_key(c)].startswith("lost at M=8: 1.51x")
    assert dropped[config_key(d)] == "failed at M=8" and dropped[config_key(e)] == "dropped at M=8"
    assert space.neighbour_prune([a, c], None) == ([a, c], {})


def test_a_separate_time_the_decision_timing_did_not_bear_out_prunes_nothing():
    """The margin is taken from the config the table chose at the neighbouring size where that
    is slower than the fastest separate time (a misread: H100, GLM-4.5V M = 32, one config read
    222 µs, every other ~370): otherwise the others would be dropped."""
    misread, a, b = (KernelConfig(16, n, 128, 1, 4, 3) for n in (32, 64, 128))
    times = {config_key(misread): 222.0, config_key(a): 370.0, config_key(b): 371.0}
    kept, dropped = space.neighbour_prune([misread, a, b], NeighbourResult(32, times, {}, set()))
    assert kept == [misread] and len(dropped) == 2  # what the fastest alone as reference did
    kept, dropped = space.neighbour_prune([misread, a, b], NeighbourResult(32, times, {}, set(), chosen_us=370.0))
    assert kept == [misread, a, b] and dropped == {}
    # a chosen config faster than every plain one (a GEMM2 launch of its own): the fastest stands
    assert NeighbourResult(32, times, {}, set(), chosen_us=200.0).best == 222.0


def test_the_search_prunes_by_the_config_chosen_at_the_size_before(tmp_path, tiny_model, monkeypatch):
    """End to end: the next size's pruning takes its margin from the config chosen before."""
    seen = []
    real = space.neighbour_prune

    def spy(configs, neighbour, *a, **kw):
        seen.append(neighbour)
        return real(configs, neighbour, *a, **kw)

    monkeypatch.setattr(runner, "neighbour_prune", spy)
    FakeTimer(us={triton(FAST_CFG): 10.0}).install(monkeypatch)  # the agreeing decision chooses FAST_CFG
    tune(tiny_model, tmp_path / "out", between=False)
    at_four = [n for n in seen if n is not None]
    assert len(at_four) == 1 and at_four[0].batch_size == 1 and at_four[0].chosen_us == 10.0


def test_candidates_ordered_by_evidence():
    default = KernelConfig(16, 64, 128, 1, 4, 4)
    a, b = KernelConfig(16, 32, 128, 1, 4, 2), KernelConfig(16, 128, 128, 1, 4, 2)
    new = KernelConfig(32, 128, 128, 1, 4, 2)  # its half-height sibling is b
    unknown_near, unknown_far = KernelConfig(16, 64, 128, 1, 4, 3), KernelConfig(64, 256, 128, 16, 8, 5)
    neighbour = NeighbourResult(8, {config_key(a): 20.0, config_key(b): 10.0}, {}, set())
    ordered = runner.order_candidates([unknown_far, a, unknown_near, new, b], neighbour, default)
    assert ordered == [new, b, a, unknown_near, unknown_far]  # new and b tie at 10 µs: input order
    # a 16-warp 128-row config, where 128-row tiles first appear, by its 64-row sibling on 8 warps
    eight, wide = KernelConfig(64, 128, 128, 8, 8, 4), KernelConfig(128, 128, 128, 8, space.WIDE_TILE_WARPS, 4)
    neighbour = NeighbourResult(1024, {config_key(a): 20.0, config_key(eight): 5.0}, {}, set())
    assert runner.order_candidates([a, unknown_near, wide], neighbour, default) == [wide, a, unknown_near]
    # an overlapped GEMM1 new here by its Triton sibling (the same tile), ahead of its half-height one
    overlap, half = dataclasses.replace(eight, OVERLAP=1), KernelConfig(32, 128, 128, 8, 8, 4)
    neighbour = NeighbourResult(1024, {config_key(a): 20.0, config_key(eight): 30.0, config_key(half): 5.0}, {}, set())
    assert runner.order_candidates([a, overlap], neighbour, default) == [a, overlap]
    # a GEMV config reducing late (GEMV=2) new here by its GEMV=1 sibling (the same tile)
    step_fast, step_slow = space.GEMV_START, dataclasses.replace(space.GEMV_START, BLOCK_N=4)
    late_fast, late_slow = (dataclasses.replace(c, GEMV=2) for c in (step_fast, step_slow))
    neighbour = NeighbourResult(2, {config_key(a): 20.0, config_key(step_fast): 5.0, config_key(step_slow): 30.0}, {}, set())
    assert runner.order_candidates([late_slow, a, late_fast], neighbour, default) == [late_fast, a, late_slow]


# --------------------------------------------------------------------------- vLLM export


def test_vllm_file_names():
    assert output.vllm_file_name(128, 704, "NVIDIA H100 80GB HBM3", FP8_CHANNEL_TOKEN) == (
        "E=128,N=704,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8.json")
    assert output.vllm_file_name(256, 256, "NVIDIA H200", FP8_BLOCK128) == (
        "E=256,N=256,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json")
    assert output.vllm_file_name(8, 14336, "NVIDIA H200 NVL", get_scheme("bf16")) == "E=8,N=14336,device_name=NVIDIA_H200.json"


def test_vllm_config_mapping():
    cfg, why = output.vllm_config(KernelConfig(64, 64, 128, 8, 4, 3), FP8_BLOCK128)
    assert why is None and cfg == {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 8,
                                   "num_warps": 4, "num_stages": 3}
    assert output.vllm_config(KernelConfig(64, 32, 128, 8, 4, 3), FP8_BLOCK128)[0] is None  # 64 % 128
    assert output.vllm_config(KernelConfig(64, 32, 128, 8, 4, 3), FP8_CHANNEL_TOKEN)[0]["BLOCK_SIZE_N"] == 64
    assert output.vllm_config(KernelConfig(64, 256, 64, 8, 4, 3), BF16)[0] is None  # 512 wide
    # 16 warps (moekit's four-warpgroup split of gate and up) is beyond vLLM's tuner's 4 and 8
    cfg, why = output.vllm_config(KernelConfig(128, 128, 128, 1, 16, 4), FP8_CHANNEL_TOKEN)
    assert cfg is None and "num_warps 16" in why


def test_vllm_export_says_where_group_size_m_is_not_one_vllm_searches(tmp_path, tiny_model, monkeypatch):
    """A measured GROUP_M of 8 is exported as is (vLLM's kernel takes any GROUP_SIZE_M), with a
    note that vLLM's own tuner would not have produced it; none where the values are vLLM's."""
    assert OTHER_CFG.GROUP_M not in output.VLLM_GROUP_SIZE_M and FAST_CFG.GROUP_M in output.VLLM_GROUP_SIZE_M
    for winner, noted in ((OTHER_CFG, True), (FAST_CFG, False)):
        FakeTimer(us={triton(winner): 10.0}).install(monkeypatch)
        export = tmp_path / f"vllm-{winner.GROUP_M}"
        result, text = tune(tiny_model, tmp_path / f"out-{winner.GROUP_M}", export_vllm=str(export))
        assert result.exit_code == 0, text
        exported = read(only_file(export))
        assert {c["GROUP_SIZE_M"] for c in exported.values()} == {winner.GROUP_M}
        assert (f"GROUP_SIZE_M {winner.GROUP_M} exported as measured" in text) == noted, text


# ---------------------------------------------------------------------------- bad input


def test_parse_budget():
    assert parse_budget("90s") == 90 and parse_budget("10m") == 600 and parse_budget("1h") == 3600
    assert parse_budget("1h30m") == 5400 and parse_budget("45") == 45 and parse_budget(None) is None
    for bad in ("10 minutes", "0s", "-5m", "m", ""):
        with pytest.raises(TuneInputError):
            parse_budget(bad)


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model"], "--model no-such-model"),
    (["--budget", "ten minutes"], "--budget"),
    (["--budget", "0s"], "--budget"),
    (["--batch-sizes", "0"], "--batch-sizes: 0 is not a positive integer"),
    (["--batch-sizes", "4", "-2"], "--batch-sizes: -2 is not a positive integer"),
    (["--scheme", "fp7"], "--scheme"),
    (["--backends", "auto"], "--backends"),
    (["--reps", "0"], "--reps"),
    (["--compile-workers", "-1"], "--compile-workers"),
    (["--out", "{file}/sub"], "--out"),
    (["--export-vllm", "{file}/sub"], "--export-vllm"),
    (["--env"], "MOEKIT_FP8_ACCUMULATION='sloppy': expected one of precise, fast"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny_model, capsys, args, message, monkeypatch):
    if args == ["--env"]:  # a bad MOEKIT_FP8_ACCUMULATION: a condition of every measurement
        monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "sloppy")
        args = []
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    args = [a.replace("{file}", str(blocker)) for a in args]
    out = tmp_path / "out"
    argv = ["tune", "--model", str(tiny_model), "--out", str(out), *args]
    if args and args[0] == "--model":
        argv = ["tune", *args, "--out", str(out)]
    assert main(argv) == 2
    text = capsys.readouterr()
    lines = [line for line in (text.out + text.err).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    assert message in lines[0]
    assert not out.exists()  # nothing left behind


def test_an_unknown_backend_is_refused_without_offering_auto(tmp_path, tiny_model, capsys):
    """tune refuses --backends auto, so its message for an unknown name must not offer it."""
    assert main(["tune", "--model", str(tiny_model), "--out", str(tmp_path / "out"), "--backends", "bogus"]) == 2
    line = capsys.readouterr().out.strip()
    assert "unknown backend 'bogus'" in line and "auto" not in line
    assert all(name in line for name in backend_names())


def test_tune_shares_bench_batch_sizes_and_input_seeds(tmp_path, tiny_model, monkeypatch):
    """The default GPU batch sizes are bench's own list; every input tune makes (the separate
    timings' and the decision timing's routings) comes from the one seed helper."""
    import moekit.bench
    import moekit.inputs
    import moekit.check
    import moekit.tune.plan

    assert moekit.tune.plan.GPU_BATCH_SIZES is moekit.bench.DEFAULT_BATCH_SIZES
    assert runner.input_seed is moekit.inputs.input_seed is moekit.bench.input_seed is moekit.check.input_seed
    decisions_on(monkeypatch)
    FakeTimer().install(monkeypatch)
    seeds = []
    real = runner.input_seed
    monkeypatch.setattr(runner, "input_seed", lambda seed, M: seeds.append((seed, M)) or real(seed, M))
    made = []
    real_routings = runner.make_routings
    monkeypatch.setattr(runner, "make_routings", lambda *a, seed, **k: made.append(seed) or real_routings(*a, seed=seed, **k))
    tune(tiny_model, tmp_path / "out", batch_sizes=["1"], seed=3)
    assert made and all(seed == real(3, 1) for seed in made)
    assert len(seeds) > len(made)  # the separate timings' inputs too


def test_compile_helpers_are_shared_out_among_gpu_workers(tmp_path, tiny_model, monkeypatch):
    """Two worker processes with 4 helpers asked for: 2 each, not 4 each (they share the cores)."""
    import moekit.tune as tune_module

    seen = []
    monkeypatch.setattr(tune_module, "run_workers", lambda plan, devices, *a: seen.append(plan.compile_workers) or [])
    tune(tiny_model, tmp_path / "out", devices=["cpu", "cpu"], compile_workers=4)
    assert seen == [2]


def test_summary_names_a_gemv_config_by_what_it_uses():
    from moekit.tune.progress import _config_text

    assert _config_text(space.gemv_space()[0].to_dict()) == "GEMV N4 K256 w2"
    pipelined = KernelConfig(16, 8, 512, 1, 2, 3, GEMV=1)  # the depth is named where the loops are pipelined
    assert _config_text(pipelined.to_dict()) == "GEMV N8 K512 w2 s3"
    assert _config_text(pipelined.with_gemm2(BLOCK_N=16, num_stages=1).to_dict()) == "GEMV N8 K512 w2 s3 + GEMM2 N16 w2 s1"
    assert _config_text(pipelined.with_gemm2(BLOCK_N=16).to_dict()) == "GEMV N8 K512 w2 s3 + GEMM2 N16 w2"
    late = dataclasses.replace(pipelined, GEMV=2)  # GEMM1 reducing once after its K loop
    assert _config_text(late.to_dict()) == "GEMV N8 K512 w2 s3 late"
    assert _config_text(late.with_gemm2(BLOCK_N=16).to_dict()) == "GEMV N8 K512 w2 s3 late + GEMM2 N16 w2"
    assert _config_text(KernelConfig(16, 64, 128, 1, 4, 3).to_dict()) == "M16 N64 K128 G1 w4 s3"


def test_the_gemv_space_holds_both_reductions_within_the_register_cap():
    late = space.gemv_late_space()
    assert late and all(c in space.gemv_space() and not c.problems(FP8_BLOCK128) for c in late)
    assert {c.GEMV for c in space.gemv_space()} == {1, 2}
    per_thread = [c.BLOCK_N * c.BLOCK_K // (32 * c.num_warps) for c in late]
    assert max(per_thread) == space.GEMV_LATE_MAX_VALUES_PER_THREAD  # the cap is reached, never passed
    assert dataclasses.replace(space.GEMV_START, GEMV=2) in late  # the start's tile, reducing late


def test_gemv_configs_are_ordered_among_the_tiled_ones_not_last():
    default = KernelConfig(16, 64, 128, 1, 4, 4)
    tiled_far = KernelConfig(128, 256, 128, 16, 8, 2)
    gemv_far = dataclasses.replace(space.GEMV_START, BLOCK_N=16, BLOCK_K=256, num_warps=4)
    ordered = runner.order_candidates([tiled_far, gemv_far, space.GEMV_START, default], None, default)
    assert ordered[:2] == [space.GEMV_START, default] or ordered[:2] == [default, space.GEMV_START]
    assert ordered.index(gemv_far) < ordered.index(tiled_far)


def test_fast_mode_widens_the_wrong_output_tolerance(monkeypatch):
    monkeypatch.delenv("MOEKIT_FP8_ACCUMULATION", raising=False)
    assert runner.output_tolerance() == runner.OUTPUT_TOLERANCE == 1e-2
    ref = torch.ones(1000)
    off = ref + 0.02  # 2e-2 relative L2: two fast-mode configs may differ by this much
    assert runner.Worker._wrong_output(off, ref).startswith("wrong output: 2.0e-02 relative L2")
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    assert runner.output_tolerance() == 4e-2 and runner.Worker._wrong_output(off, ref) is None
    assert runner.Worker._wrong_output(ref * 1.1, ref).endswith("(tolerance 0.04)")  # a wrong scale still fails


# ------------------------------------------------- problems of one run that would share a file


def _tiny_top_k(tmp_path, name, top_k):
    (tmp_path / name).mkdir(parents=True)
    folder = tiny_mixtral(tmp_path / name, experts=4, hidden=128, intermediate=128, layers=2)
    config = read(folder / "config.json")
    (folder / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": top_k}))
    return folder


def test_problems_that_would_write_the_same_file_are_refused(tmp_path, tiny_model, monkeypatch):
    """Two problems of one run wrote the same file, the last one's results replacing the
    other's without a backup or a word: two schemes in one vLLM file (its name says
    dtype=fp8_w8a8 for both), and two layers alike but for top-k in one moekit table (and one
    journal folder, so that a rerun measured everything again). Refused before anything runs."""
    timer = FakeTimer().install(monkeypatch)
    out = tmp_path / "out"
    with pytest.raises(TuneInputError, match=r"\(fp8-channel-token, top-2, H=128\) and .*\(fp8-tensor-dynamic, top-2, "
                                             r"H=128\) would write the same vLLM config file"):
        tune(tiny_model, out, "fp8-channel-token,fp8-tensor-dynamic", export_vllm=str(tmp_path / "vllm"))
    top2, top1 = _tiny_top_k(tmp_path / "two", "a", 2), _tiny_top_k(tmp_path / "two", "b", 1)
    opts = TuneOptions(models=[str(top2), str(top1)], scheme="fp8-channel-token", batch_sizes=SIZES, reps=1,
                       warmup=0, out=str(out), space=interpreter_space, argv=["tune"], gemm2=False)
    with pytest.raises(TuneInputError, match=r"top-2.* and .*top-1.* would write the same moekit table \(their "
                                             r"top-k differs"):
        run_tune(opts, Console(file=io.StringIO(), width=200, no_color=True))
    assert timer.calls == [] and not (out / "triton").exists()
    # without the export, two schemes have tables of their own: allowed
    result, _ = tune(tiny_model, out, "fp8-channel-token,fp8-tensor-dynamic")
    assert len([p for p in (out / "triton").iterdir() if ".bak-" not in p.name]) == 2


def test_a_size_between_in_one_run_and_tuned_in_the_next_is_a_tuned_size(tmp_path, tiny_model, monkeypatch):
    """A size between the tuned ones of an earlier run kept its 'between' mark after a later run
    searched it: the sizes around it were then timed with the wrong neighbours' configs (and it
    never showed as incomplete). Here M = 4 is between in run 1 (sizes 1, 16) and tuned in run 2
    (1, 4, 16), where FAST_CFG wins it: M = 8, between 4 and 16 now, must time FAST_CFG."""
    fast, other = triton(FAST_CFG), triton(OTHER_CFG)

    class PerSize(FakeTimer):  # OTHER_CFG wins at 1 and 16, FAST_CFG at 4
        def __call__(self, fn, *, reps, warmup, device, what):
            timing = super().__call__(fn, reps=reps, warmup=warmup, device=device, what=what)
            us = {(other, "1"): 10.0, (other, "16"): 10.0, (fast, "1"): 12.0, (fast, "16"): 12.0,
                  (fast, "4"): 5.0, (other, "4"): 50.0}.get((self.current, what.split(" at M=")[1]))
            return Timing.from_samples([us], "fake") if us is not None else timing

    PerSize().install(monkeypatch)
    out = tmp_path / "out"
    tune(tiny_model, out, batch_sizes=["1", "16"])
    assert "between_configs" in journals(out)[4]
    tune(tiny_model, out, batch_sizes=["1", "4", "16"])
    j = journals(out)
    assert "between_configs" not in j[4] and j[4]["search"]
    assert config_key(FAST_CFG) in j[8]["between_configs"], "M = 8 timed without M = 4's best config"


# --------------------------------------------------- SIGTERM and SIGHUP stop a run as Ctrl-C does


class SignalTimer(FakeTimer):
    """FakeTimer sending this process `signum` when a measurement whose name starts with `at`
    begins (once per run): Python runs the handler at once, inside the measurement."""

    def __init__(self, signum, at, **kw):
        super().__init__(**kw)
        self.signum, self.at, self.sent = signum, at, False

    def __call__(self, fn, *, reps, warmup, device, what):
        if not self.sent and what.startswith(self.at):
            self.sent = True
            os.kill(os.getpid(), self.signum)
        return super().__call__(fn, reps=reps, warmup=warmup, device=device, what=what)


@pytest.fixture
def as_if_killed():
    """SIGTERM and SIGHUP, outside a run's own handlers, end the measurement as their default
    action would end the process: a Killed (nothing in the tuner un-marks it), recorded here."""
    died = []

    def killed(signum, frame):
        died.append(signum)
        raise Killed(signal.Signals(signum).name)

    before = {s: signal.signal(s, killed) for s in (signal.SIGTERM, signal.SIGHUP)}
    yield killed, died
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("at", ["backend torch", "triton", "decision: triton"])
def test_a_sigterm_or_sighup_stops_the_run_as_ctrl_c_does(signame, at, tmp_path, tiny_model, monkeypatch,
                                                          as_if_killed):
    """A SIGTERM (timeout, a scheduler, systemd) or SIGHUP (a closed terminal) during a measurement
    ended the process there, which the journal counts as a death: after two, a backend, a config
    or a decision timing that never failed was recorded as failed for good ("the process died 2
    times"). Now it stops the run as Ctrl-C does: the measurement un-marked, the tables rebuilt,
    exit status 128 + the signal, the handlers before restored; a third run measures it."""
    handler, died = as_if_killed
    signum = getattr(signal, signame)
    decisions_on(monkeypatch)
    out = tmp_path / "out"
    kw = dict(batch_sizes=["1"], backends=["torch"], between=False)
    for _ in range(runner.MAX_DEATHS):
        timer = SignalTimer(signum, at).install(monkeypatch)
        result, text = tune(tiny_model, out, **kw)
        assert timer.sent and died == []
        assert result.exit_code == 128 + signum, text
        assert f"stopped by {signame}: rerun the same command" in text
        assert signal.getsignal(signum) is handler  # the run's handler went with it
        assert all(j["in_flight"] == {} for j in journals(out).values())
    again = FakeTimer().install(monkeypatch)
    result, text = tune(tiny_model, out, **kw)
    assert result.exit_code == 0 and "died" not in text, text
    j = journals(out)[1]
    assert any(call.startswith(at) for call in again.calls)
    assert "error" not in j["backends"]["torch"] and not j["decision"].get("error")
    assert all("error" not in entry for entry in j["configs"].values())
    assert list(read(only_file(out / "backends"))["batch_sizes"]) == ["1"]


def test_signals_are_taken_only_in_the_main_thread_and_never_over_an_ignored_one():
    """Python runs signal handlers in the main thread only (signal.signal refuses elsewhere): a
    run in another thread changes nothing. A signal ignored before (nohup ignores SIGHUP) stays
    ignored; the others are the run's while it lasts and given back after."""
    seen = []

    def in_thread():
        with runner.stop_on_signals():
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join()
    assert seen == [before]
    hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with runner.stop_on_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not before
            with pytest.raises(runner.Stopped) as stopped:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)  # the handler runs before this returns
            assert isinstance(stopped.value, KeyboardInterrupt) and stopped.value.signum == signal.SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)  # a repeat while the run stops: ignored
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGHUP, hup)


def test_a_worker_process_stopped_by_a_signal_unmarks_its_measurement_and_tells_the_parent(
        tmp_path, tiny_model, monkeypatch, as_if_killed):
    """A worker process (several GPUs) is stopped by the parent's terminate() (SIGTERM) or by a
    SIGTERM to the process group: it un-marks its measurement as the run in one process does and
    tells the parent, which stops the run rather than go on as if its sizes were done."""
    _, died = as_if_killed
    from moekit.tune.plan import build_plan

    opts = TuneOptions(models=[str(tiny_model)], scheme="fp8-channel-token", batch_sizes=["1"], backends=["torch"],
                       reps=1, warmup=0, out=str(tmp_path / "out"), space=interpreter_space, argv=["tune"],
                       gemm2=False, between=False, compile_workers=0)
    plan = build_plan(opts, torch.device("cpu"))
    SignalTimer(signal.SIGTERM, "backend torch").install(monkeypatch)
    events = queue.Queue()
    with pytest.raises(runner.Stopped):
        runner._worker_main(0, plan, ["cpu"], [[1]], events, None)
    assert died == []
    assert all(j["in_flight"] == {} for j in journals(tmp_path / "out").values())
    kinds = [events.get_nowait() for _ in range(events.qsize())]
    assert (0, "stopped", signal.SIGTERM) in kinds


def test_run_workers_stops_its_workers_gently_and_hears_of_one_stopped(monkeypatch):
    """The parent, stopped, sends its workers SIGTERM and waits for them (their journals saved
    before it rebuilds the tables from them); a worker stopped alone stops the parent's run."""
    import torch.multiprocessing as mp

    class Process:
        def __init__(self):
            self.calls = []

        def is_alive(self):
            return "join" not in self.calls

        def terminate(self):
            self.calls.append("terminate")

        def join(self, timeout=None):
            self.calls.append("join")

    class Context:
        def __init__(self, events, stop_parent):
            self.events, self.stop_parent, self.processes = events, stop_parent, [Process()]

        def join(self, timeout=None):
            if self.stop_parent:
                raise runner.Stopped(signal.SIGTERM)
            self.events.put((0, "stopped", int(signal.SIGHUP)))
            return True

    plan = types.SimpleNamespace(batch_sizes=[1, 4])
    for stop_parent in (True, False):
        made = []
        monkeypatch.setattr(mp, "spawn", lambda fn, args, nprocs, join: made.append(Context(args[3], stop_parent))
                            or made[-1])
        heard = []
        with pytest.raises(runner.Stopped) as stopped:
            runner.run_workers(plan, ["cpu", "cpu"], None, lambda *event: heard.append(event))
        assert stopped.value.signum == (signal.SIGTERM if stop_parent else signal.SIGHUP)
        assert made[0].processes[0].calls == (["terminate", "join"] if stop_parent else [])
        assert heard == []  # a stop is no progress event


SIGTERM_RUN = textwrap.dedent("""
    import json, os, signal, sys
    from moekit.timing import Timing
    from moekit.tune import TuneOptions, precompile, run_tune, runner
    from moekit.tune.space import interpreter_space

    def main():
        model, out, pids = sys.argv[1:4]
        pools = []
        submit = precompile.Precompiler.submit

        def recording(self, *a, **k):
            futures = submit(self, *a, **k)
            if self._pool is not None:
                pools.append(self._pool)
            return futures

        def timer(fn, *, reps, warmup, device, what):
            if pools:  # the search: its helpers compile ahead; SIGTERM, as `timeout` or systemd sends it
                with open(pids, "w") as f:
                    json.dump([p.pid for p in pools[0]._processes.values()], f)
                os.kill(os.getpid(), signal.SIGTERM)
            return Timing.from_samples([100.0], "fake")

        precompile.Precompiler.submit = recording
        runner.measure_time = timer
        runner.get_ceilings = lambda device: None
        runner.Worker._decide = lambda self, p, j: None
        opts = TuneOptions(models=[model], scheme="fp8-channel-token", batch_sizes=["1"], backends=["torch"], reps=1,
                           warmup=0, out=out, space=interpreter_space, argv=["tune"], gemm2=False, between=False,
                           compile_workers=1)
        return run_tune(opts).exit_code

    if __name__ == "__main__":
        sys.exit(main())
""")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # ended, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sigterm_to_the_process_ends_the_run_and_its_compile_helpers(tmp_path, tiny_model):
    """A real SIGTERM to a tune process with compile helpers: the process ended at once (status
    -15), the config in flight counted as a death, and its helper processes, blocked on their
    queue, stayed behind for good. Now the run stops as on Ctrl-C, exits with 143, and its
    helpers are shut down with it."""
    script, pids, log = tmp_path / "run.py", tmp_path / "pids.json", tmp_path / "run.log"
    script.write_text(SIGTERM_RUN)
    out = tmp_path / "out"
    with open(log, "w") as output_file:  # a file, not a pipe: a helper left behind would hold a pipe open
        run = subprocess.run([sys.executable, str(script), str(tiny_model), str(out), str(pids)], stdout=output_file,
                             stderr=subprocess.STDOUT, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    helpers = json.loads(pids.read_text()) if pids.exists() else []
    try:
        assert helpers, log.read_text()
        deadline = time.monotonic() + 60
        while not all(_gone(pid) for pid in helpers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert run.returncode == 128 + signal.SIGTERM, log.read_text()
        assert "stopped by SIGTERM" in log.read_text()
        assert all(_gone(pid) for pid in helpers), "compile helpers left running"
        assert all(j["in_flight"] == {} for j in journals(out).values())
    finally:
        for pid in helpers:  # the helpers this test's run started, left behind: ended
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------- --routing FILE: by its content


def _record_routing(path, seed):
    g = torch.Generator().manual_seed(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(64)]), path)


def test_a_recorded_routing_is_known_by_its_content_not_the_path_typed(tmp_path, tiny_model, monkeypatch):
    """The journals kept --routing FILE as typed: the same file by another relative path set
    every journal aside and measured everything again, and another routing recorded at the same
    path reused journals measured on the old one. Now the routing's content decides; the
    resolved path is kept for messages and the tables' meta. A journal of the older form, which
    cannot tell, is measured again."""
    recorded = tmp_path / "a" / "r.pt"
    _record_routing(recorded, 0)
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path / "a")
    FakeTimer().install(monkeypatch)
    result, _ = tune(tiny_model, out, batch_sizes=["1"], backends=["torch"], routing="r.pt", between=False)
    assert result.exit_code == 0
    meta = read(only_file(out / "backends"))["meta"]
    assert meta["routing"] == str(recorded.resolve()) and len(meta["routing_sha256"]) == 64

    monkeypatch.chdir(tmp_path)
    shutil.copy(recorded, tmp_path / "copy.pt")
    for typed in ("a/r.pt", "copy.pt"):  # the same routing by another path, or in another file
        again = FakeTimer().install(monkeypatch)
        result, text = tune(tiny_model, out, batch_sizes=["1"], backends=["torch"], routing=typed, between=False)
        assert result.exit_code == 0 and again.calls == [] and "set aside" not in text, text

    _record_routing(recorded, 1)  # recorded anew at the same path
    anew = FakeTimer().install(monkeypatch)
    result, text = tune(tiny_model, out, batch_sizes=["1"], backends=["torch"], routing="a/r.pt", between=False)
    assert "set aside" in text and "routing_sha256:" in text and len(anew.calls) >= 3, text

    path = next((out / ".progress").glob("*/M=1.json"))  # as an older moekit wrote it: the path as typed
    data = read(path)
    fingerprint = {k: v for k, v in data["fingerprint"].items() if k not in ("routing_file", "routing_sha256")}
    path.write_text(json.dumps({**data, "fingerprint": {**fingerprint, "routing": "a/r.pt"}}))
    older = FakeTimer().install(monkeypatch)
    result, text = tune(tiny_model, out, batch_sizes=["1"], backends=["torch"], routing="a/r.pt", between=False)
    assert "set aside" in text and "routing: 'a/r.pt' -> 'file'" in text and len(older.calls) >= 3, text


# ---------------------------------------------- the vLLM file of another scheme, the written record


def test_the_vllm_file_of_another_scheme_is_kept_before_it_is_replaced(tmp_path, tiny_model, monkeypatch):
    """fp8-channel-token and fp8-tensor-dynamic both write vLLM's dtype=fp8_w8a8 file: a second
    run of the other scheme into the same folders replaced the first's silently, since the record
    of what tune wrote had the path alone. Now it records for which problem it wrote each file,
    and keeps the other problem's file (saying so); a rerun of the same problem adds no copy."""
    FakeTimer().install(monkeypatch)
    out, export = tmp_path / "out", tmp_path / "vllm"
    tune(tiny_model, out, "fp8-channel-token", export_vllm=str(export))
    vllm_file = only_file(export)
    first = vllm_file.read_text()
    FakeTimer(us={triton(OTHER_CFG): 10.0}).install(monkeypatch)
    texts = []
    for _ in range(2):
        result, text = tune(tiny_model, out, "fp8-tensor-dynamic", export_vllm=str(export))
        assert result.exit_code == 0, text
        assert [k.read_text() for k in backups_of(vllm_file)] == [first]  # once: the rerun's own file replaced
        texts.append(text)
    assert f"kept the previous {vllm_file}" in texts[0] and "kept the previous" not in texts[1]
    record = read(out / ".progress" / "written.json")[str(vllm_file.resolve())]
    assert record["source"]["scheme"] == "fp8-tensor-dynamic" and record["source"]["top_k"] == 2
    assert record["source"]["table"].endswith(",scheme=fp8-tensor-dynamic.json")


def test_the_message_names_the_problem_that_wrote_the_vllm_file(tmp_path, tiny_model, monkeypatch):
    FakeTimer().install(monkeypatch)
    out, export = tmp_path / "out", tmp_path / "vllm"
    tune(tiny_model, out, "fp8-channel-token", export_vllm=str(export))
    _, text = tune(tiny_model, out, "fp8-tensor-dynamic", export_vllm=str(export))
    assert re.search(r"tune wrote it for another problem, E=4,N=128,H=128,device_name=\S+,scheme=fp8-channel-token "
                     r"with top-2 \(this run: .*scheme=fp8-tensor-dynamic with top-2\)", text), text


def test_an_older_record_of_the_bytes_is_still_read(tmp_path, tiny_model, monkeypatch):
    """written.json of an older moekit held the sha256 of each file's bytes: its own tables are
    replaced without copies; its vLLM file, which does not say which scheme wrote it, is kept."""
    import hashlib

    FakeTimer().install(monkeypatch)
    out, export = tmp_path / "out", tmp_path / "vllm"
    tune(tiny_model, out, export_vllm=str(export))
    record = out / ".progress" / "written.json"
    record.write_text(json.dumps({k: hashlib.sha256(Path(k).read_bytes()).hexdigest() for k in read(record)}))
    _, text = tune(tiny_model, out, export_vllm=str(export))
    assert not backups_of(only_file(out / "triton")) and not backups_of(only_file(out / "backends"))
    assert len(backups_of(only_file(export))) == 1 and "did not record for which problem" in text


@pytest.mark.parametrize("table", ["triton", "backends", "vllm"])
def test_an_interrupt_between_a_table_and_the_record_leaves_no_stray_copies(table, tmp_path, tiny_model,
                                                                            monkeypatch):
    """The record of what tune wrote was saved once, after all of a problem's files: a Ctrl-C
    between a table's write and that save left the record stale, and the rebuild that followed
    (and every one after) kept tune's own tables as .bak files, "edited, or from elsewhere"."""
    FakeTimer().install(monkeypatch)
    out, export = tmp_path / "out", tmp_path / "vllm"
    tune(tiny_model, out, batch_sizes=["1", "2"], between=False, export_vllm=str(export))
    real = output.write_json_atomically
    where = {"triton": out / "triton", "backends": out / "backends", "vllm": export}[table]
    hit = []

    def interrupted(path, data):
        written = real(path, data)
        if Path(path).parent == where and not hit:
            hit.append(path)
            raise KeyboardInterrupt  # right after the table, before anything else is saved
        return written

    monkeypatch.setattr(output, "write_json_atomically", interrupted)
    FakeTimer(us={triton(OTHER_CFG): 10.0}).install(monkeypatch)
    result, text = tune(tiny_model, out, batch_sizes=["1", "2", "4"], between=False, export_vllm=str(export))
    assert hit and result.exit_code == 130
    monkeypatch.setattr(output, "write_json_atomically", real)
    result, more = tune(tiny_model, out, batch_sizes=["1", "2", "4"], between=False, export_vllm=str(export))
    assert result.exit_code == 0
    assert "kept the previous" not in text + more, text + more
    assert not list(out.glob("*/*.bak-*")) and not list(export.glob("*.bak-*"))


# ------------------------------------------------------- an --out that cannot be used: refused first


@pytest.mark.parametrize("blocked", [".progress", "triton", "backends", ".progress/written.json", "vllm-file",
                                     "journal-folder"])
def test_an_out_layout_that_cannot_be_used_is_refused_before_measuring(blocked, tmp_path, tiny_model, monkeypatch,
                                                                      capsys):
    """A file where tune keeps a folder (.progress, triton, backends, a table's journal folder), or
    a folder where it writes a file (written.json, the vLLM file): a traceback, at the lock or at
    the first table written after the first measurements. Now one line, exit status 2, nothing
    measured."""
    timer = FakeTimer().install(monkeypatch)
    out, export = tmp_path / "out", tmp_path / "vllm"
    device = runner.device_name(torch.device("cuda:0" if CUDA else "cpu"))
    table = table_name(SHAPE, FP8_CHANNEL_TOKEN, device)
    path = {"vllm-file": export / output.vllm_file_name(4, 128, device, FP8_CHANNEL_TOKEN),
            "journal-folder": out / ".progress" / table.removesuffix(".json")}.get(blocked, out / blocked)
    path.parent.mkdir(parents=True, exist_ok=True)
    if blocked in (".progress/written.json", "vllm-file"):
        path.mkdir()
    else:
        path.write_text("not a folder")
    argv = ["tune", "--model", str(tiny_model), "--scheme", "fp8-channel-token", "--out", str(out),
            "--export-vllm", str(export), "--batch-sizes", "1", "--reps", "1", "--warmup", "0", "--no-between",
            "--no-gemm2-search"]
    if CUDA:
        argv += ["--compile-workers", "0"]
    monkeypatch.setattr("moekit.tune.plan.default_space", lambda device, search: interpreter_space)
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    assert str(path) in lines[0] and ("--export-vllm" if blocked == "vllm-file" else "--out") in lines[0]
    assert timer.calls == []
