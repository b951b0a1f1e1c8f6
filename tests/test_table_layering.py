"""Tables found for one problem are layered: each answers within the range of batch sizes it
measured, where no table found before it does (moekit.tables.find_tables' order: the user's
folders, the shipped ones, a GPU of the sharing group last). A tune of a few sizes, or a GPU's own
table of decode sizes, so hides no other size of the tables after it."""

from __future__ import annotations

import errno
import json
import os
import pathlib

import pytest
import torch

from moekit import decisions, select, tables
from moekit.accumulation import FP8_ACCUMULATION_ENV
from moekit.backends.triton.config import KernelConfig, default_config, get_config
from moekit.spec import MoEShape
from moekit.select import DeviceSpec, explain

from test_accumulation_tables import FP8, H100, H200, SHAPE, isolated, write_configs, write_decisions  # noqa: F401

DECODE_A = KernelConfig(16, 32, 128, 1, 4, 2)
DECODE_B = KernelConfig(16, 64, 128, 1, 4, 3)
A = KernelConfig(16, 32, 128, 1, 4, 2)
B = KernelConfig(16, 64, 128, 1, 4, 3)
C = KernelConfig(64, 128, 128, 8, 8, 4)
D = KernelConfig(128, 128, 128, 8, 8, 3)
SHIPPED = {m: KernelConfig(16 * (1 + i % 2), 128, 128, 1 + 7 * (i % 2), 4 + 4 * (i % 2), 3 + i % 2)
           for i, m in enumerate((1, 4, 16, 1024))}


def config(m):
    return get_config(SHAPE, FP8, m, H100)


def test_a_tune_of_a_few_sizes_leaves_the_others_to_the_tables_after_it(tmp_path):
    write_configs(tmp_path / "shipped", SHIPPED)
    write_configs(tmp_path / "user", {1: DECODE_A, 2: DECODE_B})
    select.clear_cache()
    assert config(1) == DECODE_A and config(2) == DECODE_B  # within the user's range: the user's
    # beyond it, the shipped table's sizes: 16 and 1024 (before the layering: the user's M = 2 entry)
    assert config(16) == SHIPPED[16] and config(1024) == SHIPPED[1024] and config(8192) == SHIPPED[1024]
    # the shipped M = 1 lies inside the user's range and is hidden; M = 3 is between the user's 2 and
    # the shipped 4, nearest in log space (3 * 3 > 2 * 4): the shipped 4
    assert config(3) == SHIPPED[4]
    # a user table spanning every shipped size hides them all, as before
    write_configs(tmp_path / "user", {1: DECODE_A, 8192: DECODE_B})
    select.clear_cache()
    assert config(16) == DECODE_A and config(4096) == DECODE_B


def test_a_gpus_own_decode_table_is_filled_from_a_borrowed_one_beyond_it(tmp_path):
    """The H100's own table of M = 1 and 2, the H200's (its sharing group's) of every size: the
    H100's answers at 1 and 2, the H200's beyond (before the layering, the H100 would have run its
    M = 2 entry at every larger size)."""
    write_configs(tmp_path / "shipped", SHIPPED, device_name=H200)
    write_configs(tmp_path / "shipped", {1: DECODE_A, 2: DECODE_B})
    select.clear_cache()
    assert config(1) == DECODE_A and config(2) == DECODE_B and config(1024) == SHIPPED[1024]


def test_decision_tables_are_layered_alike_and_select_says_so(tmp_path):
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    write_decisions(shipped, {1: {"triton": 30.0, "cutlass": 40.0}, 64: {"triton": 100.0, "cutlass": 90.0},
                              4096: {"triton": 900.0, "cutlass": 800.0}})
    mine = write_decisions(user, {1: {"triton": 50.0, "cutlass": 40.0}, 2: {"triton": 60.0, "cutlass": 55.0}})
    select.clear_cache()
    table = decisions.find_table(SHAPE, FP8, H100)
    assert table.path == mine and [p.m for p in table.points] == [1, 2, 64, 4096]  # the shipped M = 1 hidden
    assert table.filled_from == (shipped / "backends" / tables.table_name(SHAPE, FP8, H100),)
    device = DeviceSpec.from_name(H100)
    assert select.select_backend(SHAPE, FP8, device, torch.bfloat16, 1).backend == "cutlass"  # the user's
    assert select.select_backend(SHAPE, FP8, device, torch.bfloat16, 4096).backend == "cutlass"  # the shipped
    text = "\n".join(explain(SHAPE, FP8, device, torch.bfloat16, 4096))
    assert f"sizes measured in {table.filled_from[0]}: a table found after it answers beyond" in text
    assert "sizes measured in" not in "\n".join(explain(SHAPE, FP8, device, torch.bfloat16, 1))  # the user's own
    # only the first table found: nothing filled, nothing said
    (shipped / "backends" / tables.table_name(SHAPE, FP8, H100)).unlink()
    select.clear_cache()
    table = decisions.find_table(SHAPE, FP8, H100)
    assert table.filled_from == () and "sizes measured in" not in "\n".join(explain(SHAPE, FP8, device, torch.bfloat16, 4096))


def test_a_third_table_answers_only_beyond_the_ranges_of_both_before_it(tmp_path, monkeypatch, caplog):
    """user [1, 2], the H100's shipped [1, 16], the H200's [8, 1024]: the H200's 8 and 16 lie in
    the shipped table's range (16 on its edge) and are hidden; only 1024 is the H200's."""
    monkeypatch.setattr(tables, "_borrowed_noted", set())
    write_configs(tmp_path / "user", {1: A, 2: A})
    write_configs(tmp_path / "shipped", {1: B, 4: B, 16: B})
    write_configs(tmp_path / "shipped", {8: C, 16: C, 1024: C}, device_name=H200)
    select.clear_cache()
    with caplog.at_level("INFO", logger="moekit.tables"):
        assert [config(m) for m in (1, 2, 4, 8, 16, 1024)] == [A, A, B, B, B, C]
    assert tables.table_name(SHAPE, FP8, H200) in caplog.text  # the borrowed table it uses is logged


def test_three_decision_tables_layer_alike_and_select_names_the_borrowed_one(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tables, "_borrowed_noted", set())
    write_decisions(tmp_path / "user", {1: {"triton": 5.0, "cutlass": 4.0}, 2: {"triton": 6.0, "cutlass": 5.0}})
    shipped = write_decisions(tmp_path / "shipped", {1: {"triton": 1.0, "cutlass": 9.0},
                                                     16: {"triton": 10.0, "cutlass": 20.0}})
    borrowed = write_decisions(tmp_path / "shipped", {8: {"triton": 90.0, "cutlass": 1.0},
                                                      16: {"triton": 90.0, "cutlass": 1.0},
                                                      1024: {"triton": 900.0, "cutlass": 800.0}}, device_name=H200)
    select.clear_cache()
    with caplog.at_level("INFO", logger="moekit.tables"):
        table = decisions.find_table(SHAPE, FP8, H100)
    assert table.sizes == (1, 2, 16, 1024) and table.filled_from == (shipped, borrowed)
    assert [table.locate(m).point.winner for m in (1, 16)] == ["cutlass", "triton"]
    assert borrowed.name in caplog.text
    text = "\n".join(explain(SHAPE, FP8, DeviceSpec.from_name(H100), torch.bfloat16, 1024))
    assert f"({borrowed.name}: measured on another GPU model" in text


def test_fast_mode_tables_are_layered_before_they_refine_the_precise_ones(tmp_path, monkeypatch):
    """The user's fast tune of M = 1, 2 and the shipped fast table of the prefill sizes, both the
    H100's own, over the H100's precise table: each fast table at its own sizes."""
    write_configs(tmp_path / "shipped", {1: A, 64: A, 8192: A})
    write_configs(tmp_path / "shipped", {4096: D, 8192: D}, "fast")
    write_configs(tmp_path / "user", {1: B, 2: B}, "fast")
    shipped_fast = write_decisions(tmp_path / "shipped", {4096: {"triton": 300.0, "cutlass": 400.0}}, "fast")
    write_decisions(tmp_path / "shipped", {1: {"triton": 9.0, "cutlass": 8.0}, 4096: {"triton": 500.0, "cutlass": 400.0}})
    write_decisions(tmp_path / "user", {1: {"triton": 8.0, "cutlass": 9.0}}, "fast")
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "fast")
    select.clear_cache()
    assert [config(m) for m in (1, 2, 64, 4096, 8192)] == [B, B, A, D, D]
    table = decisions.find_table(SHAPE, FP8, H100)
    assert table.sizes == (1, 4096) and table.filled_from == (shipped_fast,)
    device = DeviceSpec.from_name(H100)
    assert [select.select_backend(SHAPE, FP8, device, torch.bfloat16, m).backend for m in (1, 4096)] == ["triton"] * 2


def test_a_table_not_used_hides_nothing(tmp_path, monkeypatch):
    """A triton table of another top_k, and an unloadable one, between valid ones: no range of theirs."""
    one, two = tmp_path / "one", tmp_path / "two"
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, f"{one}:{two}")
    path = write_configs(one, {1: C, 8192: C})
    doc = json.loads(path.read_text())
    doc["meta"]["top_k"] = SHAPE.top_k + 1
    tables.write_json_atomically(path, doc)
    write_configs(two, {1: A, 2: A})
    write_configs(tmp_path / "shipped", {1: B, 64: B})
    select.clear_cache()
    assert [config(m) for m in (1, 64, 8192)] == [A, B, B]
    (one / "backends").mkdir()
    (one / "backends" / tables.table_name(SHAPE, FP8, H100)).write_text("{not json")
    write_decisions(two, {1: {"triton": 5.0, "cutlass": 4.0}})
    write_decisions(tmp_path / "shipped", {64: {"triton": 5.0, "cutlass": 9.0}})
    skipped = []
    with pytest.warns(decisions.BackendTableWarning, match="not valid JSON"):
        table = decisions.find_table(SHAPE, FP8, H100, skipped)
    assert table.sizes == (1, 64) and len(skipped) == 1


def test_an_own_fast_tune_of_a_few_sizes_lets_no_borrowed_fast_table_over_own_precise(tmp_path, monkeypatch):
    """tables.fast_may_refine: a borrowed fast table does not override this GPU's own precise one.
    A fast tune of M = 1, 2 on the H100 must not change that at M = 4096: every fast table is
    judged before it is layered, not only the first (the H200's fast entries, layered behind the
    user's fast table, won there in the first version of the layering)."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    write_configs(shipped, {1: A, 4096: C})
    write_configs(shipped, {1: B, 4096: D}, "fast", device_name=H200)
    write_decisions(shipped, {1: {"triton": 10.0, "cutlass": 20.0}, 4096: {"triton": 500.0, "cutlass": 400.0}})
    write_decisions(shipped, {4096: {"triton": 300.0, "cutlass": 400.0}}, "fast", device_name=H200)
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "fast")
    device = DeviceSpec.from_name(H100)
    select.clear_cache()
    assert get_config(SHAPE, FP8, 4096, H100) == C
    assert select.select_backend(SHAPE, FP8, device, torch.bfloat16, 4096).backend == "cutlass"
    write_configs(user, {1: B, 2: B}, "fast")
    write_decisions(user, {1: {"triton": 10.0, "cutlass": 20.0}, 2: {"triton": 10.0, "cutlass": 20.0}}, "fast")
    select.clear_cache()
    assert get_config(SHAPE, FP8, 4096, H100) == C
    assert select.select_backend(SHAPE, FP8, device, torch.bfloat16, 4096).backend == "cutlass"


def test_select_names_the_file_the_times_used_were_measured_in(tmp_path):
    """At M = 4096 the point used is the H200 table's (the H100's own measured M = 1, 2 only):
    moekit select must not say it was measured in the H100's file."""
    mine = write_decisions(tmp_path / "shipped", {1: {"triton": 50.0, "cutlass": 40.0}, 2: {"triton": 60.0, "cutlass": 55.0}})
    theirs = write_decisions(tmp_path / "shipped", {1: {"triton": 30.0, "cutlass": 40.0},
                                                    4096: {"triton": 900.0, "cutlass": 800.0}}, device_name=H200)
    select.clear_cache()
    text = "\n".join(explain(SHAPE, FP8, DeviceSpec.from_name(H100), torch.bfloat16, 4096))
    assert f"measured (us) in {mine.name}" not in text and f"measured (us) in {theirs.name}" in text, text
    device = DeviceSpec.from_name(H100)
    assert select.select_backend(SHAPE, FP8, device, torch.bfloat16, 4096).detail.startswith(f"{theirs}: measured at M=4096")
    assert select.select_backend(SHAPE, FP8, device, torch.bfloat16, 2).detail.startswith(f"{mine}: measured at M=2")


def test_a_config_dir_that_is_not_a_folder_is_said_once(tmp_path, monkeypatch, caplog):
    """A mistyped MOEKIT_CONFIG_DIR was passed over in silence: the tuned tables never read."""
    monkeypatch.setattr(tables, "_missing_warned", set())
    typo, real = tmp_path / "tunde", tmp_path / "tuned"
    real.mkdir()
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, f"{typo}:{real}")
    with caplog.at_level("WARNING", logger="moekit.tables"):
        for kind in tables.KINDS:
            assert tables.search_dirs(kind)[:2] == [typo / kind, real / kind]
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"MOEKIT_CONFIG_DIR names {typo}, which is not a folder: no tuned tables are read from it"]


def test_a_table_folder_that_cannot_be_listed_is_skipped_with_a_warning_and_the_shipped_tables_answer(
        tmp_path, monkeypatch, caplog):
    """`moekit tune` under umask 077 leaves OUT/triton and OUT/backends mode 0700: a server of
    another user pointing MOEKIT_CONFIG_DIR there could neither list them nor stat a file in them.
    Every triton lookup raised PermissionError (a forward pass with it), and the decision side fell
    back to the heuristic, the shipped table unread. Now such a folder is skipped with one warning
    naming it, and the shipped tables answer."""
    monkeypatch.setattr(tables, "_missing_warned", set())
    user = tmp_path / "user"
    write_configs(user, {1: A, 4096: A})
    write_decisions(user, {1: {"triton": 1.0, "cutlass": 9.0}})
    write_configs(tmp_path / "shipped", {1: B, 4096: C})
    shipped = write_decisions(tmp_path / "shipped", {1: {"triton": 9.0, "cutlass": 1.0}})
    # what the kernel answers to another user (the tests may run as root, whom it lets through)
    denied = [str(user / kind) for kind in tables.KINDS]
    inside = tuple(d + os.sep for d in denied)
    real_scandir, real_stat = os.scandir, pathlib.Path.stat

    def scandir(path="."):
        if str(path) in denied or str(path).startswith(inside):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_scandir(path)

    def stat(self, *args, **kwargs):
        if str(self).startswith(inside):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(pathlib.Path, "stat", stat)
    device = DeviceSpec.from_name(H100)
    with caplog.at_level("WARNING", logger="moekit.tables"):
        for _ in range(2):  # the second time after clear_cache: nothing said again
            select.clear_cache()
            assert [config(m) for m in (1, 4096)] == [B, C]
            assert decisions.find_table(SHAPE, FP8, H100).path == shipped
            assert select.select_backend(SHAPE, FP8, device, torch.bfloat16, 1).backend == "cutlass"
    said = sorted(r.getMessage() for r in caplog.records)
    assert said == [f"moekit: cannot list the table folder {folder} (Permission denied): its tables are not read "
                    "(the other folders' and the shipped ones are)" for folder in sorted(denied)], said
    text = "\n".join(explain(SHAPE, FP8, device, torch.bfloat16, 1))
    assert f"from: decision table {shipped}" in text and f"skipped table {user / 'backends'}: cannot list" in text, text


def test_a_broken_symlink_named_like_a_table_is_skipped_with_a_warning_naming_it(tmp_path, monkeypatch, caplog):
    """A dangling link named like a table (of this device name, or of another name of its GPU
    model) in a MOEKIT_CONFIG_DIR folder: the triton lookup raised FileNotFoundError for the other
    name's, and passed over this name's without a word. Both are now skipped with one warning each,
    naming the link, and the shipped tables answer."""
    user = tmp_path / "user"
    write_configs(tmp_path / "shipped", {1: B, 4096: C})
    shipped = write_decisions(tmp_path / "shipped", {1: {"triton": 9.0, "cutlass": 1.0}})
    links = {kind: [user / kind / tables.table_name(SHAPE, FP8, name) for name in (H100, "NVIDIA H100 PCIe")]
             for kind in tables.KINDS}
    for link in links["triton"] + links["backends"]:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(tmp_path / "gone.json")
    select.clear_cache()
    with caplog.at_level("WARNING", logger="moekit.triton"), pytest.warns(decisions.BackendTableWarning) as caught:
        assert [config(m) for m in (1, 64, 4096)] == [B, B, C]
        assert decisions.find_table(SHAPE, FP8, H100).path == shipped
        assert decisions.find_table(SHAPE, FP8, H100).path == shipped
    for link in links["triton"]:
        assert [f"ignoring tuned table {link}: [Errno 2]" in r.getMessage() for r in caplog.records].count(True) == 1
    for link in links["backends"]:
        assert [f"ignoring backend table {link}: cannot read it" in str(w.message) for w in caught].count(True) == 1


def test_a_table_entry_that_cannot_run_is_skipped_when_read_and_hides_no_other_entry(tmp_path, caplog):
    """An entry that loads but cannot run (BLOCK_M=48, not a power of two) was replaced by the
    analytic default at lookup time without a word, and its size, in the range of the user's table,
    hid the shipped entries around it. README: such an entry is skipped with a warning naming it.
    It is skipped when the table is read: the file's valid entries and the shipped table answer."""
    bad = {**A.to_dict(), "BLOCK_M": 48}
    path = write_configs(tmp_path / "user", {128: D})
    doc = json.loads(path.read_text())
    tables.write_json_atomically(path, {**doc, "configs": {"64": bad, **doc["configs"]}})
    write_configs(tmp_path / "shipped", {1: B, 64: C, 4096: C})
    assert default_config(SHAPE, FP8, 64) != C  # what M = 64 and 70 ran before
    with caplog.at_level("WARNING", logger="moekit.triton"):
        assert [config(m) for m in (1, 64, 70, 128, 4096)] == [B, C, C, D, C]
        assert [config(m) for m in (64, 70)] == [C, C]
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"moekit: tuned table {path}: ignoring the entry of batch size 64: it cannot run {FP8.name}: "
                    "BLOCK_M=48 must be a power of two >= 16"], said
    # a file of no runnable entry hides nothing
    tables.write_json_atomically(path, {**doc, "configs": {"64": bad}})
    select.clear_cache()
    assert [config(m) for m in (1, 64, 4096)] == [B, C, C]
    # nor does one whose GEMM2 would keep more of the intermediate than KEEP_A2 holds (6 K steps of
    # 128 < 1024): that one raised in the forward pass (launch._check_config)
    wide = MoEShape(SHAPE.num_experts, SHAPE.hidden, 1024, SHAPE.top_k)
    keep = KernelConfig(64, 128, 128, 8, 8, 3, N_TILES2=2, KEEP_A2=1)
    assert not keep.problems(FP8)
    tables.write_json_atomically(tmp_path / "user" / "triton" / tables.table_name(wide, FP8, H100),
                                 {"meta": {}, "configs": {"64": keep.to_dict()}})
    caplog.clear()
    with caplog.at_level("WARNING", logger="moekit.triton"):
        assert get_config(wide, FP8, 64, H100) == default_config(wide, FP8, 64)
    assert "batch size 64: it cannot run fp8-channel-token: KEEP_A2=1 holds GEMM2's inner dimension in at most 6 " \
           "K steps of 128; this problem's intermediate has 1024 columns" in caplog.text
