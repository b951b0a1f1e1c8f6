"""Tables tuned in fast FP8 accumulation mode: filed apart, and refining the precise ones."""

from __future__ import annotations

import json
import os
from unittest import mock
import warnings

import pytest
import torch

from moekit import decisions, select, tables
from moekit.accumulation import FP8_ACCUMULATION_ENV, accumulation_matters, table_accumulation
from moekit.backends.triton.config import KernelConfig, default_config, get_config
from moekit.select import DeviceSpec, explain, select_backend
from moekit.spec import SCHEMES, MoEShape, get_scheme
from moekit.tables import SHIPPED_ROOT

from test_select_auto import table_data

H100 = "NVIDIA H100 80GB HBM3"
SHAPE = MoEShape(8, 256, 256, 2)
FP8 = get_scheme("fp8-channel-token")
BLOCK = get_scheme("fp8-block128")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Only the test's own tables, in a user folder; precise mode unless a test says otherwise."""
    monkeypatch.setattr(tables, "SHIPPED_ROOT", tmp_path / "shipped")
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path / "user"))
    monkeypatch.delenv(FP8_ACCUMULATION_ENV, raising=False)
    monkeypatch.delenv(select.ENV_VAR, raising=False)
    monkeypatch.setattr(select, "_supports_cache", {})
    monkeypatch.setattr(decisions, "_warned", set())


def test_table_names_carry_the_mode_only_where_it_matters(monkeypatch):
    precise = tables.table_name(SHAPE, FP8, H100)
    assert precise == "E=8,N=256,H=256,device_name=NVIDIA_H100_80GB_HBM3,scheme=fp8-channel-token.json"
    assert tables.table_name(SHAPE, FP8, H100, "fast") == precise.removesuffix(".json") + ",fp8_accumulation=fast.json"
    for name, mode in ((precise, "precise"), (tables.table_name(SHAPE, FP8, H100, "fast"), "fast")):
        assert tables.parse_table_name(name) == {"num_experts": 8, "intermediate": 256, "hidden": 256,
                                                 "device_name": "NVIDIA_H100_80GB_HBM3", "scheme": FP8.name,
                                                 "fp8_accumulation": mode}
    assert tables.parse_table_name("E=8,N=256,H=256.json") is None
    with pytest.raises(ValueError, match="accumulation 'sloppy': expected one of precise, fast"):
        tables.table_name(SHAPE, FP8, H100, "sloppy")
    # the mode changes a kernel only where the scales are constant along K
    assert {s.name for s in SCHEMES.values() if accumulation_matters(s)} == {
        "fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token"}
    assert table_accumulation(FP8) == "precise"
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "fast")
    assert table_accumulation(FP8) == "fast"
    assert table_accumulation(BLOCK) == table_accumulation(get_scheme("bf16")) == "precise"


def write_configs(root, configs: dict[int, KernelConfig], accumulation="precise", scheme=FP8, device_name=H100):
    path = root / "triton" / tables.table_name(SHAPE, scheme, device_name, accumulation)
    meta = {"device_name": device_name, **({"fp8_accumulation": accumulation} if accumulation != "precise" else {})}
    return tables.write_json_atomically(path, {"meta": meta, "configs": {str(m): c.to_dict() for m, c in configs.items()}})


PRECISE_SMALL = KernelConfig(16, 64, 128, 1, 4, 3)
PRECISE_LARGE = KernelConfig(64, 128, 128, 8, 8, 4)
FAST_LARGE = KernelConfig(64, 128, 128, 8, 8, 3)
FAST_LARGEST = KernelConfig(128, 128, 128, 8, 8, 3)


def test_fast_configs_refine_the_precise_table_at_their_sizes(tmp_path, monkeypatch):
    user = tmp_path / "user"
    write_configs(user, {1: PRECISE_SMALL, 4096: PRECISE_LARGE})
    write_configs(user, {4096: FAST_LARGE, 8192: FAST_LARGEST}, "fast")
    config = lambda m, scheme=FP8: get_config(SHAPE, scheme, m, H100)  # noqa: E731
    assert [config(m) for m in (1, 4096, 8192)] == [PRECISE_SMALL, PRECISE_LARGE, PRECISE_LARGE]
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "fast")
    assert [config(m) for m in (1, 16, 4096, 6000, 8192)] == [PRECISE_SMALL, PRECISE_SMALL, FAST_LARGE, FAST_LARGEST, FAST_LARGEST]
    # a scheme the mode does not change reads its precise table in either mode
    write_configs(user, {1: PRECISE_SMALL}, scheme=BLOCK)
    write_configs(user, {1: FAST_LARGE}, "fast", scheme=BLOCK)
    assert config(1, BLOCK) == PRECISE_SMALL
    # a fast table alone serves every size (once the process forgets what it looked up)
    (user / "triton" / tables.table_name(SHAPE, FP8, H100)).unlink()
    assert config(1) == PRECISE_SMALL
    select.clear_cache()
    assert config(1) == FAST_LARGE


def test_a_triton_table_whose_meta_says_another_mode_is_ignored(tmp_path, monkeypatch, caplog):
    """A table tuned in fast mode before such tables had names of their own sits under the
    precise name; it must not serve precise mode."""
    user = tmp_path / "user"
    path = write_configs(user, {1: FAST_LARGE})
    data = json.loads(path.read_text())
    data["meta"]["fp8_accumulation"] = "fast"
    tables.write_json_atomically(path, data)
    with caplog.at_level("WARNING", logger="moekit.triton"):
        assert get_config(SHAPE, FP8, 1, H100) == default_config(SHAPE, FP8, 1)
    assert "meta.fp8_accumulation is 'fast' but the file name says 'precise'" in caplog.text


def test_every_shipped_table_says_the_mode_its_name_says():
    shipped = sorted(SHIPPED_ROOT.glob("*/*.json"))  # the real folder (the fixture hides it from lookups)
    assert any(tables.parse_table_name(p.name)["fp8_accumulation"] == "fast" for p in shipped)
    for path in shipped:
        named = tables.parse_table_name(path.name)
        assert named is not None, path.name
        assert json.loads(path.read_text())["meta"].get("fp8_accumulation", "precise") == named["fp8_accumulation"], path.name


def write_decisions(root, points, accumulation="precise", device_name=H100):
    path = root / "backends" / tables.table_name(SHAPE, FP8, device_name, accumulation)
    meta = {"fp8_accumulation": accumulation} if accumulation != "precise" else {}
    return tables.write_json_atomically(path, table_data(SHAPE, FP8, device_name, points, **meta))


H200 = "NVIDIA H200"


def test_a_borrowed_fast_table_does_not_refine_this_gpus_own_precise_one(tmp_path, monkeypatch):
    """A table of another GPU model is the last resort: in fast mode, an H200 fast table does not
    override an H100's own precise measurements (configs and decisions alike), and refines a
    precise table borrowed from the H200 as it would on the H200."""
    monkeypatch.setattr(tables, "_borrowed_noted", set())
    user = tmp_path / "user"
    write_configs(user, {4096: FAST_LARGEST}, "fast", device_name=H200)
    write_decisions(user, {4096: {"triton": 350.0, "cutlass": 400.0}}, "fast", device_name=H200)
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "fast")
    # nothing of the H100's own: the H200's fast tables
    assert get_config(SHAPE, FP8, 4096, H100) == FAST_LARGEST and choose(4096).backend == "triton"
    # the H100's own precise tables: they win over the H200's fast ones
    write_configs(user, {4096: PRECISE_LARGE})
    write_decisions(user, {4096: {"triton": 500.0, "cutlass": 400.0}})
    select.clear_cache()
    assert get_config(SHAPE, FP8, 4096, H100) == PRECISE_LARGE and choose(4096).backend == "cutlass"
    # the H100's own fast table over the H200's precise one: moekit select names the borrowed one
    write_decisions(user, {64: {"triton": 10.0, "cutlass": 12.0}}, device_name=H200)
    (user / "backends" / tables.table_name(SHAPE, FP8, H100)).unlink()
    write_decisions(user, {4096: {"triton": 350.0, "cutlass": 400.0}}, "fast")
    select.clear_cache()
    text = "\n".join(explain(SHAPE, FP8, DeviceSpec.from_name(H100), torch.bfloat16, 64))
    assert f"({tables.table_name(SHAPE, FP8, H200)}: measured on another GPU model" in text
    # an H200 precise table under the H200 fast one: refined, as on the H200
    (user / "triton" / tables.table_name(SHAPE, FP8, H100)).unlink()
    write_configs(user, {1: PRECISE_SMALL, 4096: PRECISE_LARGE}, device_name=H200)
    select.clear_cache()
    assert [get_config(SHAPE, FP8, m, H100) for m in (1, 4096)] == [PRECISE_SMALL, FAST_LARGEST]


def choose(m):
    return select_backend(SHAPE, FP8, DeviceSpec.from_name(H100), torch.bfloat16, m, "auto")


def test_fast_decision_table_refines_the_precise_one(tmp_path, monkeypatch):
    user = tmp_path / "user"
    write_decisions(user, {64: {"triton": 10.0, "cutlass": 12.0}, 4096: {"triton": 500.0, "cutlass": 400.0}})
    fast = write_decisions(user, {4096: {"triton": 350.0, "cutlass": 400.0}}, "fast")
    assert choose(4096).backend == "cutlass"
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "fast")
    assert choose(4096).backend == "triton" and choose(64).backend == "triton"
    found = decisions.find_table(SHAPE, FP8, H100)
    assert found.path == fast and found.sizes == (64, 4096)
    text = "\n".join(explain(SHAPE, FP8, DeviceSpec.from_name(H100), torch.bfloat16, 4096))
    assert f"measured (us) in {fast.name}, over {tables.table_name(SHAPE, FP8, H100)} where it measured nothing:" in text


def test_a_fast_table_whose_meta_says_otherwise_is_skipped(tmp_path, monkeypatch):
    user = tmp_path / "user"
    write_decisions(user, {64: {"triton": 10.0, "cutlass": 12.0}})
    bad = user / "backends" / tables.table_name(SHAPE, FP8, H100, "fast")
    tables.write_json_atomically(bad, table_data(SHAPE, FP8, H100, {64: {"triton": 20.0, "cutlass": 12.0}}))
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "fast")
    with pytest.warns(decisions.BackendTableWarning, match="meta.fp8_accumulation is 'precise' but the file name says 'fast'"):
        assert choose(64).backend == "triton"  # the precise table's choice


def test_a_bad_mode_warns_and_reads_the_precise_table(tmp_path, monkeypatch):
    write_decisions(tmp_path / "user", {64: {"triton": 10.0, "cutlass": 12.0}})
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "sloppy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = decisions.find_table(SHAPE, FP8, H100)
    assert table is not None and table.sizes == (64,)
    assert any("MOEKIT_FP8_ACCUMULATION='sloppy': expected one of precise, fast" in str(w.message) for w in caught)



def test_config_lookups_are_remembered_per_batch_size_mode_and_folder(tmp_path, monkeypatch):
    """get_config runs on every layer call: the table folders are listed once per (problem,
    batch size, mode, MOEKIT_CONFIG_DIR), not per call, and a table written later is seen after
    select.clear_cache() (what `moekit tune` calls after writing)."""
    from moekit.backends.triton import config as triton_config

    listings = []
    real_find = triton_config.find_tables
    monkeypatch.setattr(triton_config, "find_tables", lambda *a: listings.append(a) or real_find(*a))
    write_configs(tmp_path / "user", {1: PRECISE_SMALL, 4096: PRECISE_LARGE})
    for _ in range(3):
        assert get_config(SHAPE, FP8, 4096, H100) == PRECISE_LARGE
    assert [get_config(SHAPE, FP8, m, H100) for m in (1, 2, 3, 5000)] == [PRECISE_SMALL] * 3 + [PRECISE_LARGE]
    assert len(listings) == 1  # one lookup of the problem's tables, whatever the batch size
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "fast")  # another mode: looked up afresh (two modes' tables)
    assert get_config(SHAPE, FP8, 4096, H100) == PRECISE_LARGE and len(listings) == 3
    write_configs(tmp_path / "user", {4096: FAST_LARGE}, "fast")
    assert get_config(SHAPE, FP8, 4096, H100) == PRECISE_LARGE  # remembered
    select.clear_cache()
    assert get_config(SHAPE, FP8, 4096, H100) == FAST_LARGE
    other = tmp_path / "other"
    write_configs(other, {4096: FAST_LARGEST}, "fast")
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(other))  # another folder: looked up afresh
    assert get_config(SHAPE, FP8, 4096, H100) == FAST_LARGEST


def test_env_raw_follows_os_environ(monkeypatch):
    """moekit.env.raw (the hot-path read) agrees with os.environ after every way of changing it,
    replacing os.environ itself (a test's mock) included."""
    from moekit import env

    with mock.patch.object(os, "environ", {"MOEKIT_TEST_ENV_READ": "mocked"}):
        assert env.get("MOEKIT_TEST_ENV_READ") == "mocked" and env.raw("MOEKIT_TEST_ENV_READ_NOT_SET") is None

    monkeypatch.delenv("MOEKIT_TEST_ENV_READ", raising=False)
    assert env.raw("MOEKIT_TEST_ENV_READ") is None
    monkeypatch.setenv("MOEKIT_TEST_ENV_READ", "fast")
    assert env.value(env.raw("MOEKIT_TEST_ENV_READ")) == "fast"
    os.environ["MOEKIT_TEST_ENV_READ"] = "precise"
    assert env.value(env.raw("MOEKIT_TEST_ENV_READ")) == "precise"
    del os.environ["MOEKIT_TEST_ENV_READ"]
    assert env.raw("MOEKIT_TEST_ENV_READ") is None


def test_every_shipped_table_loads_whole(caplog):
    """Each shipped table reads without a skipped entry or a warning: the triton configs with
    KernelConfig.from_table_entry's strict rules, the decision tables with moekit.decisions'."""
    from moekit.backends.triton import config

    for path in sorted((SHIPPED_ROOT / "triton").glob("*.json")):
        with caplog.at_level("WARNING", logger="moekit"):
            table = config.load_table(path)
        assert table is not None and table.configs, path.name
        assert len(table.configs) == len(json.loads(path.read_text())["configs"]), path.name
    assert caplog.text == ""
    for path in sorted((SHIPPED_ROOT / "backends").glob("*.json")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert decisions.load_table(path).points, path.name


def test_a_gpu_with_shipped_precise_tables_ships_the_fast_ones_its_group_has():
    """A GPU model's own precise table stops a borrowed fast table from refining it
    (tables.fast_may_refine), so a GPU model shipped with a precise table of a shape must ship its
    own fast table wherever a model of its sharing group ships one, or fast mode would run the
    precise configs and decisions there (the H100, twenty-fifth session: auto took cutlass at
    Mixtral M = 4096 in fast mode, 32% slower than triton)."""
    for kind in ("triton", "backends"):
        named = [(tables.parse_table_name(p.name), p.name) for p in (SHIPPED_ROOT / kind).glob("*.json")]

        def stem(info):
            return tuple(info[k] for k in sorted(info) if k not in ("device_name", "fp8_accumulation"))

        have = {(stem(info), tables.device_family(info["device_name"]), info["fp8_accumulation"]) for info, _ in named}
        for info, name in named:
            family = tables.device_family(info["device_name"])
            group = tables.sharing_group(info["device_name"]) or ()
            if info["fp8_accumulation"] != "fast":
                continue
            for other in group:
                if other != family and (stem(info), other, "precise") in have:
                    assert (stem(info), other, "fast") in have, f"{kind}: {other} has a precise table of {name}'s shape, no fast one"
