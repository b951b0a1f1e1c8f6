"""Auto backend selection: decision tables (lookup, search order, validation), the heuristic,
per-call cost, described devices, and `moekit select`."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import moekit
from moekit import decisions, select, tables
from moekit.backends.base import device_capability
from moekit.cli import main
from moekit.select import ENV_VAR, DeviceSpec, select_backend
from moekit.spec import SCHEMES, MoEShape, get_scheme

H100 = "NVIDIA H100 80GB HBM3"
SHAPE = MoEShape(8, 128, 128, 2)
FP8 = get_scheme("fp8-channel-token")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No shipped tables but the test's own, no user folder, no MOEKIT_BACKEND, fresh caches."""
    monkeypatch.setattr(tables, "SHIPPED_ROOT", tmp_path / "shipped")
    monkeypatch.delenv(tables.CONFIG_DIR_ENV, raising=False)
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(select, "_supports_cache", {})
    monkeypatch.setattr(decisions, "_warned", set())


def table_data(shape, scheme, device_name, points, **meta_changes):
    """points: {M: {backend: us}} (winner: the fastest) or {M: ({backend: us}, winner, errors)}."""
    sizes = {}
    for m, p in points.items():
        us, winner, errors = p if isinstance(p, tuple) else (p, min(p, key=p.get), {})
        sizes[str(m)] = {"us": dict(us), "winner": winner, "errors": dict(errors)}
    meta = {
        "device_name": device_name, "num_experts": shape.num_experts, "hidden": shape.hidden,
        "intermediate": shape.n, "top_k": shape.top_k, "scheme": scheme.name, "dtype": "bfloat16",
        "routing": "uniform", "mode": "layer", "moekit": moekit.__version__, "torch": "x", "triton": "x",
        "date": "2026-12-01",
    }
    meta.update(meta_changes)
    return {"format": "moekit-backend-table", "version": 1, "meta": meta, "batch_sizes": sizes}


def write_table(root, points, shape=SHAPE, scheme=FP8, device_name=H100, **meta_changes):
    path = root / "backends" / tables.table_name(shape, scheme, device_name)
    return tables.write_json_atomically(path, table_data(shape, scheme, device_name, points, **meta_changes))


def h100(m, backend="auto", **kw):
    return select_backend(SHAPE, FP8, DeviceSpec.from_name(H100), torch.bfloat16, m, backend, **kw)


# --------------------------------------------------------------------------- resolution order


def test_resolution_order_argument_environment_table_heuristic(tmp_path, monkeypatch):
    assert (h100(4).backend, h100(4).source) == ("triton", "heuristic")  # no table anywhere
    path = write_table(tmp_path / "user", {4: {"cutlass": 10.0, "triton": 12.0, "torch": 30.0}})
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path / "user"))
    choice = h100(4)
    assert (choice.backend, choice.source) == ("cutlass", "table") and str(path) in choice.detail
    monkeypatch.setenv(ENV_VAR, "torch")
    assert (h100(4).backend, h100(4).source) == ("torch", "environment")
    assert (h100(4, "reference").backend, h100(4, "reference").source) == ("reference", "argument")
    monkeypatch.setenv(ENV_VAR, "auto")
    assert h100(4).source == "table"


# ------------------------------------------------------------------------------- table lookup

POINTS = {
    1: {"cutlass": 5.0, "triton": 6.0, "torch": 20.0},
    16: {"cutlass": 9.0, "triton": 7.0, "torch": 20.0},
    256: {"cutlass": 50.0, "triton": 60.0, "torch": 40.0},
}
WINNER = {1: "cutlass", 16: "triton", 256: "torch"}


@pytest.mark.parametrize(
    "m,used,how,winner",
    [
        (0, 1, "below", "cutlass"), (1, 1, "exact", "cutlass"), (16, 16, "exact", "triton"),
        (256, 256, "exact", "torch"), (10**6, 256, "above", "torch"),
        # between 1 and 16, cutlass 5 + 4t, triton 6 + t (t = (M-1)/15): equal at t = 1/3, M = 6
        (3, 3, "between", "cutlass"), (6, 6, "between", "cutlass"),  # a tie: the first by name
        (7, 7, "between", "triton"), (15, 15, "between", "triton"),
        # between 16 and 256 (t = (M-16)/240): triton 7 + 53t, cutlass 9 + 41t, torch 20 + 20t:
        # triton up to t = 1/6 (M = 56), cutlass up to t = 11/21 (M = 141.7), then torch
        (40, 40, "between", "triton"), (100, 100, "between", "cutlass"), (141, 141, "between", "cutlass"),
        (142, 142, "between", "torch"), (255, 255, "between", "torch"),
    ],
)
def test_table_lookup_at_between_and_beyond_measured_sizes(tmp_path, monkeypatch, m, used, how, winner):
    path = write_table(tmp_path / "user", POINTS)
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path / "user"))
    choice = h100(m)
    assert (choice.backend, choice.source) == (winner, "table"), choice
    assert str(path) in choice.detail
    loc = decisions.load_table(path).locate(m)
    assert (loc.point.m, loc.how) == (used, how)
    if how == "between":
        assert f"between measured {loc.lower.m} and {loc.upper.m}: times interpolated" in choice.detail
        assert {p.m for p in loc.neighbours()} == {loc.lower.m, loc.upper.m}
        t = (m - loc.lower.m) / (loc.upper.m - loc.lower.m)
        for name, us in loc.point.us.items():
            assert us == pytest.approx(POINTS[loc.lower.m][name] * (1 - t) + POINTS[loc.upper.m][name] * t)
    else:
        assert f"M={used}" in choice.detail


def test_interpolation_leaves_out_a_backend_measured_on_one_side_only(tmp_path):
    points = {
        8: ({"triton": 10.0, "cutlass": 12.0}, "triton", {"torch": "out of memory"}),
        16: {"triton": 20.0, "cutlass": 18.0, "torch": 1.0},
    }
    table = decisions.load_table(write_table(tmp_path, points))
    loc = table.locate(12)
    assert loc.how == "between" and loc.point.us == {"triton": 15.0, "cutlass": 15.0}
    assert loc.point.winner == "cutlass"  # a tie: the first by name
    assert loc.point.errors == {"torch": "out of memory"}
    # nothing measured at both sizes: the nearest in log space (ties: the smaller)
    table = decisions.load_table(write_table(tmp_path / "b", {8: {"triton": 1.0}, 32: {"cutlass": 1.0}}))
    assert (table.locate(16).how, table.locate(16).point.m, table.locate(17).point.m) == ("nearest", 8, 32)


def test_user_tables_come_before_shipped_ones(tmp_path, monkeypatch):
    shipped = write_table(tables.SHIPPED_ROOT, {8: {"cutlass": 1.0, "torch": 2.0}})
    first = write_table(tmp_path / "a", {8: {"torch": 1.0, "cutlass": 2.0}})
    second = write_table(tmp_path / "b", {8: {"reference": 1.0, "cutlass": 2.0}})
    assert h100(8).detail.startswith(str(shipped)) and h100(8).backend == "cutlass"
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, os.pathsep.join([str(tmp_path / "empty"), str(tmp_path / "b")]))
    assert (h100(8).backend, h100(8).detail.split(":")[0]) == ("reference", str(second))
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")]))
    assert (h100(8).backend, h100(8).detail.split(":")[0]) == ("torch", str(first))


def test_a_table_of_the_same_gpu_model_serves_another_name_of_it(tmp_path):
    path = write_table(tables.SHIPPED_ROOT, {8: {"cutlass": 1.0, "triton": 2.0}})  # H100 SXM
    choice = select_backend(SHAPE, FP8, DeviceSpec.from_name("NVIDIA H100 PCIe"), num_tokens=8)
    assert (choice.backend, choice.source) == ("cutlass", "table") and str(path) in choice.detail
    choice = select_backend(SHAPE, FP8, DeviceSpec.from_name("NVIDIA L40S"), num_tokens=8)
    assert choice.source == "heuristic"  # another architecture (sm_89): not used


def test_borrowed_tables_go_by_the_groups_order_not_by_file_name(tmp_path):
    """In one folder 'NVIDIA_H20,' sorts before 'NVIDIA_H200' and 'GH200' before 'H100': the
    borrowed tables are taken in SHARING_GROUPS' order (an H800 takes the H200's, then the H100's),
    and the cut-down H20 lends to no one."""
    write_table(tables.SHIPPED_ROOT, {8: {"reference": 1.0, "cutlass": 2.0}}, device_name="NVIDIA H20")
    write_table(tables.SHIPPED_ROOT, {8: {"torch": 1.0, "cutlass": 2.0}}, device_name="NVIDIA GH200 480GB")
    h200 = write_table(tables.SHIPPED_ROOT, {8: {"cutlass": 1.0, "triton": 2.0}}, device_name="NVIDIA H200")
    found = tables.find_tables("backends", SHAPE, FP8, "NVIDIA H800")
    assert [tables.device_family(tables.parse_table_name(p.name)["device_name"]) for p in found] == ["H200", "GH200"]
    choice = select_backend(SHAPE, FP8, DeviceSpec.from_name("NVIDIA H800"), num_tokens=8)
    assert choice.backend == "cutlass" and str(h200) in choice.detail


def test_a_table_of_another_gpu_of_the_same_architecture_comes_last(tmp_path, monkeypatch, caplog):
    """On an H100 the H200's tables beat no tables at all 21 anchor points (BENCHMARKS.md,
    twenty-fourth session): a GPU without a table of its own takes one of the same architecture,
    says so once, and any table of its own model, in whichever folder, comes first."""
    monkeypatch.setattr(tables, "_borrowed_noted", set())
    h200 = write_table(tables.SHIPPED_ROOT, {8: {"cutlass": 1.0, "triton": 2.0}}, device_name="NVIDIA H200")
    with caplog.at_level("INFO", logger="moekit.tables"):
        choices = [h100(8), h100(8)]
    assert all(c.source == "table" and c.backend == "cutlass" and str(h200) in c.detail for c in choices)
    noted = [r.getMessage() for r in caplog.records if r.name == "moekit.tables"]
    assert len(noted) == 1 and str(h200) in noted[0] and "another GPU of the same architecture" in noted[0]
    text = "\n".join(select.explain(SHAPE, FP8, DeviceSpec.from_name(H100), torch.bfloat16, 8))
    assert f"from: decision table {h200}" in text and f"({h200.name}: measured on another GPU model" in text
    for other in ("NVIDIA A100-SXM4-80GB", "NVIDIA H20", "NVIDIA L40S"):  # outside the H200's group
        assert select_backend(SHAPE, FP8, DeviceSpec.from_name(other), num_tokens=8).source == "heuristic", other
    # a user folder's H200 table still comes after a shipped table of the H100 itself
    write_table(tmp_path / "user", {8: {"torch": 1.0, "cutlass": 2.0}}, device_name="NVIDIA H200")
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path / "user"))
    assert h100(8).backend == "torch"  # borrowed: the user's H200 table before the shipped H200 one
    own = write_table(tables.SHIPPED_ROOT, {8: {"triton": 1.0, "cutlass": 2.0}})
    select.clear_cache()
    assert h100(8).backend == "triton" and str(own) in h100(8).detail


# ----------------------------------------------------------------------- bad tables: one warning

GOOD = {4: {"cutlass": 1.0, "triton": 2.0}}


def _set(path, value):
    def change(d):
        *keys, last = path
        for k in keys:
            d = d[k]
        d[last] = value
    return change


BAD = {
    "not JSON": ("{not json", "not valid JSON"),
    "foreign version": (_set(["version"], 2), "version 2; this moekit reads version 1"),
    "foreign format": (_set(["format"], "vllm-moe-config"), "'format'"),
    "meta differs from the file name": (_set(["meta", "num_experts"], 16), "file name says 8"),
    "other device in meta": (_set(["meta", "device_name"], "NVIDIA A100"), "device_name"),
    "other top-k": (_set(["meta", "top_k"], 4), "top_k=4"),
    "gemm mode": (_set(["meta", "mode"], "gemm"), "meta.mode"),
    "batch size 0": (_set(["batch_sizes", "0"], {"us": {"triton": 1.0}, "winner": "triton"}), "'0' is not a positive"),
    "batch size not a number": (_set(["batch_sizes", "many"], {"us": {"triton": 1.0}, "winner": "triton"}), "'many'"),
    "negative time": (_set(["batch_sizes", "4", "us", "triton"], -3.0), "-3.0"),
    "string time": (_set(["batch_sizes", "4", "us", "triton"], "fast"), "'fast'"),
    "NaN time": (_set(["batch_sizes", "4", "us", "triton"], float("nan")), "nan"),
    "winner not measured": (_set(["batch_sizes", "4", "winner"], "torch"), "winner 'torch'"),
    "no batch sizes": (_set(["batch_sizes"], {}), "batch_sizes"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_table_gives_one_warning_and_falls_back(tmp_path, monkeypatch, case):
    change, expected = BAD[case]
    path = tmp_path / "user" / "backends" / tables.table_name(SHAPE, FP8, H100)
    path.parent.mkdir(parents=True)
    if isinstance(change, str):
        path.write_text(change)
    else:
        data = table_data(SHAPE, FP8, H100, GOOD)
        change(data)
        path.write_text(json.dumps(data))
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path / "user"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert h100(4).source == "heuristic"  # no other table: the heuristic
        shipped = write_table(tables.SHIPPED_ROOT, {4: {"torch": 1.0, "cutlass": 2.0}})
        select.clear_cache()
        choice = h100(4)  # the next source: the shipped table
        assert (choice.backend, choice.source) == ("torch", "table") and str(shipped) in choice.detail
    ours = [w for w in caught if issubclass(w.category, decisions.BackendTableWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]  # once per file, though read twice
    assert str(path) in str(ours[0].message) and expected in str(ours[0].message), str(ours[0].message)


def test_a_bad_table_never_breaks_a_forward_pass(tmp_path, monkeypatch):
    from helpers import random_routing, random_weights, random_x

    w = random_weights(4, 128, 128, "bf16")
    tw, ids = random_routing(3, 4, 2)
    x = random_x(3, 128)
    path = tmp_path / "backends" / tables.table_name(w.shape(2), w.scheme, "cpu")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\xff\xfe garbage")
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path))
    with pytest.warns(decisions.BackendTableWarning, match="cannot read it|not valid JSON"):
        out = moekit.fused_moe(x, w, tw, ids)
    assert torch.equal(out, moekit.fused_moe(x, w, tw, ids, backend="torch"))  # heuristic: torch on the CPU


# --------------------------------------------------------------------------- runnable backends only


def test_table_winner_that_cannot_run_is_skipped(tmp_path, monkeypatch):
    a100 = DeviceSpec.from_name("NVIDIA A100-SXM4-80GB")  # sm_80: no FP8 triton, no cutlass
    points = {
        1: {"triton": 1.0, "cutlass": 2.0, "torch": 50.0, "reference": 90.0},
        8: ({"warp-drive": 1.0, "reference": 70.0, "torch": 80.0}, "warp-drive", {}),
        64: {"triton": 1.0, "cutlass": 2.0},
    }
    write_table(tmp_path, points, device_name=a100.name)
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path))
    choice = select_backend(SHAPE, FP8, a100, num_tokens=1)
    assert (choice.backend, choice.source) == ("torch", "table")
    assert "winner triton" in choice.detail and "8.9+" in choice.detail
    # a MoELayer's auto also passes over torch (it would copy the weights): the next measured
    choice = select_backend(SHAPE, FP8, a100, num_tokens=1, allow_weight_copies=False)
    assert (choice.backend, choice.source) == ("reference", "table") and "copy" in choice.detail
    choice = select_backend(SHAPE, FP8, a100, num_tokens=8)
    assert choice.backend == "reference" and "not a backend of this moekit" in choice.detail
    choice = select_backend(SHAPE, FP8, a100, num_tokens=64)  # nothing measured there can run
    assert (choice.backend, choice.source) == ("torch", "heuristic") and "measured no usable backend" in choice.detail


DEVICES = ["cpu"] + [DeviceSpec.from_name(n) for n in select.KNOWN_CAPABILITIES]


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_heuristic_never_picks_a_backend_that_refuses(device):
    for scheme in SCHEMES.values():
        for shape in (MoEShape(8, 128, 256, 2), MoEShape(8, 100, 128, 2), MoEShape(2048, 128, 128, 2)):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                for allow in (True, False):
                    for m in (1, 64, 8192):
                        choice = select_backend(shape, scheme, device, dtype, m, allow_weight_copies=allow)
                        assert choice.source == "heuristic"
                        assert choice.backend not in choice.refused
                        if not allow:
                            assert not moekit.get_backend(choice.backend).copies_weights(scheme)


def test_heuristic_rules_by_rows_per_expert_skip_refusing_backends(monkeypatch):
    rules = ((1, ("cutlass", "torch")), (None, ("triton", "torch")))
    monkeypatch.setitem(select.HEURISTIC_RULES, "cuda", rules)
    # E=8, top-2: rows per expert = M / 4, so M <= 4 takes the first rule
    assert [h100(m).backend for m in (1, 4, 5, 4096)] == ["cutlass", "cutlass", "triton", "triton"]
    a100 = DeviceSpec.from_name("A100")
    assert select_backend(SHAPE, FP8, a100, num_tokens=1).backend == "torch"  # cutlass refuses on sm_80
    assert select_backend(SHAPE, FP8, a100, num_tokens=99).backend == "torch"  # triton: no FP8 on sm_80


# ---------------------------------------------------------------------------------- per call


def test_per_call_choice_is_memoised_without_file_io(tmp_path, monkeypatch):
    write_table(tmp_path, POINTS)
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path))
    first = {m: h100(m) for m in (1, 7, 300)}

    def no_io(*args, **kwargs):
        raise AssertionError("a table was read again")

    monkeypatch.setattr(decisions, "load_table", no_io)
    monkeypatch.setattr(tables, "find_tables", no_io)
    for m, choice in first.items():
        assert h100(m) is choice  # the same object: nothing recomputed
    assert [c.backend for c in first.values()] == ["cutlass", "triton", "torch"]


# ---------------------------------------------------------------------------- described devices


@pytest.mark.parametrize(
    "name,cap",
    [(H100, (9, 0)), ("NVIDIA H200", (9, 0)), ("NVIDIA GH200 480GB", (9, 0)), ("NVIDIA H20", (9, 0)),
     ("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA L40S", (8, 9)), ("NVIDIA L4", (8, 9)), ("h100", (9, 0))],
)
def test_device_names_give_capabilities(name, cap):
    assert DeviceSpec.from_name(name).capability == cap


def test_unknown_device_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown GPU 'NVIDIA B200'.*H100, H200, H20, H800, GH200, A100, L40S, L4"):
        DeviceSpec.from_name("NVIDIA B200")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_described_capability_does_not_leak_to_real_devices():
    l4 = DeviceSpec.from_name("NVIDIA L4")
    refused = select.refusals(SHAPE, get_scheme("fp8-block128"), l4, torch.bfloat16)
    assert any("SM90" in r for r in refused["cutlass"]) and refused["triton"] == []
    assert device_capability(torch.device("cuda")) is None
    cpu = select.refusals(SHAPE, FP8, torch.device("cpu"), torch.bfloat16)
    assert "needs a CUDA device, got cpu" in cpu["cutlass"]


def test_device_capability_is_asked_of_torch_once_per_device(monkeypatch):
    """The triton backend asks at every launch; torch's answer held 12% of an eager decode
    call's host path in a profile. Remembered per index; a described GPU (assume_capability) still wins."""
    from moekit.backends import base

    asked = []
    monkeypatch.setattr(base, "_CAPABILITIES", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or (9, index))
    assert device_capability(torch.device("cuda", 0)) == (9, 0)
    assert device_capability(torch.device("cuda", 0)) == (9, 0)
    assert device_capability(torch.device("cuda")) == (9, 1)  # the current device's, not index 0's
    assert device_capability(torch.device("cuda", 1)) == (9, 1)
    assert asked == [0, 1]
    with base.assume_capability((8, 9)):
        assert device_capability(torch.device("cuda", 0)) == (8, 9)
    assert device_capability(torch.device("cpu")) is None


# ---------------------------------------------------------------------------------- the CLI

GLM = dict(shape=MoEShape(128, 4096, 1408, 8, tp=2), scheme=FP8)  # glm-4.5v-fp8 at tp 2


def run_select(capsys, *args):
    code = main(["select", *args])
    out, err = capsys.readouterr()
    return code, out + err


def test_select_cli_for_a_named_device_with_a_table(tmp_path, monkeypatch, capsys):
    points = {
        32: {"triton": 20.0, "cutlass": 25.0, "torch": 60.0},
        64: ({"triton": 30.0, "cutlass": 27.5, "torch": 80.0}, "cutlass", {"reference": "timed out"}),
    }
    path = write_table(tmp_path, points, **GLM)
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path))
    code, out = run_select(capsys, "--model", "glm-4.5v-fp8", "--tp", "2", "--batch-size", "48", "--device-name", H100)
    assert code == 0, out
    lines = out.splitlines()
    assert "backend: triton" in lines  # at 48, halfway: triton 25, cutlass 26.25
    assert f"from: decision table {path}" in lines
    assert "  M=48 between measured 32 and 64: times interpolated linearly in M" in lines
    header = next(line for line in lines if line.strip().startswith("backend ") and "M=32" in line)
    assert "M=48 (interpolated, used)" in header
    rows = {line.split()[0]: line for line in lines if line.startswith("  ") and line.split()[0] in ("triton", "cutlass", "torch", "reference")}
    assert rows["cutlass"].split()[1:] == ["25", "27.5", "winner", "26.25"]
    assert rows["triton"].split()[1:] == ["20", "winner", "30", "25", "winner"]
    assert "failed: timed out" in rows["reference"]
    assert "refused: none" in lines and "device: NVIDIA H100 80GB HBM3 (compute capability 9.0, described)" in lines


def test_select_cli_heuristic_refusals_environment(tmp_path, monkeypatch, capsys):
    code, out = run_select(capsys, "--model", "deepseek-v3", "--tp", "8", "--batch-size", "4", "--device-name", "NVIDIA A100 80GB PCIe")
    assert code == 0, out
    assert "backend: torch" in out and "from: heuristic" in out and "no decision table" in out
    assert "  cutlass: needs SM90 (Hopper), found sm_80" in out and "  triton: fp8-block128 needs compute capability 8.9+" in out
    assert "a MoELayer (auto) runs reference instead" in out  # torch would copy the FP8 weights
    monkeypatch.setenv(ENV_VAR, "reference")
    code, out = run_select(capsys, "--model", "deepseek-v3", "--batch-size", "4", "--device-name", H100)
    assert code == 0 and "backend: reference" in out and "from: environment (MOEKIT_BACKEND=reference)" in out


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--model", "glm-4.5v-fp8", "--batch-size", "4", "--device-name", "NVIDIA B200"], "unknown GPU 'NVIDIA B200'"),
        (["--model", "glm-4.5v-fp8", "--batch-size", "0"], "--batch-size must be a positive integer, got '0'"),
        (["--model", "glm-4.5v-fp8", "--batch-size", "many"], "--batch-size must be a positive integer"),
        (["--model", "glm-4.5v-fp8", "--batch-size", "²"], "--batch-size must be a positive integer"),  # isdigit, not int()
        (["--model", "glm-4.5v-fp8", "--batch-size", "70000"], "--batch-size: 70000 is above 65536"),
        (["--model", "gpt-5", "--batch-size", "4"], "unknown model 'gpt-5'"),
        (["--model", "glm-4.5v-fp8", "--tp", "3", "--batch-size", "4"], "not divisible by tp (3)"),
        (["--model", "glm-4.5v-fp8", "--scheme", "int4", "--batch-size", "4"], "unknown quantization scheme 'int4'"),
        (["--model", "glm-4.5v-fp8", "--batch-size", "4", "--backend", "fast"], "unknown backend 'fast'"),
        (["--model", "deepseek-v3", "--batch-size", "4", "--device-name", H100, "--backend", "cutlass"],
         "backend 'cutlass' (from --backend) cannot run this problem: 128x128 block weights"),
    ],
)
def test_select_cli_bad_input_is_one_line_and_exit_2(args, expected, capsys):
    code, out = run_select(capsys, *args)
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), out
    assert expected in lines[0], lines[0]


def test_select_cli_names_moekit_backend_as_the_source_of_a_backend_that_cannot_run(monkeypatch, capsys):
    """With no --backend, the backend came from MOEKIT_BACKEND: the error said only "backend
    'cutlass' cannot run", leaving the user to guess where the name came from."""
    monkeypatch.setenv(ENV_VAR, "cutlass")
    code, out = run_select(capsys, "--model", "deepseek-v3", "--batch-size", "4", "--device-name", H100)
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert "backend 'cutlass' (from MOEKIT_BACKEND=cutlass) cannot run this problem: 128x128 block weights" in out


def test_backend_unavailable_error_is_one_line_naming_its_source(monkeypatch):
    """Its message is the one-line error of the commands (bench's for a MOEKIT_BACKEND that cannot
    run its auto rows printed a bullet list over four lines)."""
    monkeypatch.setenv(ENV_VAR, "cutlass")
    with pytest.raises(moekit.BackendUnavailableError) as e:
        select_backend(SHAPE, get_scheme("bf16"), "cpu", torch.bfloat16, 1)
    text = str(e.value)
    assert "\n" not in text and e.value.source == "MOEKIT_BACKEND=cutlass"
    assert text.startswith("backend 'cutlass' (from MOEKIT_BACKEND=cutlass) cannot run this problem: needs a CUDA device")
    assert text.endswith("; backends that can: " + ", ".join(e.value.runnable))


@pytest.mark.parametrize("dtype,note", [("fp16", True), ("bf16", False)])
def test_select_cli_says_when_the_table_was_measured_with_another_activation_dtype(tmp_path, monkeypatch, capsys,
                                                                                   dtype, note):
    """Tables are filed without the activation dtype: for --dtype fp16 a bf16 table answered
    silently, as if its times were fp16's."""
    write_table(tmp_path, {32: {"triton": 20.0, "torch": 60.0}}, **GLM)
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path))
    code, out = run_select(capsys, "--model", "glm-4.5v-fp8", "--tp", "2", "--batch-size", "32", "--device-name", H100,
                           "--dtype", dtype)
    assert code == 0 and "from: decision table" in out, out
    line = "  measured with bfloat16 activations, not float16: a table answers for every activation dtype"
    assert (line in out.splitlines()) is note, out


def test_select_cli_refuses_a_bad_dtype_as_every_command_does(capsys):
    """--dtype is parsed as bench's, check's and tune's are (moekit.cli.activation_dtype): argparse's
    usage and one error line, exit status 2."""
    from moekit.cli import main

    with pytest.raises(SystemExit) as e:
        main(["select", "--model", "glm-4.5v-fp8", "--batch-size", "4", "--dtype", "fp64"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: moekit select" in err
    assert "'fp64' is not an activation dtype: expected bf16 or fp16" in err


@pytest.mark.parametrize("name", ["bf16", "bfloat16", "BF16", "fp16", "float16", "half"])
def test_a_dtype_may_be_named_as_the_commands_take_it(name):
    """select_backend(..., "bfloat16", ...) reached every supports() as a str: auto picked
    reference, each backend refusing "activations must be bfloat16 or float16, got bfloat16"."""
    want = torch.float16 if name.lower() in ("fp16", "float16", "half") else torch.bfloat16
    device = DeviceSpec.from_name(H100)
    by_name = select_backend(SHAPE, FP8, device, name, 4)
    assert by_name == select_backend(SHAPE, FP8, device, want, 4)
    assert by_name.backend == "triton" and "triton" not in by_name.refused
    assert select.refusals(SHAPE, FP8, device, name) == select.refusals(SHAPE, FP8, device, want)
    assert select.explain(SHAPE, FP8, device, name, 4)[0] == "backend: triton"


def test_a_dtype_that_names_no_activation_dtype_and_a_negative_batch_size_are_refused():
    """A negative num_tokens was answered as if it were 1 (the table's smallest size)."""
    np = pytest.importorskip("numpy")
    device = DeviceSpec.from_name(H100)
    with pytest.raises(ValueError, match=r"dtype 'float8' is not an activation dtype name: expected one of "
                                         r"bf16, bfloat16, fp16, float16, half, or a torch.dtype"):
        select_backend(SHAPE, FP8, device, "float8", 4)
    with pytest.raises(TypeError, match=r"dtype must be a torch.dtype \(e.g. torch.bfloat16\) or its name "
                                        r"\('bf16'\), got int 16"):
        select_backend(SHAPE, FP8, device, 16, 4)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=rf"num_tokens must be an integer >= 0 \(the batch size M\), got {bad}"):
            select_backend(SHAPE, FP8, device, torch.bfloat16, bad)
    assert select_backend(SHAPE, FP8, device, torch.bfloat16, 0).backend == "triton"  # an empty batch
    assert select_backend(SHAPE, FP8, device, torch.bfloat16, np.int64(4)) == h100(4)


def test_shipped_heuristic_puts_cutlass_first_only_for_wide_experts_with_many_rows():
    """The measured rule (select.py's evidence): Mixtral-like experts (N = 14336) with 256+ rows
    each go to cutlass; fewer rows, or narrow experts (GLM's N = 704), stay on triton."""
    device = DeviceSpec.from_name(H100)
    wide, narrow = MoEShape(8, 4096, 14336, 2), MoEShape(128, 4096, 1408, 8, tp=2)

    def pick(shape, m):
        return select_backend(shape, FP8, device, torch.bfloat16, m).backend

    assert [pick(wide, m) for m in (1, 512, 1020)] == ["triton"] * 3  # <= 255 rows per expert
    assert [pick(wide, m) for m in (1024, 8192)] == ["cutlass"] * 2
    assert [pick(narrow, m) for m in (1, 4096, 8192)] == ["triton"] * 3


def test_shipped_heuristic_keeps_triton_for_wide_experts_in_fast_mode(monkeypatch):
    """In fast accumulation mode triton beat cutlass at Mixtral prefill even untuned (H100,
    BENCHMARKS.md twenty-fourth session: 2762 vs 3555 µs at M = 4096), and auto without a table
    took cutlass there, 29% slower: the cutlass rule is for precise mode only."""
    device = DeviceSpec.from_name(H100)
    wide = MoEShape(8, 4096, 14336, 2)
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    choice = select_backend(wide, FP8, device, torch.bfloat16, 4096)
    assert (choice.backend, choice.source) == ("triton", "heuristic")
    assert select_backend(wide, FP8, device, torch.bfloat16, 8192).backend == "triton"
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "precise")
    choice = select_backend(wide, FP8, device, torch.bfloat16, 4096)
    assert choice.backend == "cutlass" and "precise FP8 accumulation" in choice.detail


def test_bad_fp8_accumulation_is_an_error_of_select_and_explain(monkeypatch, capsys):
    """A bad MOEKIT_FP8_ACCUMULATION was only warned about by the decision tables (auto then
    ran another backend) and reached explain() from a table-name helper; now select_backend and
    explain refuse it first, naming the variable, and `moekit select` prints that one line."""
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "bogus")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no BackendTableWarning on the way: refused before any table
        for backend in ("auto", "reference"):
            with pytest.raises(ValueError, match="MOEKIT_FP8_ACCUMULATION='bogus': expected one of precise, fast"):
                h100(4, backend)
        with pytest.raises(ValueError, match="MOEKIT_FP8_ACCUMULATION='bogus'"):
            select.explain(SHAPE, FP8, DeviceSpec.from_name(H100), torch.bfloat16, 4)
    code, out = run_select(capsys, "--model", "glm-4.5v-fp8", "--batch-size", "4", "--device-name", H100)
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "MOEKIT_FP8_ACCUMULATION='bogus'" in lines[0], out


def test_a_triton_table_with_a_non_positive_batch_size_never_breaks_a_forward_pass(tmp_path, monkeypatch, caplog):
    """A tuned triton table's batch size "0" or "-4" passed int() and then failed nearest()'s
    log(size / M) inside a forward pass. Such entries are skipped with a warning naming the file
    and the key; the table's other entries are used."""
    import logging

    from moekit.backends.triton import config

    path = tmp_path / "triton" / tables.table_name(SHAPE, FP8, H100)
    good = config.KernelConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2)
    entries = {"0": good.to_dict(), "-4": good.to_dict(), "64": good.to_dict()}
    tables.write_json_atomically(path, {"meta": {}, "configs": entries})
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path))
    config._load_table.cache_clear()
    with caplog.at_level(logging.WARNING, logger="moekit.triton"):
        for m in (1, 64, 5000):
            assert config.get_config(SHAPE, FP8, m, H100) == good
    skipped = [r.getMessage() for r in caplog.records if "ignoring the entry" in r.getMessage()]
    assert any(str(path) in s and "'0'" in s for s in skipped) and any("'-4'" in s for s in skipped), skipped


def _write_triton_table(tmp_path, entries, meta=None, shape=SHAPE):
    path = tmp_path / "triton" / tables.table_name(shape, FP8, H100)
    tables.write_json_atomically(path, {"meta": meta or {}, "configs": entries})
    return path


def test_a_triton_table_entry_is_read_strictly(tmp_path, monkeypatch, caplog):
    """A hand-edited or foreign entry was filled in with KernelConfig's class defaults (vLLM's
    BLOCK_SIZE_M names, a missing field), took 64.9 as 64 and true as 1: a config nobody chose,
    without a word. Now such an entry is skipped with a warning naming it, the others are used."""
    import logging

    from moekit.backends.triton import config

    good = config.KernelConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2)
    entries = {
        "1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
              "num_stages": 3},
        "2": {k: v for k, v in good.to_dict().items() if k != "num_stages"},
        "4": {**good.to_dict(), "BLOCK_M": 64.9},
        "8": {**good.to_dict(), "GROUP_M": True},
        "16": {**good.to_dict(), "us": 12.5, "default_us": 20.0},  # tune's notes beside the config
        "1" + "0" * 400: good.to_dict(),  # a huge size: nearest() used to overflow math.log
    }
    path = _write_triton_table(tmp_path, entries)
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="moekit.triton"):
        loaded = config.load_table(path)
    assert loaded.configs == {16: good, int("1" + "0" * 400): good}
    said = " | ".join(r.getMessage() for r in caplog.records)
    for expected in ("batch size 1: unknown key(s) ['BLOCK_SIZE_K', 'BLOCK_SIZE_M', 'BLOCK_SIZE_N', 'GROUP_SIZE_M']",
                     "batch size 2: missing ['num_stages']", "batch size 4: BLOCK_M is 64.9, expected an integer >= 1",
                     "batch size 8: GROUP_M is True, expected an integer >= 1"):
        assert expected in said, said
    assert config.get_config(SHAPE, FP8, 10**6, H100) == good  # no overflow in a forward pass
    vllm_file = tables.write_json_atomically(path, {"64": entries["1"]})  # a vLLM file where a table belongs
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moekit.triton"):
        assert config.load_table(vllm_file) is None
    assert "not a moekit triton table: no 'configs' object" in caplog.text


def test_a_triton_table_of_another_top_k_is_not_used(tmp_path, monkeypatch, caplog):
    """Table names carry E, N, H and the scheme, not top-k: a table tuned for a top-1 layer drove
    a top-2 layer of the same sizes (decision tables already refused it). Now it is skipped with
    a warning, and the analytic default runs."""
    import logging

    from moekit.backends.triton import config

    tuned = config.KernelConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2)
    _write_triton_table(tmp_path, {"64": tuned.to_dict()}, meta={"top_k": 1})
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path))
    tables.clear_cache()
    with caplog.at_level(logging.WARNING, logger="moekit.triton"):
        cfg = config.get_config(SHAPE, FP8, 64, H100)
    assert cfg == config.default_config(SHAPE, FP8, 64) != tuned
    assert "measured with top_k=1, this layer has top_k=2: not used" in caplog.text
    _write_triton_table(tmp_path, {"64": tuned.to_dict()}, meta={"top_k": 2})
    tables.clear_cache()
    assert config.get_config(SHAPE, FP8, 64, H100) == tuned


def test_clear_cache_rereads_a_table_rewritten_within_one_clock_tick(tmp_path, monkeypatch):
    """The table cache was keyed by the file's mtime alone and clear_cache() did not empty it: a
    table rewritten within one tick of a coarse clock was read stale. Here the rewrite keeps the
    mtime (as such a clock would) and the size; clear_cache() must make the new one count."""
    from moekit.backends.triton import config

    a = config.KernelConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2)
    b = config.KernelConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2)
    path = _write_triton_table(tmp_path, {"64": a.to_dict()})
    monkeypatch.setenv(tables.CONFIG_DIR_ENV, str(tmp_path))
    tables.clear_cache()
    assert config.get_config(SHAPE, FP8, 64, H100) == a
    st = path.stat()
    path.write_text(path.read_text().replace('"BLOCK_M": 32', '"BLOCK_M": 64'))  # in place: same inode and size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    tables.clear_cache()
    assert config.get_config(SHAPE, FP8, 64, H100) == b


def test_tables_are_written_readable_by_others(tmp_path):
    """mkstemp made every table, journal and vLLM export 0600, kept by the rename: a serving
    process of another user could not read them. Now a new file gets open()'s mode (0666 less
    the umask), a replaced one keeps its mode."""
    old = os.umask(0o022)
    try:
        path = tables.write_json_atomically(tmp_path / "t.json", {})
        assert path.stat().st_mode & 0o777 == 0o644
        path.chmod(0o664)
        tables.write_json_atomically(path, {"a": 1})
        assert path.stat().st_mode & 0o777 == 0o664
    finally:
        os.umask(old)


def test_device_families_keep_the_letter_after_the_number():
    """'NVIDIA L40' took the tables of an L40S (and V100 those of a V100S, A10 of an A10G): the
    family dropped the letter, against the README's 'used only on that model'."""
    family = tables.device_family
    assert family("NVIDIA H100 80GB HBM3") == family("NVIDIA H100 PCIe") == family("NVIDIA_H100_NVL") == "H100"
    assert family("NVIDIA L40S") == "L40S" != family("NVIDIA L40") == "L40"
    assert family("Tesla V100S-PCIE-32GB") == "V100S" != family("Tesla V100-SXM2-16GB") == "V100"
    assert family("NVIDIA A10G") == "A10G" and family("NVIDIA GH200 480GB") == "GH200"
    assert family("NVIDIA L4") == "L4" and family("Tesla T4") == "T4"  # one digit: its tables had no family


def test_supports_takes_names_as_select_backend_does():
    """supports() is public, but only select_backend turned names into objects: called directly
    with "bfloat16" triton refused "activations must be bfloat16 or float16, got bfloat16",
    cutlass (and triton on an sm_90) failed on a scheme's name with an AttributeError, and a
    device's name failed the same way. Every backend's supports() now answers a name as it
    answers the object it names (Backend normalises them, once for all)."""
    from moekit.backends.base import assume_capability

    forms = [("cpu", torch.device("cpu"), "bfloat16", torch.bfloat16), ("cpu", torch.device("cpu"), "half", torch.float16)]
    for name in moekit.backend_names():
        backend = moekit.get_backend(name)
        for scheme in SCHEMES:
            for device_name, device, dtype_name, dtype in forms:
                assert backend.supports(SHAPE, scheme, device_name, dtype_name) == backend.supports(
                    SHAPE, get_scheme(scheme), device, dtype), (name, scheme, dtype_name)
            with assume_capability((9, 0)):  # a Hopper described: the GPU branches of every backend
                assert backend.supports(SHAPE, scheme, "cuda", "bf16") == backend.supports(
                    SHAPE, get_scheme(scheme), torch.device("cuda"), torch.bfloat16), (name, scheme)
    cutlass = moekit.get_backend("cutlass").supports(SHAPE, "fp8-block128", "cpu")
    assert any("128x128 block weights" in r for r in cutlass)  # the scheme's name was looked at


def test_supports_refuses_arguments_it_cannot_read_naming_them():
    cutlass = moekit.get_backend("cutlass")
    with pytest.raises(TypeError, match=r"^shape must be a moekit.MoEShape \(e.g. weights.shape\(top_k\)\), "
                                        r"got tuple \(8, 128, 128, 2\)$"):
        cutlass.supports((8, 128, 128, 2), FP8, "cpu")
    with pytest.raises(ValueError, match=r"unknown quantization scheme 'fp9'; expected one of: "):
        cutlass.supports(SHAPE, "fp9", "cpu")
    with pytest.raises(TypeError, match=r"^device must be a torch.device or its name \('cuda:0', 'cpu'\), got float 3.5$"):
        cutlass.supports(SHAPE, FP8, 3.5)
    with pytest.raises(ValueError, match=r"^device 'gpu' is not a device name: "):
        cutlass.supports(SHAPE, FP8, "gpu")
    with pytest.raises(TypeError, match=r"^dtype must be a torch.dtype"):
        cutlass.supports(SHAPE, FP8, "cpu", 16)


def test_a_registered_backends_supports_gets_objects_for_names(registry):
    """The normalisation is the base class's: a backend registered later gets it too."""
    from moekit.backends.reference import ReferenceBackend

    seen = []

    class Recording(ReferenceBackend):
        name = "recording-test"

        def supports(self, shape, scheme, device, dtype=torch.bfloat16):
            seen.append((scheme, device, dtype))
            return []

    backend = registry(Recording())
    backend.supports(SHAPE, "fp8-block128", "cpu", "half")
    select_backend(SHAPE, "bf16", "cpu", "bfloat16", 4)
    assert seen == [(get_scheme("fp8-block128"), torch.device("cpu"), torch.float16),
                    (get_scheme("bf16"), torch.device("cpu"), torch.bfloat16)]


def test_select_backend_refuses_a_shape_or_flag_it_cannot_read():
    """A tuple for the shape raised an AttributeError from cutlass.supports (a list: 'unhashable
    type'); allow_weight_copies="no" was taken as True."""
    for bad in ((8, 128, 128, 2), [8, 128, 128, 2]):
        with pytest.raises(TypeError, match=rf"^shape must be a moekit.MoEShape .*, got {type(bad).__name__} "):
            select_backend(bad, FP8, "cpu", torch.bfloat16, 4)
        with pytest.raises(TypeError, match=r"^shape must be a moekit.MoEShape"):
            select_backend(bad, FP8, DeviceSpec.from_name(H100), torch.bfloat16, 4)
    for bad in ("no", None, 1):
        with pytest.raises(ValueError, match=rf"^allow_weight_copies must be True or False, got {bad!r}$"):
            select_backend(SHAPE, FP8, "cpu", torch.bfloat16, 4, allow_weight_copies=bad)
