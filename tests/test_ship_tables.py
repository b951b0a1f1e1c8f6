"""scripts/ship_tables.py: a tune run's tables compared with the shipped ones and shipped with
their history kept; a table of fewer sizes refused."""

import json
import re
import shutil
import sys

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import ship_tables  # noqa: E402

NAME = "E=256,N=256,H=7168,device_name=NVIDIA_H100_80GB_HBM3,scheme=fp8-block128.json"


@pytest.fixture
def dirs(tmp_path):
    """(shipped folder holding a copy of a real shipped H100 table pair, tuned folder with a
    retimed version of it: M = 1 on another config, M = 2 retimed, the backend decision at M = 1
    won by another backend)."""
    shipped, tuned = tmp_path / "configs", tmp_path / "tuned"
    for kind in ("triton", "backends"):
        (shipped / kind).mkdir(parents=True)
        (tuned / kind).mkdir(parents=True)
        shutil.copy(REPO / "moekit" / "configs" / kind / NAME, shipped / kind / NAME)
    triton = json.loads((shipped / "triton" / NAME).read_text())
    triton["meta"]["command"] = "moekit tune --model deepseek-v3 --tp 8 --batch-sizes 1 2 4 8"
    triton["meta"]["gemm2_search"] = True
    triton["configs"]["1"] = {**triton["configs"]["1"], "num_warps": 4, "us": 30.5}
    triton["configs"]["2"] = {**triton["configs"]["2"], "us": triton["configs"]["2"]["us"] + 1}
    backends = json.loads((shipped / "backends" / NAME).read_text())
    backends["meta"] = {**backends["meta"], "date": "2099-01-01", "torch": "9.9"}
    backends["meta"].pop("updated", None)
    backends["batch_sizes"]["1"] = {**backends["batch_sizes"]["1"], "winner": "torch"}
    (tuned / "triton" / NAME).write_text(json.dumps(triton))
    (tuned / "backends" / NAME).write_text(json.dumps(backends))
    return shipped, tuned


def _read(folder, kind):
    return json.loads((folder / kind / NAME).read_text())


def test_comparing_writes_nothing_and_names_each_changed_size(dirs, capsys):
    shipped, tuned = dirs
    before = {kind: (shipped / kind / NAME).read_bytes() for kind in ("triton", "backends")}
    assert ship_tables.main([str(tuned), "--into", str(shipped)]) == 0
    out = capsys.readouterr().out
    assert "M=1: config changed" in out and "M=2: same config, retimed" in out and "M=4" not in out
    assert "M=1: winner triton -> torch" in out
    assert all((shipped / kind / NAME).read_bytes() == before[kind] for kind in before)


def test_shipping_keeps_the_history_of_both_tables(dirs):
    shipped, tuned = dirs
    old_triton, old_backends = _read(shipped, "triton"), _read(shipped, "backends")
    assert ship_tables.main([str(tuned), "--into", str(shipped), "--write", "--note", "then M = 1 retimed"]) == 0
    triton, backends = _read(shipped, "triton"), _read(shipped, "backends")
    assert triton["configs"] == _read(tuned, "triton")["configs"]
    assert triton["meta"]["command"] == old_triton["meta"]["command"] + "; then M = 1 retimed"
    assert triton["meta"]["gemm2_search"] == old_triton["meta"]["gemm2_search"]
    assert backends["batch_sizes"] == _read(tuned, "backends")["batch_sizes"]
    assert (backends["meta"]["date"], backends["meta"]["torch"]) == ("2099-01-01", "9.9")  # the run's meta
    assert backends["meta"]["updated"] == old_backends["meta"]["updated"] + "; then M = 1 retimed"
    shipped_once = {kind: (shipped / kind / NAME).read_bytes() for kind in ("triton", "backends")}
    assert ship_tables.main([str(tuned), "--into", str(shipped), "--write", "--note", "then M = 1 retimed"]) == 0
    assert all((shipped / kind / NAME).read_bytes() == shipped_once[kind] for kind in shipped_once)  # nothing new


def test_a_shipped_table_without_gemm2_search_does_not_take_the_runs(dirs):
    shipped, tuned = dirs
    old = _read(shipped, "triton")
    old["meta"].pop("gemm2_search")
    (shipped / "triton" / NAME).write_text(json.dumps(old))
    assert ship_tables.main([str(tuned), "--into", str(shipped), "--write", "--note", "n"]) == 0
    assert "gemm2_search" not in _read(shipped, "triton")["meta"]


def test_replacing_a_shipped_table_needs_a_note(dirs, capsys):
    shipped, tuned = dirs
    before = {kind: (shipped / kind / NAME).read_bytes() for kind in ("triton", "backends")}
    assert ship_tables.main([str(tuned), "--into", str(shipped), "--write"]) == 1
    assert "needs --note" in capsys.readouterr().err
    assert all((shipped / kind / NAME).read_bytes() == before[kind] for kind in before)


def test_a_backend_table_of_fewer_sizes_keeps_its_triton_table_from_shipping_unless_allowed(dirs, capsys):
    shipped, tuned = dirs
    backends = _read(tuned, "backends")
    del backends["batch_sizes"]["8192"]
    (tuned / "backends" / NAME).write_text(json.dumps(backends))
    before = {kind: (shipped / kind / NAME).read_bytes() for kind in ("triton", "backends")}
    assert ship_tables.main([str(tuned), "--into", str(shipped), "--write", "--note", "n"]) == 1
    assert "backends/" + NAME + ": lacks M=8192" in capsys.readouterr().err
    assert all((shipped / kind / NAME).read_bytes() == before[kind] for kind in before)  # neither shipped
    assert ship_tables.main([str(tuned), "--into", str(shipped), "--write", "--note", "n", "--allow-fewer-sizes"]) == 0
    assert "8192" not in _read(shipped, "backends")["batch_sizes"]
    assert _read(shipped, "triton")["configs"]["1"]["num_warps"] == 4


@pytest.mark.parametrize("kind,spoil,message", [
    ("triton", lambda d: d["configs"]["1"].update(BLOCK_SIZE_M=16), r"batch size 1: unknown key"),
    ("triton", lambda d: d["meta"].update(fp8_accumulation="fast"), r"fast"),
    ("backends", lambda d: d["batch_sizes"]["1"].update(winner="nobody"), r"winner 'nobody' is not among"),
    ("backends", lambda d: d["meta"].update(hidden=1), r"meta.hidden is 1 but the file name says 7168"),
])
def test_a_table_moekit_would_not_read_ships_nothing(dirs, capsys, kind, spoil, message):
    shipped, tuned = dirs
    doc = _read(tuned, kind)
    spoil(doc)
    (tuned / kind / NAME).write_text(json.dumps(doc))
    before = {k: (shipped / k / NAME).read_bytes() for k in ("triton", "backends")}
    assert ship_tables.main([str(tuned), "--into", str(shipped), "--write", "--note", "n"]) == 1
    err = capsys.readouterr().err
    assert f"{kind}/{NAME}: moekit would not read it" in err and re.search(message, err), err
    assert all((shipped / k / NAME).read_bytes() == before[k] for k in before)


def test_a_new_table_is_copied_and_a_folder_without_tables_is_refused(dirs, tmp_path):
    shipped, tuned = dirs
    (shipped / "triton" / NAME).unlink()
    assert ship_tables.main([str(tuned), "--into", str(shipped), "--write", "--only", "E=256", "--note", "n"]) == 0
    assert _read(shipped, "triton") == _read(tuned, "triton")  # a new table is copied as it is
    with pytest.raises(SystemExit, match="no tables under .* matching"):
        ship_tables.main([str(tuned), "--into", str(shipped), "--only", "E=999"])
    with pytest.raises(SystemExit, match="no tables under"):
        ship_tables.main([str(tmp_path / "empty"), "--into", str(shipped)])


def test_merging_takes_only_the_runs_sizes_and_keeps_the_shipped_meta(dirs):
    """A fresh tune of M = 1 and 2 writes tables of those sizes alone: --merge puts them into the
    shipped tables, whose other sizes and meta stay."""
    shipped, tuned = dirs
    old_triton, old_backends = _read(shipped, "triton"), _read(shipped, "backends")
    old_triton["meta"]["incomplete_batch_sizes"] = [2, 64, 128]  # the shipped search stopped early at M = 2, 64, 128
    (shipped / "triton" / NAME).write_text(json.dumps(old_triton))
    for kind, field in (("triton", "configs"), ("backends", "batch_sizes")):
        doc = _read(tuned, kind)
        doc[field] = {M: doc[field][M] for M in ("1", "2")}
        doc["meta"]["incomplete_batch_sizes"] = [1]  # this run's stopped early at M = 1, not 2
        (tuned / kind / NAME).write_text(json.dumps(doc))
    assert ship_tables.main([str(tuned), "--into", str(shipped), "--write", "--merge", "--note", "then M = 1, 2"]) == 0
    triton, backends = _read(shipped, "triton"), _read(shipped, "backends")
    assert triton["configs"] == {**old_triton["configs"], "1": _read(tuned, "triton")["configs"]["1"],
                                 "2": _read(tuned, "triton")["configs"]["2"]}
    assert list(triton["configs"]) == sorted(triton["configs"], key=int)
    assert triton["meta"] == {**old_triton["meta"], "command": old_triton["meta"]["command"] + "; then M = 1, 2",
                              "incomplete_batch_sizes": [1, 64, 128]}
    assert backends["batch_sizes"]["1"]["winner"] == "torch" and backends["batch_sizes"]["4"] == old_backends["batch_sizes"]["4"]
    assert backends["meta"] == {**old_backends["meta"], "updated": old_backends["meta"]["updated"] + "; then M = 1, 2"}
    with pytest.raises(SystemExit):  # one or the other
        ship_tables.main([str(tuned), "--into", str(shipped), "--merge", "--allow-fewer-sizes"])
