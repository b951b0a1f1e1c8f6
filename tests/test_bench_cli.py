"""`moekit bench` end to end on the CPU: the files it writes, and its answers to bad input."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from moekit import bench, inputs, plots, timing
from moekit.backends.reference import ReferenceBackend
from moekit.cli import main

from helpers import input_recording_backend, tiny_mixtral

CPU = not torch.cuda.is_available()
FAST = ["--reps", "2", "--warmup", "1"]
PRESET = "qwen3-30b-a3b-fp8"  # fp8-block128; on the CPU scaled down to E=16 H=256 N=128 top-8
COLUMNS = [
    "model", "scheme", "backend", "chosen", "mode", "batch_size", "median_us", "p20_us", "p80_us",
    "tflops", "gbps", "floor_us", "efficiency",
]
PROVENANCE = ["device", "capability", "torch", "triton", "moekit", "git_commit", "date", "command"]
META_KEYS = set(PROVENANCE)


@pytest.fixture
def tiny_config(tmp_path):
    """A tiny bf16 Mixtral-style model: 4 experts, top-2, hidden 64, intermediate 128, 3 layers."""
    return tiny_mixtral(tmp_path, experts=4, hidden=64, intermediate=128, layers=3)


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def one_line_error(capsys) -> str:
    out, err = capsys.readouterr()
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error:"), lines[0]
    return lines[0]


# ------------------------------------------------------------------------------ end to end


def test_bench_end_to_end_writes_every_file(tmp_path, tiny_config, capsys):
    out = tmp_path / "results"
    argv = ["bench", "--model", PRESET, "--model", str(tiny_config), "--batch-sizes", "1", "4",
            "--backends", "reference", "auto", "--baseline", "reference", "--model-estimate",
            "--out", str(out), *FAST]
    assert main(argv) == 0
    text = capsys.readouterr().out
    if CPU:
        assert text.splitlines()[0].startswith("No CUDA GPU: running the CPU backends on a scaled-down shape")

    assert sorted(p.name for p in out.iterdir()) == ["bench.csv", "bench.json", "efficiency.png", "latency.png"]

    # CSV: the columns with their units in the names, one row per model x batch size x backend
    columns, rows = read_csv(out / "bench.csv")
    assert columns == COLUMNS + ["speedup_vs_reference", "rel_err", "auto_vs_fastest", "model_moe_us", "note",
                                 *PROVENANCE]
    assert len(rows) == 2 * 2 * 2
    assert {r["model"] for r in rows} == {PRESET, "tiny-moe"}
    assert {r["backend"] for r in rows} == {"reference", "auto"}
    assert {int(r["batch_size"]) for r in rows} == {1, 4}
    assert {r["mode"] for r in rows} == {"layer"}
    layers = {PRESET: 48, "tiny-moe": 3}
    for r in rows:
        med, p20, p80 = float(r["median_us"]), float(r["p20_us"]), float(r["p80_us"])
        assert 0 < p20 <= med <= p80
        assert float(r["tflops"]) > 0 and float(r["gbps"]) > 0
        assert float(r["rel_err"]) < 1e-1
        assert float(r["model_moe_us"]) == pytest.approx(med * layers[r["model"]], rel=1e-3)
        if r["backend"] == "reference":
            assert float(r["speedup_vs_reference"]) == 1.0
            assert float(r["rel_err"]) == 0.0
        if CPU:
            assert r["floor_us"] == "" and r["efficiency"] == ""
    schemes = {r["model"]: r["scheme"] for r in rows}
    assert schemes == {PRESET: "fp8-block128", "tiny-moe": "bf16"}
    assert all(r["chosen"] and r["chosen"] != "auto" for r in rows)
    # auto chose torch on the CPU, which this run did not time: no figure for its choice
    assert all(r["auto_vs_fastest"] == "" for r in rows)

    # JSON: the same rows, units, and what reproduces them
    doc = json.loads((out / "bench.json").read_text())
    meta = doc["metadata"]
    assert META_KEYS <= set(meta)
    assert meta["command"].startswith("moekit bench --model " + PRESET)
    assert meta["git_commit"]
    for r in rows:  # every CSV row says where it came from
        assert r["command"] == meta["command"] and r["date"] == meta["date"] and r["device"] == meta["device"]
        assert r["torch"] == torch.__version__ and r["git_commit"] == meta["git_commit"]
    assert meta["cpu_scaled_down"] is CPU
    assert doc["columns"] == columns
    assert len(doc["rows"]) == len(rows)
    assert doc["units"]["median_us"].startswith("µs") and doc["units"]["tflops"].startswith("TFLOP/s")
    assert "speedup_vs_reference" in doc["units"] and "model_moe_us" in doc["units"]
    shapes = {m["name"]: m["shape"] for m in meta["models"]}
    if CPU:
        assert shapes[PRESET] == {"num_experts": 16, "hidden": 256, "intermediate": 128, "n": 128,
                                  "top_k": 8, "tp": 1, "num_layers": 48}
        assert meta["ceilings"] is None and meta["capability"] is None

    # PNG plots open as images
    import matplotlib.image

    for name in ("latency.png", "efficiency.png"):
        img = matplotlib.image.imread(out / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


@pytest.mark.skipif(not CPU, reason="the CPU defaults")
def test_bench_cpu_defaults(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["bench", "--model", PRESET, "--out", str(out), "--no-check", "--no-plots", *FAST]) == 0
    _, rows = read_csv(out / "bench.csv")
    assert sorted({int(r["batch_size"]) for r in rows}) == list(bench.CPU_BATCH_SIZES)
    assert "auto" in {r["backend"] for r in rows} and "reference" in {r["backend"] for r in rows}
    assert all(r["rel_err"] == "" for r in rows)  # --no-check
    assert not (out / "latency.png").exists()
    doc = json.loads((out / "bench.json").read_text())
    text = capsys.readouterr().out
    for name, reasons in doc["metadata"]["skipped_backends"][PRESET].items():
        assert f"skipped {name}" in text and reasons


def test_bench_default_out_folder_is_timestamped(tmp_path, tiny_config, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--model", str(tiny_config), "--batch-sizes", "2", "--backends", "reference",
                 "--no-plots", "--no-check", *FAST]) == 0
    (folder,) = (tmp_path / "moekit-results").iterdir()
    assert folder.name.startswith("bench-") and len(folder.name) == len("bench-YYYYmmdd-HHMMSS")
    assert (folder / "bench.csv").is_file() and (folder / "bench.json").is_file()


def test_a_routing_file_shorter_than_the_batch_is_said_to_repeat(tmp_path, tiny_config, capsys):
    path = tmp_path / "ids.pt"
    torch.save(torch.tensor([[0, 1], [2, 3], [3, 0]]), path)
    assert main(["bench", "--model", str(tiny_config), "--routing", str(path), "--batch-sizes", "2", "5", "9",
                 "--backends", "reference", "--no-plots", "--out", str(tmp_path / "o"), *FAST]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "the routing file has 3 tokens; at M = 5, 9 its rows are repeated to fill the batch" in out


@pytest.mark.parametrize("routing", ["skewed", "file.pt", "file.npy"])
def test_bench_routings(tmp_path, tiny_config, routing):
    if routing.startswith("file"):
        ids = torch.tensor([[0, 1], [2, 3], [3, 0]])
        path = tmp_path / f"ids.{routing.split('.')[1]}"
        if path.suffix == ".pt":
            torch.save(ids, path)
        else:
            np.save(path, ids.numpy().astype(np.int32))
        routing = str(path)
    out = tmp_path / "o"
    assert main(["bench", "--model", str(tiny_config), "--routing", routing, "--batch-sizes", "5",
                 "--backends", "reference", "--no-plots", "--out", str(out), *FAST]) == 0
    doc = json.loads((out / "bench.json").read_text())
    assert doc["metadata"]["routing"] == routing
    assert doc["rows"][0]["median_us"] > 0


def test_routing_rotation_gives_every_closure_the_same_sequence():
    from moekit.models import get_model

    shape = get_model("mixtral-8x7b").shape
    rotation = inputs.make_routings("uniform", 64, shape, 3, seed=5)
    first = inputs.make_routing("uniform", 64, shape, seed=5)  # routing 0 is the point's own
    assert torch.equal(rotation.topk_ids, first[1]) and torch.equal(rotation.topk_weights, first[0])
    routings = [ids for _, ids in rotation.routings]
    assert not torch.equal(routings[0], routings[1]) and not torch.equal(routings[1], routings[2])

    def seen(name):
        rotation(name)
        return next(i for i, ids in enumerate(routings) if torch.equal(ids, rotation.topk_ids))

    # interleaved in blocks, as time_graphs runs them: each closure still gets 0, 1, 2, 0, ...
    order = [seen("a"), seen("a"), seen("b"), seen("a"), seen("b"), seen("b"), seen("a"), seen("b")]
    assert order == [0, 1, 0, 2, 1, 2, 0, 0]
    rotation.reset()
    assert torch.equal(rotation.topk_ids, first[1]) and torch.equal(rotation.topk_weights, first[0])
    assert seen("a") == 0  # reset also restarts the sequences
    # a recorded routing is the file's rows whatever the seed: one routing
    recorded = torch.tensor([[0, 1], [2, 3]])
    assert len(inputs.make_routings("file", 4, shape, 4, recorded=recorded)) == 1


def test_bench_cycles_through_routings_in_layer_mode_only(tmp_path, tiny_config, monkeypatch, registry, capsys):
    calls = []
    original = bench.time_graphs

    def spy(fns, **kw):
        calls.append(kw.get("before_each"))
        return original(fns, **kw)

    monkeypatch.setattr(bench, "time_graphs", spy)
    out = tmp_path / "o"
    assert main(["bench", "--model", str(tiny_config), "--routings", "3", "--batch-sizes", "5",
                 "--backends", "reference", "--no-plots", "--out", str(out), *FAST]) == 0
    doc = json.loads((out / "bench.json").read_text())
    assert doc["metadata"]["routings"] == 3
    assert CPU or "3 routings" in doc["metadata"]["timing"]  # the CPU timing text names no graphs
    assert isinstance(calls[-1], inputs.RoutingRotation) and len(calls[-1]) == 3
    capsys.readouterr()
    assert main(["bench", "--model", str(tiny_config), "--routings", "1", "--batch-sizes", "5",
                 "--backends", "reference", "--no-plots", "--out", str(tmp_path / "p"), *FAST]) == 0
    assert calls[-1] is None
    # one routing because it was asked for: no note (it said "a routing file is its own rows",
    # with no routing file given)
    assert "has no effect" not in capsys.readouterr().out
    # gemm mode times inputs aligned beforehand: one routing whatever --routings says
    monkeypatch.setattr(GemmOnlyBackend, "prepared", 0)  # a class-wide count another test reads
    registry(GemmOnlyBackend())
    assert main(["bench", "--model", str(tiny_config), "--mode", "gemm", "--routings", "3", "--batch-sizes", "5",
                 "--backends", "gemmonly", "--baseline", "gemmonly", "--no-plots", "--out", str(tmp_path / "g"),
                 *FAST]) == 0
    assert calls[-1] is None
    assert json.loads((tmp_path / "g" / "bench.json").read_text())["metadata"]["routings"] == 1


def test_bench_l2_flush_reaches_the_harness_and_the_metadata(tmp_path, tiny_config, monkeypatch):
    """--l2-flush picks the harness's flush (timing.FLUSH_WITH, the default its first: the
    reference points' zeroing), the run's metadata says which (none on the CPU, which flushes
    nothing), and a value the harness does not know is refused before anything runs."""
    from moekit.cli import build_parser

    seen = []
    original = bench.time_graphs

    def spy(fns, **kw):
        seen.append(kw["flush_with"])
        return original(fns, **kw)

    monkeypatch.setattr(bench, "time_graphs", spy)
    for flag, expected in (([], "zero"), (["--l2-flush", "read"], "read")):
        out = tmp_path / expected
        assert main(["bench", "--model", str(tiny_config), "--batch-sizes", "5", "--backends", "reference",
                     "--no-plots", "--out", str(out), *flag, *FAST]) == 0
        assert seen[-1] == expected
        meta = json.loads((out / "bench.json").read_text())["metadata"]
        assert meta["l2_flush"] == (None if CPU else expected)
        assert CPU or f"L2 flushed by {expected}ing a 512 MiB buffer" in meta["timing"]
    bench_parser = build_parser()._subparsers._group_actions[0].choices["bench"]
    assert tuple(next(a for a in bench_parser._actions if a.dest == "l2_flush").choices) == timing.FLUSH_WITH
    with pytest.raises(bench.BenchInputError, match="--l2-flush: 'memset' is not one of zero, read"):
        bench.run_bench(bench.BenchOptions(models=[str(tiny_config)], batch_sizes=["5"], backends=["reference"],
                                           plots=False, out=str(tmp_path / "bad"), l2_flush="memset"))
    assert not (tmp_path / "bad").exists()


class GemmOnlyBackend(ReferenceBackend):
    """A backend with the optional gemm-only hook: only the two GEMMs on pre-sorted rows."""

    name = "gemmonly"
    prepared = 0

    def prepare_gemm_only(self, x, weights, topk_weights, topk_ids):
        type(self).prepared += 1
        w13, w2 = weights.dequantize()
        e = int(topk_ids[0, 0])
        a = x.float()

        def gemms():
            h = a @ w13[e].T
            return h[:, : weights.n] @ w2[e].T

        return gemms


def test_auto_choice_cost_is_read_from_the_chosen_backends_row():
    def row(backend, us, chosen=None, M=8, model="m"):
        return {"model": model, "batch_size": M, "backend": backend, "chosen": chosen or backend, "median_us": us}

    rows = [
        row("triton", 100.0), row("cutlass", 90.0), row("auto", 80.0, chosen="triton"),  # auto's own 80 ignored
        row("triton", 50.0, M=16), row("cutlass", 60.0, M=16), row("auto", 70.0, chosen="triton", M=16),
        row("triton", 10.0, M=32), row("auto", 10.0, chosen="torch", M=32),  # torch not timed
        row("triton", None, M=64), row("auto", 9.0, chosen="triton", M=64),  # triton failed there
    ]
    bench._add_auto_choice_cost(rows)
    cost = {r["batch_size"]: r.get("auto_vs_fastest") for r in rows if r["backend"] == "auto"}
    assert cost == {8: pytest.approx(100 / 90 - 1, abs=1e-4), 16: 0.0, 32: None, 64: None}
    assert all("auto_vs_fastest" not in r for r in rows if r["backend"] != "auto")
    assert bench.auto_summary(rows) == ["auto on m: chose the fastest backend at 1 of 2 batch sizes; "
                                        "worst choice triton at M=8, +11.1%"]


def test_bench_gemm_mode_uses_the_hook_and_reports_na(tmp_path, tiny_config, registry):
    registry(GemmOnlyBackend())
    out = tmp_path / "o"
    assert main(["bench", "--model", str(tiny_config), "--mode", "gemm", "--batch-sizes", "1", "3",
                 "--backends", "gemmonly", "reference", "--baseline", "gemmonly", "--out", str(out), *FAST]) == 0
    _, rows = read_csv(out / "bench.csv")
    by_backend = {(r["backend"], r["batch_size"]): r for r in rows}
    assert GemmOnlyBackend.prepared == 2
    for m in ("1", "3"):
        timed, na = by_backend[("gemmonly", m)], by_backend[("reference", m)]
        assert timed["mode"] == "gemm" and float(timed["median_us"]) > 0
        assert float(timed["speedup_vs_gemmonly"]) == 1.0
        assert na["median_us"] == "" and na["note"] == "n/a (no gemm-only mode)"
    assert (out / "latency.png").is_file()


# ------------------------------------------------------------------------------- bad input


class RefusingBackend(ReferenceBackend):
    name = "picky"

    def supports(self, shape, scheme, device, dtype=torch.bfloat16):
        return ["needs a unicorn", "needs the moon"]


class CrashingPlotError(RuntimeError):
    pass


def _bad_cases(tmp_path, tiny_config):
    no_moe = tmp_path / "dense"
    no_moe.mkdir()
    (no_moe / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                    "intermediate_size": 128, "num_hidden_layers": 2}))
    not_a_folder = tmp_path / "file.txt"
    not_a_folder.write_text("x")
    wrong_k = tmp_path / "wrong_k.pt"
    torch.save(torch.zeros(4, 3, dtype=torch.long), wrong_k)
    out_of_range = tmp_path / "range.npy"
    np.save(out_of_range, np.array([[0, 9]]))
    floats = tmp_path / "floats.pt"
    torch.save(torch.zeros(4, 2), floats)
    repeated = tmp_path / "repeated.pt"  # token 1 sent to expert 3 twice: weighted twice everywhere, before
    torch.save(torch.tensor([[0, 1], [3, 3]]), repeated)
    m = ["--model", str(tiny_config)]
    return {
        "unknown model": (["--model", "no-such-model"], "unknown model"),
        "config without MoE fields": (["--model", str(no_moe)], "no usable MoE fields"),
        "unknown backend": (m + ["--backends", "nope"], "unknown backend"),
        "backend that cannot run": (m + ["--backends", "picky"], "needs a unicorn; needs the moon"),
        "baseline that cannot run": (m + ["--baseline", "picky"], "needs a unicorn"),
        "zero batch size": (m + ["--batch-sizes", "0"], "not a positive integer"),
        "negative batch size": (m + ["--batch-sizes", "4", "-2"], "not a positive integer"),
        "text batch size": (m + ["--batch-sizes", "many"], "not an integer"),
        "fractional batch size": (m + ["--batch-sizes", "1.5"], "not an integer"),
        # int() reads these (M = 10, M = 3); select's --batch-size refuses them
        "batch size with an underscore": (m + ["--batch-sizes", "1_0"], "'1_0' is not an integer (digits 0-9 only)"),
        "batch size in Arabic-Indic digits": (m + ["--batch-sizes", "\u0663"], "is not an integer (digits 0-9 only)"),
        "unwritable out": (m + ["--out", str(not_a_folder / "sub")], "cannot create the folder"),
        "out is a file": (m + ["--out", str(not_a_folder)], "not a folder"),
        "bad scheme": (m + ["--scheme", "int4"], "unknown quantization scheme"),
        "several schemes": (m + ["--scheme", "fp8-block128,bf16"], "this command takes one scheme (`moekit tune` takes several)"),
        "bad tp": (m + ["--tp", "0"], "--tp"),
        "tp not dividing": (m + ["--tp", "3"], "not divisible"),
        "routing file missing": (m + ["--routing", str(tmp_path / "nope.pt")], "not 'uniform', 'skewed'"),
        "routing top-k mismatch": (m + ["--routing", str(wrong_k)], "has top-k 3"),
        "routing ids out of range": (m + ["--routing", str(out_of_range)], "[0, 4)"),
        "routing of floats": (m + ["--routing", str(floats)], "must be integers"),
        "routing with a repeated expert": (m + ["--routing", str(repeated)],
                                           f"--routing {repeated}: row 1 (counting from 0) routes its token to "
                                           "expert 3 more than once"),
        # every speedup empty, and an unrequested "n/a" row, before
        "gemm mode, baseline without a gemm-only mode": (m + ["--mode", "gemm", "--baseline", "reference"],
                                                         "--baseline reference: has no GEMM-only mode"),
        "no routings": (m + ["--routings", "0"], "--routings must be a positive integer"),
        "seed too large": (m + ["--seed", str(2**44)], "--seed must be an integer in [0, 2147483648)"),
        "negative seed": (m + ["--seed", "-1"], "--seed must be an integer in [0, 2147483648)"),
        # the allocator's traceback before: 99999999999999 tokens
        "huge batch size": (m + ["--batch-sizes", "99999999999999"], "is above 65536, the largest batch size"),
        # every row "n/a (no gemm-only mode)", exit status 0 before
        "gemm mode, no gemm-only backend": (m + ["--mode", "gemm", "--backends", "reference"],
                                            "--mode gemm: none of the backends to run (reference, torch) has a GEMM-only mode"),
    }


CASES = [
    "unknown model", "config without MoE fields", "unknown backend", "backend that cannot run",
    "baseline that cannot run", "zero batch size", "negative batch size", "text batch size",
    "fractional batch size", "batch size with an underscore", "batch size in Arabic-Indic digits", "unwritable out", "out is a file", "bad scheme", "several schemes", "bad tp", "tp not dividing",
    "routing file missing", "routing top-k mismatch", "routing ids out of range", "routing of floats",
    "routing with a repeated expert", "gemm mode, baseline without a gemm-only mode",
    "no routings", "seed too large", "negative seed", "huge batch size", "gemm mode, no gemm-only backend",
]


@pytest.mark.parametrize("case", CASES)
def test_bench_bad_input_is_one_line_and_exit_2(case, tmp_path, tiny_config, registry, capsys):
    if case == "gemm mode, no gemm-only backend" and not CPU:
        pytest.skip("on a GPU the gemm-mode baseline (triton or cutlass) has a GEMM-only mode and is timed")
    registry(RefusingBackend())
    args, expected = _bad_cases(tmp_path, tiny_config)[case]
    out_given = "--out" in args
    argv = ["bench", *args, *([] if out_given else ["--out", str(tmp_path / "out")]), *FAST]
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert expected in line
    assert not (tmp_path / "out").exists()  # nothing created, let alone half-written


def test_bench_without_matplotlib_says_how_to_get_it(tmp_path, tiny_config, monkeypatch, capsys):
    def missing():
        raise plots.PlotError("plots need matplotlib, which is not installed: pip install 'moekit[plot]'")

    monkeypatch.setattr(plots, "require_matplotlib", missing)
    assert main(["bench", "--model", str(tiny_config), "--out", str(tmp_path / "o"), *FAST]) == 2
    line = one_line_error(capsys)
    assert "pip install 'moekit[plot]'" in line and "--no-plots" in line
    assert not (tmp_path / "o").exists()


def test_bench_failure_while_writing_leaves_nothing_half_written(tmp_path, tiny_config, monkeypatch):
    def crash(*args, **kwargs):
        raise CrashingPlotError("disk on fire")

    monkeypatch.setattr(plots, "efficiency_plot", crash)
    out = tmp_path / "o"
    with pytest.raises(CrashingPlotError):
        main(["bench", "--model", str(tiny_config), "--batch-sizes", "1", "--backends", "reference",
              "--out", str(out), *FAST])
    assert not out.exists()  # created by the run, left empty, removed

    out.mkdir()  # a folder that existed before is kept, without partial files
    with pytest.raises(CrashingPlotError):
        main(["bench", "--model", str(tiny_config), "--batch-sizes", "1", "--backends", "reference",
              "--out", str(out), *FAST])
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("name,value,expected", [
    ("MOEKIT_FP8_ACCUMULATION", "sloppy", "expected one of precise, fast"),
    ("MOEKIT_PDL", "maybe", "expected 1 (on, the default where the GPU has it) or 0 (off)"),
    # every auto row failed on it, after the whole run, exit status 1
    ("MOEKIT_BACKEND", "nonsense", "unknown backend 'nonsense'; expected one of: auto, "),
])
def test_a_bad_triton_setting_is_refused_before_anything_runs(name, value, expected, tmp_path, tiny_config,
                                                              monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    out = tmp_path / "o"
    assert main(["bench", "--model", str(tiny_config), "--out", str(out), *FAST]) == 2
    assert f"{name}='{value}': {expected}" in one_line_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize("mode", ["layer", "gemm"])
def test_auto_forced_to_a_backend_that_cannot_run_is_refused_before_anything_runs(mode, tmp_path, monkeypatch, capsys):
    """MOEKIT_BACKEND=cutlass (it cannot run anything on the CPU) sent auto's rows to it: each
    failed with the reason after the whole run of the others (labelled auto>auto), exit status 1.
    Now refused before any timing, exit 2, with the reasons and the backends that can."""
    monkeypatch.setenv("MOEKIT_BACKEND", "cutlass")
    out = tmp_path / "o"
    assert main(["bench", "--model", PRESET, "--mode", mode, "--backends", "auto", "torch", "--batch-sizes", "1",
                 "--no-plots", "--out", str(out), *FAST]) == 2
    err = " ".join("".join(capsys.readouterr()).split())  # the reasons are listed one per line
    assert err.startswith("error: auto's rows of") and "at M = 1: backend 'cutlass' (from MOEKIT_BACKEND=cutlass) cannot run" in err
    assert "backends that can:" in err and "unset MOEKIT_BACKEND, or name a backend that can run it" in err
    assert not out.exists()


def test_auto_forced_to_a_backend_that_can_run_runs_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEKIT_BACKEND", "torch")
    out = tmp_path / "o"
    assert main(["bench", "--model", PRESET, "--backends", "auto", "--batch-sizes", "1", "--no-plots",
                 "--out", str(out), *FAST]) == 0
    _, rows = read_csv(out / "bench.csv")
    assert [r["chosen"] for r in rows if r["backend"] == "auto"] == ["torch"]


def test_repeated_list_flags_add_up():
    """--batch-sizes 1 --batch-size 3 ran only M = 3, --backends a --backends b only b."""
    from moekit.cli import build_parser

    args = build_parser().parse_args(["bench", "--model", PRESET, "--batch-sizes", "1", "--batch-size", "3", "5",
                                      "--backends", "torch", "--backends", "reference"])
    assert args.batch_sizes == ["1", "3", "5"] and args.backends == ["torch", "reference"]


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--model", PRESET, "--mode", "fast"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["bench"])  # --model is required
    assert e.value.code == 2


@pytest.mark.parametrize("head, status, want", [
    ((0, "abc123\n"), (0, ""), "abc123"),
    ((0, "abc123\n"), (0, " M moekit/spec.py\n"), "abc123-dirty"),  # what ran is not HEAD
    ((128, ""), (0, ""), "unknown"),  # not a git checkout
    ((0, "abc123\n"), (1, ""), "unknown"),  # moekit installed inside another project's tree: not its commit
])
def test_git_commit_says_when_the_code_differs_from_head(monkeypatch, head, status, want):
    import subprocess

    import moekit.bench as bench

    def fake_run(cmd, **kw):
        rc, out = head if "rev-parse" in cmd else status
        if "ls-files" in cmd:  # is the package tracked by the checkout found? (status's rc says)
            rc, out = status[0], ""
        return subprocess.CompletedProcess(cmd, rc, out, "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    assert bench.git_commit() == want


# ------------------------------------------------------------------ Ctrl-C, earlier results


def run_main(argv) -> int:
    """main(argv), failing the test (rather than ending the session) if a Ctrl-C escapes it."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main: a traceback for the user")


def interrupt_at_call(monkeypatch, n: int) -> None:
    """Ctrl-C during the n-th time_graphs call of the run (1: before anything is measured)."""
    original, calls = bench.time_graphs, []

    def timed(fns, **kw):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return original(fns, **kw)

    monkeypatch.setattr(bench, "time_graphs", timed)


def test_bench_ctrl_c_keeps_what_was_measured_as_partial(tmp_path, tiny_config, monkeypatch, capsys):
    out = tmp_path / "o"
    argv = ["bench", "--model", str(tiny_config), "--batch-sizes", "1", "4", "--backends", "reference",
            "--baseline", "reference", "--out", str(out), *FAST]
    interrupt_at_call(monkeypatch, 2)  # M=1 measured, M=4 interrupted
    assert run_main(argv) == 130
    text = " ".join(capsys.readouterr().out.split())
    assert "interrupted: 1 of 2 points measured" in text and str(out / "bench.partial.json") in text
    # partial results under names of their own: bench.json's presence still means a complete run
    assert sorted(p.name for p in out.iterdir()) == ["bench.partial.csv", "bench.partial.json"]
    _, rows = read_csv(out / "bench.partial.csv")
    assert [(r["backend"], r["batch_size"]) for r in rows] == [("reference", "1")]
    assert float(rows[0]["median_us"]) > 0
    doc = json.loads((out / "bench.partial.json").read_text())
    assert doc["metadata"]["complete"] is False and doc["metadata"]["points_planned"] == 2
    assert len(doc["rows"]) == 1

    # the partial results are results: not replaced without --overwrite
    monkeypatch.setattr(bench, "time_graphs", timing.time_graphs)  # no more Ctrl-C
    assert run_main(argv) == 2
    assert "bench.partial.csv, bench.partial.json" in one_line_error(capsys)
    # a complete run with --overwrite supersedes them
    assert run_main([*argv, "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["bench.csv", "bench.json", "efficiency.png", "latency.png"]
    assert json.loads((out / "bench.json").read_text())["metadata"]["complete"] is True



def test_bench_stopped_by_an_error_keeps_what_was_measured_and_raises(tmp_path, tiny_config, monkeypatch, capsys):
    """A failure that stops the run (on a GPU, a CUDA error poisons the context and every later
    point): the points measured before it were lost, nothing written. Now they are written as
    partial results, as after Ctrl-C, and the error is raised on."""
    out = tmp_path / "o"
    original, calls = bench.time_graphs, []

    def timed(fns, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return original(fns, **kw)

    monkeypatch.setattr(bench, "time_graphs", timed)
    argv = ["bench", "--model", str(tiny_config), "--batch-sizes", "1", "4", "--backends", "reference",
            "--baseline", "reference", "--out", str(out), *FAST]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        main(argv)
    text = " ".join(capsys.readouterr().out.split())
    assert "stopped by RuntimeError: CUDA error: an illegal memory access was encountered: 1 of 2 points" in text
    assert sorted(p.name for p in out.iterdir()) == ["bench.partial.csv", "bench.partial.json"]
    _, rows = read_csv(out / "bench.partial.csv")
    assert [(r["backend"], r["batch_size"]) for r in rows] == [("reference", "1")]

def test_bench_ctrl_c_before_any_point_is_exit_130_and_leaves_nothing(tmp_path, tiny_config, monkeypatch, capsys):
    out = tmp_path / "o"
    interrupt_at_call(monkeypatch, 1)
    assert run_main(["bench", "--model", str(tiny_config), "--batch-sizes", "1", "--backends", "reference",
                     "--out", str(out), *FAST]) == 130
    assert capsys.readouterr().out.splitlines()[-1] == "interrupted"
    assert not out.exists()  # created by the run, nothing written in it: removed


def test_bench_refuses_to_replace_earlier_results_without_overwrite(tmp_path, tiny_config, capsys):
    out = tmp_path / "o"
    argv = ["bench", "--model", str(tiny_config), "--batch-sizes", "2", "--backends", "reference", "--no-plots",
            "--out", str(out), *FAST]
    assert main(argv) == 0
    before = (out / "bench.json").read_bytes()
    capsys.readouterr()
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert "already holds the results of an earlier run (bench.csv, bench.json)" in line and "--overwrite" in line
    assert (out / "bench.json").read_bytes() == before
    assert main([*argv, "--overwrite"]) == 0
    doc = json.loads((out / "bench.json").read_text())
    assert doc["metadata"]["command"].endswith("--overwrite")

    shared = tmp_path / "shared"  # a folder holding other files is fine: only results are protected
    shared.mkdir()
    (shared / "check.json").write_text("mine")
    assert main(["bench", "--model", str(tiny_config), "--batch-sizes", "2", "--backends", "reference",
                 "--no-plots", "--out", str(shared), *FAST]) == 0
    assert (shared / "check.json").read_text() == "mine" and (shared / "bench.json").is_file()


def test_default_out_folders_of_runs_in_the_same_second_differ(tmp_path, monkeypatch):
    import datetime
    import types

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr(bench, "datetime", types.SimpleNamespace(datetime=Frozen))
    monkeypatch.chdir(tmp_path)
    first, _ = bench.prepare_out_dir(None, "bench", results=bench.RESULT_FILES)
    (first / "bench.json").write_text("{}")
    second, created = bench.prepare_out_dir(None, "bench", results=bench.RESULT_FILES)
    assert first.name == "bench-20260102-030405" and second.name == "bench-20260102-030405-2"
    assert created and (first / "bench.json").read_text() == "{}"


# ------------------------------------------------------------------------------- messages


def test_unknown_backend_message_offers_auto_only_where_it_is_accepted(tmp_path, tiny_config, capsys):
    args = ["--model", str(tiny_config), "--backends", "bogus", "--out", str(tmp_path / "o")]
    assert main(["bench", *args]) == 2
    assert "expected auto or one of: reference" in one_line_error(capsys)
    for command in ("tune", "check"):  # both refuse auto
        assert main([command, *args]) == 2
        line = one_line_error(capsys)
        assert "unknown backend 'bogus'; expected one of: reference" in line and "auto" not in line


def test_reference_skip_reason_is_the_commands_own(tmp_path, tiny_config, monkeypatch):
    """On a GPU reference is left out by default: bench and tune do not time it, check does not
    check it; each says so in its own terms (bench's rel_err means nothing to check)."""
    monkeypatch.setattr(bench, "backend_names", lambda: ["reference"])
    problems = bench.resolve_problems([str(tiny_config)], 1, None, torch.device("cpu"))
    cuda = torch.device("cuda")  # only the plan: nothing runs there

    def reason(**kw):
        plan = bench.plan_backends(problems, None, cuda, torch.bfloat16, include_auto=False, **kw)
        return plan.skipped["tiny-moe"]["reference"][0]

    assert "too slow to time" in reason() and "rel_err" not in reason()
    from moekit import check

    checked = reason(reference_note=check.REFERENCE_NOT_CHECKED)
    assert "checked against float64 only when named in --backends" in checked and "time" not in checked
    seen = {}
    original = check.plan_backends

    def spy(*args, **kw):
        seen.update(kw)
        return original(*args, **kw)

    monkeypatch.setattr(check, "plan_backends", spy)
    assert main(["check", "--model", str(tiny_config), "--backends", "reference", "--seeds", "1",
                 "--batch-sizes", "1", "--out", str(tmp_path / "c")]) == 0
    assert seen["reference_note"] == check.REFERENCE_NOT_CHECKED


def test_floor_and_bytes_are_counted_on_the_routings_the_timed_calls_ran(tmp_path, tiny_config, monkeypatch):
    """With several routings the time is the median over calls that cycle through them, and the
    routings touch different numbers of experts: the floor and the bytes must be the medians over
    the same calls (call i runs routing i % routings), not the first routing's."""
    from moekit import roofline
    from moekit.spec import MoEShape

    ceilings = roofline.Ceilings("Fake GPU", copy_gbps=1.0, bf16_tflops=1e3, fp8_tflops=None,
                                 torch="t", triton="t", measured="now")  # memory-bound: floor follows bytes
    monkeypatch.setattr(bench.roofline, "get_ceilings", lambda device=None, refresh=False: ceilings)
    M, reps = 3, 3
    out = tmp_path / "o"
    assert main(["bench", "--model", str(tiny_config), "--routings", "4", "--batch-sizes", str(M),
                 "--backends", "reference", "--baseline", "reference", "--no-plots", "--no-check", "--out", str(out),
                 "--reps", str(reps), "--warmup", "1"]) == 0
    (row,) = json.loads((out / "bench.json").read_text())["rows"]
    shape = MoEShape(4, 64, 128, 2)
    from moekit.spec import BF16

    rotation = inputs.make_routings("uniform", M, shape, 4, seed=inputs.input_seed(0, M))
    counts = [roofline.count(shape, BF16, M, ids) for _, ids in rotation.routings]
    assert [c.experts_touched for c in counts] == [3, 4, 4, 2]  # the timed calls ran routings 0, 1, 2
    floors = [roofline.floor_us(counts[i % 4], ceilings, BF16) for i in range(reps)]
    assert row["floor_us"] == pytest.approx(float(np.median(floors)), rel=1e-3)
    assert row["floor_us"] != pytest.approx(floors[0], rel=1e-3)  # not the first routing's
    nbytes = float(np.median([counts[i % 4].bytes for i in range(reps)]))
    assert row["gbps"] == pytest.approx(nbytes / (row["median_us"] * 1e-6) / 1e9, rel=2e-3)
    assert row["efficiency"] == pytest.approx(row["floor_us"] / row["median_us"], rel=2e-3)


class NaNBackend(ReferenceBackend):
    """A backend whose output is NaN: runs, is timed, and is wrong."""

    name = "nanout"

    def run(self, x, weights, topk_weights, topk_ids):
        return torch.full_like(x, float("nan"))


def test_a_nan_output_is_an_error_with_its_time_kept(tmp_path, tiny_config, registry, capsys):
    registry(NaNBackend())
    out = tmp_path / "o"
    assert main(["bench", "--model", str(tiny_config), "--batch-sizes", "2", "--backends", "nanout", "reference",
                 "--baseline", "reference", "--no-plots", "--out", str(out), *FAST]) == 1
    _, rows = read_csv(out / "bench.csv")
    bad = next(r for r in rows if r["backend"] == "nanout")
    assert bad["note"] == "error: output has NaN or inf values" and bad["rel_err"] == ""
    assert float(bad["median_us"]) > 0  # timed all the same
    # (on a GPU the reference's host copies cannot be captured: it is timed eagerly, and says so)
    assert not next(r for r in rows if r["backend"] == "reference")["note"].startswith("error")


def test_a_zero_median_is_an_error_that_says_why_the_rates_are_empty(tmp_path, tiny_config, monkeypatch):
    """A flush-corrected median of 0 (the replays took no longer than the flush alone) leaves
    TFLOP/s, GB/s and efficiency empty: the row must say why, and the run report an error."""
    def zero_times(fns, **kw):
        return {name: timing.Timing.from_samples([0.0, 0.0], "cuda-graph", flush_us=150.0) for name in fns}

    monkeypatch.setattr(bench, "time_graphs", zero_times)
    out = tmp_path / "o"
    assert main(["bench", "--model", str(tiny_config), "--batch-sizes", "2", "--backends", "reference",
                 "--baseline", "reference", "--no-plots", "--out", str(out), *FAST]) == 1
    (row,) = json.loads((out / "bench.json").read_text())["rows"]
    assert row["median_us"] == 0.0 and row["tflops"] is None and row["gbps"] is None
    assert row["note"].startswith("error: measured 0.0 µs, at or below the timer's resolution")


def test_plots_leave_out_points_a_log_axis_cannot_hold():
    """A 0 µs median (an error row) on the log latency axis is drawn as a line off the bottom of
    the panel: the plotted series hold positive times only; the model keeps its panel."""
    rows = [
        {"model": "m", "backend": "a", "batch_size": 1, "median_us": 0.0, "p20_us": 0.0, "p80_us": 0.0},
        {"model": "m", "backend": "a", "batch_size": 2, "median_us": 10.0, "p20_us": 9.0, "p80_us": 11.0},
        {"model": "m", "backend": "b", "batch_size": 2, "median_us": None},
        {"model": "n", "backend": "a", "batch_size": 2, "median_us": 0.0, "p20_us": 0.0, "p80_us": 0.0},
    ]
    series = plots._by_model(rows)
    assert [r["batch_size"] for r in series["m"]["a"]] == [2] and "b" not in series["m"]
    assert "n" in series and not series["n"]


class FlakyBackend(ReferenceBackend):
    """Runs once (the warm-up), then fails: a backend failing on a later call of the timing."""

    name = "flaky"
    calls = 0

    def run(self, x, weights, topk_weights, topk_ids):
        type(self).calls += 1
        if type(self).calls > 1:
            raise RuntimeError("kernel failed on a later call")
        return super().run(x, weights, topk_weights, topk_ids)


class ShortBackend(ReferenceBackend):
    """Returns one row for the whole batch: broadcasting would have given it a rel err."""

    name = "short"

    def run(self, x, weights, topk_weights, topk_ids):
        return super().run(x, weights, topk_weights, topk_ids)[:1]


def test_a_backend_failing_while_timed_is_its_own_rows_error(tmp_path, tiny_config, registry):
    """On the CPU only the warm-up calls were guarded: a backend failing on a later call (a routing
    of the rotation, --warmup 0) ended the run with a traceback and nothing written."""
    FlakyBackend.calls = 0
    registry(FlakyBackend())
    out = tmp_path / "o"
    assert main(["bench", "--model", str(tiny_config), "--batch-sizes", "2", "--backends", "flaky", "reference",
                 "--baseline", "reference", "--no-plots", "--out", str(out), "--reps", "3", "--warmup", "1"]) == 1
    _, rows = read_csv(out / "bench.csv")
    flaky = next(r for r in rows if r["backend"] == "flaky")
    assert "kernel failed on a later call" in flaky["note"] and flaky["median_us"] == ""
    assert float(next(r for r in rows if r["backend"] == "reference")["median_us"]) > 0


def test_an_output_of_the_wrong_shape_fails_its_row(tmp_path, tiny_config, registry):
    registry(ShortBackend())
    out = tmp_path / "o"
    assert main(["bench", "--model", str(tiny_config), "--batch-sizes", "4", "--backends", "short", "reference",
                 "--baseline", "reference", "--no-plots", "--out", str(out), *FAST]) == 1
    _, rows = read_csv(out / "bench.csv")
    short = next(r for r in rows if r["backend"] == "short")
    assert "output has shape (1, 64), expected (4, 64)" in short["note"] and short["rel_err"] == ""


def test_llama4_layers_are_timed_and_checked_with_the_weight_on_the_input(tmp_path, registry):
    """A Llama-4 layer scales its input by the routing weight (top-1): the bench times that layer
    (the backend gets weights of one) and checks it against a reference given the same input."""
    recording = registry(input_recording_backend())
    out = tmp_path / "o"
    assert main(["bench", "--model", "llama-4-scout", "--batch-sizes", "3", "--backends", "recording",
                 "--baseline", "recording", "--no-plots", "--out", str(out), *FAST]) == 0
    assert recording.inputs
    for x, tw in recording.inputs:
        assert torch.equal(tw, torch.ones_like(tw)) and tw.shape == (3, 1)
    _, rows = read_csv(out / "bench.csv")
    (row,) = rows
    # the recording backend is the reference: given the same scaled input, bitwise the same output
    assert float(row["rel_err"]) == 0.0
    problem = json.loads((out / "bench.json").read_text())["metadata"]["models"][0]
    assert problem["apply_router_weight_on_input"] is True


def test_routing_weights_follow_the_models_renormalization():
    """Llama-4's weights are sigmoid scores, not renormalized: a top-1 weight drawn as a share of
    a sum was always 1.0, which made the weight on the input and on the output the same layer, so
    no test could tell them apart. Unnormalized weights lie in (0.05, 0.95) each."""
    for routing in (inputs.uniform_routing, inputs.skewed_routing):
        tw, _ = routing(64, 8, 1, seed=3)
        assert torch.equal(tw, torch.ones_like(tw))  # renormalized top-1: the share is all of it
        tw, _ = routing(64, 8, 1, seed=3, renormalize=False)
        assert ((tw > 0.05) & (tw < 0.95)).all() and tw.std() > 0.1
        tw, _ = routing(64, 8, 4, seed=3, renormalize=False)
        assert not torch.allclose(tw.sum(dim=1), torch.ones(64))


def test_overwrite_leaves_no_file_of_the_earlier_run(tmp_path, tiny_config, monkeypatch):
    """With --overwrite, the earlier run's plots stayed beside a --no-plots run (showing other
    backends and sizes than its CSV), and its complete bench.json beside an interrupted run's
    partial files."""
    out = tmp_path / "o"
    base = ["bench", "--model", str(tiny_config), "--backends", "reference", "--baseline", "reference",
            "--out", str(out), *FAST]
    assert main([*base, "--batch-sizes", "2"]) == 0
    assert (out / "latency.png").exists()
    assert main([*base, "--batch-sizes", "4", "--no-plots", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["bench.csv", "bench.json"]
    interrupt_at_call(monkeypatch, 2)
    assert run_main([*base, "--batch-sizes", "2", "4", "--overwrite"]) == 130
    assert sorted(p.name for p in out.iterdir()) == ["bench.partial.csv", "bench.partial.json"]


def test_paths_and_names_are_not_read_as_markup(tmp_path, tiny_config, capsys):
    """An --out with brackets was written, then printing its name raised rich's MarkupError
    (a traceback, exit 1, after a successful run)."""
    out = tmp_path / "o[/x]"
    assert main(["bench", "--model", str(tiny_config), "--batch-sizes", "2", "--backends", "reference",
                 "--baseline", "reference", "--no-plots", "--out", str(out), *FAST]) == 0
    assert f"wrote {out / 'bench.csv'}" in " ".join(capsys.readouterr().out.split())


def test_two_config_files_of_one_folder_are_two_models(tmp_path, tiny_config):
    """A config file's model is named after its folder: two config files of one folder were
    refused as the same model given twice. They keep the --model text as their names."""
    other = tiny_config / "other.json"
    other.write_text((tiny_config / "config.json").read_text())
    out = tmp_path / "o"
    a, b = str(tiny_config / "config.json"), str(other)
    assert main(["bench", "--model", a, "--model", b, "--batch-sizes", "2", "--backends", "reference",
                 "--baseline", "reference", "--no-plots", "--out", str(out), *FAST]) == 0
    _, rows = read_csv(out / "bench.csv")
    assert {r["model"] for r in rows} == {a, b}


def test_auto_summary_says_when_the_environment_chose_for_auto(monkeypatch):
    """With MOEKIT_BACKEND set, the rows named auto ran that backend, yet the summary credited
    auto ('chose the fastest backend')."""
    rows = [{"model": "m", "batch_size": 4, "chosen": "reference", bench.AUTO_COLUMN: 0.0}]
    assert "MOEKIT_BACKEND" not in bench.auto_summary(rows)[0]
    monkeypatch.setenv("MOEKIT_BACKEND", "reference")
    assert bench.auto_summary(rows)[0].endswith("(but MOEKIT_BACKEND=reference chose for auto, not its tables)")


@pytest.mark.parametrize("mode", ["gemm", "file"])
def test_routings_asked_for_where_they_cannot_apply_are_said_to_have_no_effect(mode, tmp_path, tiny_config, registry,
                                                                              monkeypatch, capsys):
    if mode == "gemm":  # a backend with a GEMM-only mode that runs here (test_bench_routings_reach...)
        monkeypatch.setattr(GemmOnlyBackend, "prepared", 0)
        registry(GemmOnlyBackend())
        args = ["--mode", "gemm", "--backends", "gemmonly", "--baseline", "gemmonly"]
    else:
        path = tmp_path / "ids.pt"
        torch.save(torch.tensor([[0, 1], [2, 3]]), path)
        args = ["--routing", str(path), "--backends", "reference"]
    assert main(["bench", "--model", str(tiny_config), "--batch-sizes", "2", "--routings", "3", "--no-plots",
                 "--out", str(tmp_path / "o"), *args, *FAST]) == 0
    out = " ".join(capsys.readouterr().out.split())
    why = "--mode gemm times one aligned routing" if mode == "gemm" else "a routing file is its own rows"
    assert f"--routings 3 has no effect here: {why}" in out


@pytest.mark.parametrize("command", ["bench", "check", "tune"])
def test_block_scales_are_checked_on_the_models_own_shape(command, tmp_path, capsys):
    """GLM-4.5V TP2 has N = 704 per GPU, not a multiple of 128: on the CPU the check ran on the
    scaled-down N = 128 and all three commands ran (select and warmup refused)."""
    assert main([command, "--model", "glm-4.5v-fp8", "--tp", "2", "--scheme", "fp8-block128", "--batch-sizes", "1",
                 "--out", str(tmp_path / "o")]) == 2
    assert "multiple of 128, got 704 (intermediate 1408 / tp 2)" in one_line_error(capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("text", ["1_0", "+5", "\u0663", "\uff11", "1 2_0"])
def test_batch_sizes_are_plain_decimal_digits(text):
    with pytest.raises(bench.BenchInputError, match="is not an integer \\(digits 0-9 only\\)"):
        bench.parse_batch_sizes([text], ())
    assert bench.parse_batch_sizes(["08,1", "64"], ()) == [8, 1, 64]


def test_gemm_mode_defaults_to_a_baseline_with_a_gemm_only_mode(tmp_path, tiny_config, registry, monkeypatch):
    """--mode gemm took the layer baseline (torch, on the CPU), which has no GEMM-only mode: an
    unrequested "n/a" row and every speedup empty."""
    monkeypatch.setattr(GemmOnlyBackend, "prepared", 0)
    registry(GemmOnlyBackend())
    out = tmp_path / "o"
    assert main(["bench", "--model", str(tiny_config), "--mode", "gemm", "--batch-sizes", "2", "--backends",
                 "gemmonly", "--no-plots", "--no-check", "--out", str(out), *FAST]) == 0
    doc = json.loads((out / "bench.json").read_text())
    baseline = doc["metadata"]["baseline"]
    assert baseline != "torch" and getattr(bench.get_backend(baseline), bench.GEMM_ONLY_HOOK, None)
    assert all(r["median_us"] and r[f"speedup_vs_{baseline}"] for r in doc["rows"])


@pytest.mark.skipif(not CPU, reason="the CPU's backends")
def test_gemm_mode_baseline_on_the_cpu():
    """On the CPU only triton has a GEMM-only mode, interpreted: the baseline when --backends
    names it; else the layer order's (and check_gemm_only refuses a run with nothing to time)."""
    problems = bench.resolve_problems(["olmoe-1b-7b"], 1, None, torch.device("cpu"))
    choose = bench.choose_baseline
    assert choose(None, problems, torch.device("cpu"), torch.bfloat16, "gemm", ["triton"]) == "triton"
    assert choose(None, problems, torch.device("cpu"), torch.bfloat16, "gemm", None) == "torch"
    assert choose(None, problems, torch.device("cpu"), torch.bfloat16, "layer", ["triton"]) == "torch"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's interpreted triton")
def test_gemm_mode_without_a_named_triton_says_how_to_name_it(monkeypatch, capsys):
    """MOEKIT_BACKEND=triton sends auto to triton, which has a GEMM-only mode, but on the CPU it is
    the baseline only when named: the refusal says so, not that no backend runs the model."""
    monkeypatch.setenv("MOEKIT_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["bench", "--model", "mixtral-8x7b", "--mode", "gemm", "--backends", "auto", "--batch-sizes", "1",
                 "--no-plots", *FAST]) == 2
    out = capsys.readouterr().out
    assert "add --backends triton or --baseline triton" in out and "separate runs" not in out, out


def test_folded_recorded_routing_keeps_each_tokens_experts_distinct():
    """A file's ids folded onto the CPU's 16 experts (id mod 16) sent 0, 16, 32 ... all to expert 0."""
    shape = bench.cpu_shape(bench.get_model("glm-4.5v-fp8", tp=2).shape)
    ids = torch.tensor([[0, 16, 32, 48, 64, 80, 96, 112], [1, 17, 2, 3, 33, 4, 5, 127]])
    _, folded = inputs.recorded_routing(ids, 5, shape)
    assert folded.shape == (5, 8) and int(folded.max()) < shape.num_experts
    assert all(len(set(row.tolist())) == 8 for row in folded)
    assert folded[0].tolist() == list(range(8))


def test_units_and_metadata_say_how_this_run_timed(tmp_path, tiny_config, capsys):
    """On the CPU bench.json's units said "L2 flushed, flush time subtracted" beside metadata
    "CPU wall clock", and --l2-flush read was dropped without a word."""
    out = tmp_path / "o"
    assert main(["bench", "--model", str(tiny_config), "--batch-sizes", "2", "--backends", "reference",
                 "--baseline", "reference", "--l2-flush", "read", "--no-plots", "--out", str(out), *FAST]) == 0
    doc = json.loads((out / "bench.json").read_text())
    text = " ".join(capsys.readouterr().out.split())
    if CPU:
        assert doc["units"]["median_us"] == bench.CPU_MEDIAN_UNIT and "flush time" not in bench.CPU_MEDIAN_UNIT
        assert "--l2-flush has no effect on the CPU" in doc["metadata"]["timing"]
        assert "--l2-flush read has no effect on the CPU: nothing is flushed" in text
    else:
        assert doc["units"]["median_us"] == bench.UNITS["median_us"] and "no effect" not in text


def test_overwrite_says_which_earlier_files_it_removed(tmp_path, tiny_config, capsys):
    out = tmp_path / "o"
    base = ["bench", "--model", str(tiny_config), "--batch-sizes", "2", "--backends", "reference", "--baseline",
            "reference", "--no-check", "--out", str(out), *FAST]
    assert main(base) == 0
    capsys.readouterr()
    assert main([*base, "--no-plots", "--overwrite"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"removed the earlier run's {out / 'latency.png'}, {out / 'efficiency.png'}" in text
    assert main([*base, "--no-plots", "--overwrite"]) == 0  # nothing left to remove: nothing said
    assert "removed" not in capsys.readouterr().out
