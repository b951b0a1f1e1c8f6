"""scripts/ship_keepa.py: a keepa diag's winning GEMM2 launches shipped into the entries their
points read, with the table's history kept; anything inconsistent refused and nothing written."""

import json
import shutil
import sys

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import ship_keepa  # noqa: E402

from moekit.backends.triton.config import KernelConfig  # noqa: E402
from moekit.tune.space import config_key  # noqa: E402

NAME = "E=256,N=256,H=7168,device_name=NVIDIA_H200,scheme=fp8-block128.json"


def kept(entry: dict, run: int = 8, warps: int = 4) -> KernelConfig:
    """The entry's GEMM1 with a GEMM2 launch keeping A, as diag_gemm2_keep_a.py builds them."""
    cfg = KernelConfig.from_table_entry(entry)
    return cfg.gemm1().with_gemm2(BLOCK_N=128, GROUP_M=cfg.gemm2().GROUP_M, num_warps=warps, num_stages=2,
                                  N_TILES=run, KEEP_A=1)


def layer_rows(M: int, table_us: float, launches: dict[str, float]) -> list[dict]:
    rows = [{"model": "deepseek-v3", "tp": 8, "M": M, "what": "gemm2", "config": "table", "us": 1.0}]
    rows.append({"model": "deepseek-v3", "tp": 8, "M": M, "what": "layer", "config": "table", "us": table_us})
    rows += [{"model": "deepseek-v3", "tp": 8, "M": M, "what": "layer", "config": k, "us": v} for k, v in launches.items()]
    return rows


@pytest.fixture
def table(tmp_path):
    path = tmp_path / NAME
    shutil.copy(REPO / "moekit" / "configs" / "triton" / NAME, path)
    return path


def _run(tmp_path, table, rows, *extra):
    diag = tmp_path / "diag.json"
    diag.write_text(json.dumps(rows))
    return ship_keepa.main([str(diag), "--table", str(table), *extra])


def test_the_fastest_kept_launch_replaces_the_entry_its_point_reads(tmp_path, table, capsys):
    doc = json.loads(table.read_text())
    assert "256" in doc["configs"] and "255" not in doc["configs"]
    e256 = doc["configs"]["256"]
    fast, slow = kept(e256, run=8), kept(e256, run=16)
    # measured at M = 255: the backend reads entry 256 there
    rows = layer_rows(255, 500.0, {config_key(slow): 470.0, config_key(fast): 450.0})
    before = table.read_bytes()
    assert _run(tmp_path, table, rows) == 0  # without --write: prints only
    assert "entry 256" in capsys.readouterr().out and table.read_bytes() == before
    assert _run(tmp_path, table, rows, "--write", "--note", "keepa at M = 255 (test)") == 0
    after = json.loads(table.read_text())
    assert KernelConfig.from_table_entry(after["configs"]["256"]) == fast
    assert after["configs"]["256"]["us"] == 450.0
    assert after["configs"]["256"].get("default_us") == e256.get("default_us")
    assert after["meta"]["command"] == doc["meta"]["command"] + "; keepa at M = 255 (test)"
    assert {M: e for M, e in after["configs"].items() if M != "256"} == {M: e for M, e in doc["configs"].items() if M != "256"}


def test_a_gain_under_the_least_leaves_the_table_alone(tmp_path, table, capsys):
    e256 = json.loads(table.read_text())["configs"]["256"]
    before = table.read_bytes()
    rows = layer_rows(256, 500.0, {config_key(kept(e256)): 495.0})  # 1% less, under the 2% default
    assert _run(tmp_path, table, rows, "--write", "--note", "n") == 0
    assert "unchanged" in capsys.readouterr().out and table.read_bytes() == before
    assert _run(tmp_path, table, rows, "--write", "--note", "n", "--min-gain", "0.005") == 0
    assert json.loads(table.read_text())["configs"]["256"]["us"] == 495.0


@pytest.mark.parametrize("case", ["other gemm1", "points disagree", "no note", "no table time"])
def test_inconsistent_runs_are_refused_and_nothing_is_written(tmp_path, table, capsys, case):
    e256 = json.loads(table.read_text())["configs"]["256"]
    good = config_key(kept(e256))
    if case == "other gemm1":
        other = {**e256, "num_warps": 8 if e256["num_warps"] == 4 else 4}
        rows, extra, says = layer_rows(256, 500.0, {config_key(kept(other)): 400.0}), ["--note", "n"], "another GEMM1"
    elif case == "points disagree":
        rows = layer_rows(250, 500.0, {good: 400.0}) + layer_rows(260, 500.0, {config_key(kept(e256, warps=8)): 400.0})
        extra, says = ["--note", "n"], "chose different launches"
    elif case == "no note":
        rows, extra, says = layer_rows(256, 500.0, {good: 400.0}), [], "needs --note"
    else:
        rows = [r for r in layer_rows(256, 500.0, {good: 400.0}) if r["config"] != "table" or r["what"] != "layer"]
        extra, says = ["--note", "n"], "no whole-layer time"
    before = table.read_bytes()
    assert _run(tmp_path, table, rows, "--write", *extra) == 1
    assert says in capsys.readouterr().err and table.read_bytes() == before


def test_a_run_on_another_gpu_is_refused(tmp_path, table):
    """diag_gemm2_keep_a.py writes the GPU's name in its rows: a run on an H100 is not shipped into
    the H200's table, even where the two tables' entries share a GEMM1."""
    e256 = json.loads(table.read_text())["configs"]["256"]
    rows = layer_rows(256, 500.0, {config_key(kept(e256)): 400.0})
    before = table.read_bytes()
    with pytest.raises(SystemExit, match="ran on NVIDIA_H100_80GB_HBM3"):
        _run(tmp_path, table, [{**r, "device_name": "NVIDIA_H100_80GB_HBM3"} for r in rows], "--write", "--note", "n")
    assert table.read_bytes() == before
    assert _run(tmp_path, table, [{**r, "device_name": "NVIDIA_H200"} for r in rows], "--write", "--note", "n") == 0
    assert json.loads(table.read_text())["configs"]["256"]["us"] == 400.0
