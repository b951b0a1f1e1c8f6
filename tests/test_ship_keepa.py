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


def layer_rows(M: int, table_us: float, launches: dict[str, float], **provenance) -> list[dict]:
    """The diag's rows at one point, as diag_gemm2_keep_a.py writes them (a GEMM2-alone row too,
    which is not read); on the H200 unless `provenance` says otherwise."""
    base = {"model": "deepseek-v3", "tp": 8, "M": M, "device_name": "NVIDIA_H200", **provenance}
    rows = [{**base, "what": "gemm2", "config": "table", "us": 1.0}]
    rows.append({**base, "what": "layer", "config": "table", "us": table_us})
    return rows + [{**base, "what": "layer", "config": k, "us": v} for k, v in launches.items()]


@pytest.fixture
def table(tmp_path):
    path = tmp_path / NAME
    shutil.copy(REPO / "moekit" / "configs" / "triton" / NAME, path)
    return path


def entries(table) -> dict:
    return json.loads(table.read_text())["configs"]


def _run(tmp_path, table, rows, *extra):
    diag = tmp_path / "diag.json"
    diag.write_text(json.dumps(rows))
    return ship_keepa.main([str(diag), "--table", str(table), *extra])


def test_the_fastest_kept_launch_replaces_the_entry_its_point_reads(tmp_path, table, capsys):
    doc = json.loads(table.read_text())
    assert "256" in doc["configs"] and "255" not in doc["configs"]
    e256 = doc["configs"]["256"]
    fast, slow = kept(e256, run=8), kept(e256, run=16)
    assert fast != KernelConfig.from_table_entry(e256)
    # measured at M = 255: the backend reads entry 256 there
    rows = layer_rows(255, 500.0, {config_key(slow): 470.0, config_key(fast): 450.0},
                      table_config=config_key(KernelConfig.from_table_entry(e256)), table_file=NAME)
    before = table.read_bytes()
    assert _run(tmp_path, table, rows) == 0  # without --write: prints only
    assert "entry 256" in capsys.readouterr().out and table.read_bytes() == before
    assert _run(tmp_path, table, rows, "--write", "--note", "keepa at M = 255 (test)") == 0
    after = json.loads(table.read_text())
    assert KernelConfig.from_table_entry(after["configs"]["256"]) == fast
    # a time at M = 255 is not entry 256's; the analytic default's time is not comparable with it
    assert "us" not in after["configs"]["256"] and "default_us" not in after["configs"]["256"]
    assert after["meta"]["command"] == doc["meta"]["command"] + "; keepa at M = 255 (test)"
    assert {M: e for M, e in after["configs"].items() if M != "256"} == {M: e for M, e in doc["configs"].items() if M != "256"}


def test_a_point_at_the_entrys_own_size_records_its_time(tmp_path, table):
    e256 = entries(table)["256"]
    assert _run(tmp_path, table, layer_rows(256, 500.0, {config_key(kept(e256)): 450.0}), "--write", "--note", "n") == 0
    assert entries(table)["256"]["us"] == 450.0


def test_a_gain_under_the_least_leaves_the_table_alone(tmp_path, table, capsys):
    e256 = entries(table)["256"]
    before = table.read_bytes()
    rows = layer_rows(256, 500.0, {config_key(kept(e256)): 495.0})  # 1% less, under the 2% default
    assert _run(tmp_path, table, rows, "--write", "--note", "n") == 0
    assert "unchanged" in capsys.readouterr().out and table.read_bytes() == before
    assert _run(tmp_path, table, rows, "--write", "--note", "n", "--min-gain", "0.005") == 0
    assert entries(table)["256"]["us"] == 495.0


def test_the_tables_own_launch_is_no_change(tmp_path, table, capsys):
    """Where the entry keeps A already, the diag times its own launch among the kept ones: even
    at --min-gain 0 that rewrites nothing."""
    e256 = entries(table)["256"]
    own = kept(e256)
    rows = layer_rows(256, 500.0, {config_key(own): 450.0})
    assert _run(tmp_path, table, rows, "--write", "--note", "n") == 0  # entry 256 now runs `own`
    before = table.read_bytes()
    assert _run(tmp_path, table, layer_rows(256, 500.0, {config_key(own): 499.0}), "--write", "--note", "again",
                "--min-gain", "0") == 0
    assert "no kept launch other than the table's" in capsys.readouterr().out and table.read_bytes() == before


CASES = ["other gemm1", "points disagree", "one point unchanged", "no note", "no table time", "other table config",
         "other table file", "other gpu", "gpu unnamed", "gpu unnamed in some rows", "bad row"]


@pytest.mark.parametrize("case", CASES)
def test_inconsistent_runs_are_refused_and_nothing_is_written(tmp_path, table, capsys, case):
    e256 = entries(table)["256"]
    good = config_key(kept(e256))
    rows, extra = layer_rows(256, 500.0, {good: 400.0}), ["--note", "n"]
    if case == "other gemm1":
        other = {**e256, "num_warps": 8 if e256["num_warps"] == 4 else 4}
        rows, says = layer_rows(256, 500.0, {config_key(kept(other)): 400.0}), "another GEMM1"
    elif case == "points disagree":
        rows = layer_rows(250, 500.0, {good: 400.0}) + layer_rows(260, 500.0, {config_key(kept(e256, warps=8)): 400.0})
        says = "chose different launches"
    elif case == "one point unchanged":
        rows = layer_rows(250, 500.0, {good: 400.0}) + layer_rows(260, 500.0, {good: 499.0})
        says = "chose different launches"
    elif case == "no note":
        extra, says = [], "needs --note"
    elif case == "no table time":
        rows = [r for r in rows if r["config"] != "table" or r["what"] != "layer"]
        says = "no whole-layer time"
    elif case == "other table config":
        rows = layer_rows(256, 500.0, {good: 400.0}, table_config="M64-N128-K128-G16-w8-s4")
        says = "ran M64-N128-K128-G16-w8-s4 as the table's config"
    elif case == "other table file":
        rows = layer_rows(256, 500.0, {good: 400.0}, table_file=NAME.replace("H200", "H100_80GB_HBM3"))
        says = "the diag read E=256"
    elif case == "other gpu":  # an H100 run: its entry 256 may share a GEMM1 with the H200's
        rows, says = layer_rows(256, 500.0, {good: 400.0}, device_name="NVIDIA_H100_80GB_HBM3"), "ran on NVIDIA_H100"
    elif case == "gpu unnamed":  # a diag of before the thirty-eighth session
        rows = [{k: v for k, v in r.items() if k != "device_name"} for r in rows]
        says = "pass --measured-on"
    elif case == "gpu unnamed in some rows":
        rows = layer_rows(250, 500.0, {good: 400.0}) + [{k: v for k, v in r.items() if k != "device_name"}
                                                        for r in layer_rows(260, 500.0, {good: 400.0})]
        says = "others do not"
    before = table.read_bytes()
    if case == "bad row":
        rows[1]["us"] = None
        with pytest.raises(SystemExit, match="diag row 1 is not a whole-layer timing"):
            _run(tmp_path, table, rows, "--write", *extra)
    else:
        assert _run(tmp_path, table, rows, "--write", *extra) == 1
        assert says in capsys.readouterr().err
    assert table.read_bytes() == before


def test_measured_on_names_the_gpu_of_rows_that_do_not(tmp_path, table):
    rows = [{k: v for k, v in r.items() if k != "device_name"}
            for r in layer_rows(256, 500.0, {config_key(kept(entries(table)["256"])): 400.0})]
    assert _run(tmp_path, table, rows, "--measured-on", "NVIDIA_H100_80GB_HBM3", "--write", "--note", "n") == 1
    assert _run(tmp_path, table, rows, "--measured-on", "NVIDIA H200", "--write", "--note", "n") == 0  # as the GPU says it
    assert entries(table)["256"]["us"] == 400.0


def test_a_point_reads_the_nearest_tiled_entry_as_the_backend_does(tmp_path, table):
    """The diag runs only points where the backend ran the tiled path: at M = 9, with a GEMV
    entry at 8 and a tiled one at 11, the backend ran entry 11's config (a GEMV entry is taken
    only where the GEMV path may win), so the launch goes there, not to the GEMV entry."""
    doc = json.loads(table.read_text())
    gemv = next(e for e in doc["configs"].values() if e.get("GEMV"))
    doc["configs"]["8"] = gemv
    table.write_text(json.dumps(doc))
    assert "9" not in doc["configs"] and not doc["configs"]["11"].get("GEMV")
    e11 = doc["configs"]["11"]
    rows = layer_rows(9, 500.0, {config_key(kept(e11)): 400.0}, table_config=config_key(KernelConfig.from_table_entry(e11)))
    assert _run(tmp_path, table, rows, "--write", "--note", "n") == 0
    assert KernelConfig.from_table_entry(entries(table)["11"]) == kept(e11) and entries(table)["8"] == gemv


def test_a_table_moekit_would_not_read_is_refused(tmp_path, table):
    """The table is checked as ship_tables.py checks what it ships (entries, name against meta)."""
    doc = json.loads(table.read_text())
    doc["configs"]["256"] = {**doc["configs"]["256"], "num_warps": 0}
    table.write_text(json.dumps(doc))
    rows = layer_rows(256, 500.0, {"M16-N128-K128-G16-w4-s3+N64-G16-w4-s2-r8-ka": 400.0})
    with pytest.raises(SystemExit, match="moekit would not read it as a triton table: batch size 256"):
        _run(tmp_path, table, rows, "--write", "--note", "n")
