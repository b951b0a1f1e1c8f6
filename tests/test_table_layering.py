"""Tables found for one problem are layered: each answers within the range of batch sizes it
measured, where no table found before it does (moekit.tables.find_tables' order: the user's
folders, the shipped ones, a GPU of the sharing group last). A tune of a few sizes, or a GPU's own
table of decode sizes, so hides no other size of the tables after it."""

from __future__ import annotations

import torch

from moekit import decisions, select, tables
from moekit.backends.triton.config import KernelConfig, get_config
from moekit.select import DeviceSpec, explain

from test_accumulation_tables import FP8, H100, H200, SHAPE, isolated, write_configs, write_decisions  # noqa: F401

DECODE_A = KernelConfig(16, 32, 128, 1, 4, 2)
DECODE_B = KernelConfig(16, 64, 128, 1, 4, 3)
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
    assert "beyond the sizes it measured, filled from" in text and str(table.filled_from[0]) in text
    # only the first table found: nothing filled, nothing said
    (shipped / "backends" / tables.table_name(SHAPE, FP8, H100)).unlink()
    select.clear_cache()
    table = decisions.find_table(SHAPE, FP8, H100)
    assert table.filled_from == () and "filled from" not in "\n".join(explain(SHAPE, FP8, device, torch.bfloat16, 4096))
