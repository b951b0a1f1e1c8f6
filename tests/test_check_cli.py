"""`moekit check` end to end on the CPU, and its float64 computation."""

from __future__ import annotations

import json

import pytest
import torch

import moekit
from moekit import check
from moekit.api import validate_inputs
from moekit.backends.reference import ReferenceBackend, reference_moe
from moekit.cli import main

from helpers import input_recording_backend, random_routing, random_weights, random_x, rel_l2, tiny_mixtral

CPU = not torch.cuda.is_available()
PRESET = "qwen3-30b-a3b-fp8"  # fp8-block128; on the CPU scaled down to E=16 H=256 N=128 top-8


@pytest.fixture
def torch_backend(registry):
    """The `torch` backend, registered if the package does not register it yet."""
    if "torch" not in moekit.backend_names():
        from moekit.backends.torch_backend import TorchBackend

        registry(TorchBackend())
    return "torch"


@pytest.fixture
def tiny_config(tmp_path):
    return tiny_mixtral(tmp_path, experts=6, hidden=64, intermediate=128, layers=2)


def one_line_error(capsys) -> str:
    out, err = capsys.readouterr()
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error:")
    return lines[0]


# ------------------------------------------------------------------------------ end to end


def test_check_end_to_end_reference_and_torch_pass(tmp_path, torch_backend, capsys):
    out = tmp_path / "check"
    argv = ["check", "--model", PRESET, "--backends", "reference", torch_backend, "--seeds", "2",
            "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    if CPU:  # check times nothing: its banner spoke of timings (bench's)
        assert text.startswith("No CUDA GPU: checking on the CPU") and "timing" not in text
    assert "pass" in text and "FAIL" not in text
    assert [p.name for p in out.iterdir()] == ["check.json"]
    report = json.loads((out / "check.json").read_text())
    assert report["passed"] is True
    assert {"device", "torch", "moekit", "git_commit", "date", "command"} <= set(report["metadata"])
    assert report["metadata"]["command"].startswith("moekit check --model " + PRESET)
    assert "2^-4" in report["threshold_derivation"] and "fp8-block128" in report["thresholds"]
    (model,) = report["models"]
    assert model["scheme"] == "fp8-block128"
    E = model["shape"]["num_experts"]
    sizes = {c["batch_size"] for c in model["cases"]}
    assert {1, 7, 64} <= sizes
    assert any(c["expert_pool"] is not None and len(c["expert_pool"]) < E for c in model["cases"])
    assert {c["seed"] for c in model["cases"]} == {0, 1}
    by_name = {b["backend"]: b for b in model["backends"]}
    assert set(by_name) == {"reference", "torch"}
    assert by_name["reference"]["class"] == "reference" and by_name["torch"]["class"] == "dequantized"
    for b in by_name.values():
        assert b["passed"] and not b["errors"]
        assert len(b["cases"]) == len(model["cases"])
        # the experts the routing sent tokens to: an int everywhere (it was the pool's size, E at
        # M = 1, and a list or null under the model's cases)
        for c, case in zip(b["cases"], model["cases"]):
            assert type(c["experts_used"]) is int and "experts_used" not in case
            assert c["experts_used"] <= min(c["batch_size"] * model["shape"]["top_k"], len(case["expert_pool"] or range(E)))
        assert {c["experts_used"] for c in b["cases"] if c["batch_size"] == 1} == {model["shape"]["top_k"]}
        for c in b["cases"]:
            assert c["rel_l2"] <= b["threshold"]["rel_l2"]
            assert c["max_rel"] <= b["threshold"]["max_rel"]
            assert c["cos"] >= b["threshold"]["min_cos"]
    assert by_name["reference"]["worst"]["rel_l2"] < 4e-3
    # the torch backend skips the FP8 activation quantization: a few percent, as derived
    assert 1e-2 < by_name["torch"]["worst"]["rel_l2"] < 1e-1
    (pair,) = model["pairwise_rel_l2"]
    assert {pair["a"], pair["b"]} == {"reference", "torch"} and pair["worst_rel_l2"] > 0


def test_check_bf16_model_from_config(tmp_path, tiny_config, torch_backend):
    out = tmp_path / "c"
    assert main(["check", "--model", str(tiny_config), "--backends", "reference", torch_backend,
                 "--seeds", "1", "--batch-sizes", "1", "5", "--out", str(out)]) == 0
    report = json.loads((out / "check.json").read_text())
    (model,) = report["models"]
    assert model["scheme"] == "bf16"
    torch_result = next(b for b in model["backends"] if b["backend"] == "torch")
    assert torch_result["passed"] and torch_result["worst"]["rel_l2"] < 1e-2  # no FP8 noise in bf16


def test_check_moves_llama4_routing_weights_onto_the_input(tmp_path, registry):
    """Llama-4 scales each token's input by its routing weight (top-1). The check ran the layer
    with the weight on the output, a layer no Llama-4 runs; now the backend gets weights of one
    and the truth is computed on the same scaled input (SiLU is not linear, so a check that
    mixed the two rules would fail the reference itself: w * f(x) != f(w * x))."""
    recording = registry(input_recording_backend())
    out = tmp_path / "c"
    assert main(["check", "--model", "llama-4-scout", "--backends", "reference", "recording", "--seeds", "1",
                 "--batch-sizes", "1", "5", "--out", str(out)]) == 0
    assert len(recording.inputs) >= 2  # a case per batch size, and those on half of the experts
    for x, tw in recording.inputs:  # the model's weights are not 1 (unnormalized sigmoid scores)
        assert torch.equal(tw, torch.ones_like(tw)) and tw.shape[1] == 1
    report = json.loads((out / "check.json").read_text())
    (model,) = report["models"]
    for b in model["backends"]:  # the reference's error is rounding alone: the same rule on both sides
        assert b["passed"] and b["worst"]["rel_l2"] < 1e-2


class WrongBackend(ReferenceBackend):
    """Off by 5 %: far above any FP8 kernel's error against the float64 computation."""

    name = "wrong"

    def run(self, x, weights, topk_weights, topk_ids):
        return (reference_moe(x, weights, topk_weights, topk_ids).float() * 1.05).to(x.dtype)


class CrashingBackend(ReferenceBackend):
    name = "crashing"

    def run(self, x, weights, topk_weights, topk_ids):
        raise RuntimeError("kernel exploded")


@pytest.mark.parametrize("bad", [WrongBackend, CrashingBackend])
def test_check_failing_backend_gives_exit_1(tmp_path, tiny_config, registry, bad, capsys):
    registry(bad())
    out = tmp_path / "c"
    assert main(["check", "--model", str(tiny_config), "--scheme", "fp8-channel-token", "--seeds", "1",
                 "--batch-sizes", "1", "4", "--backends", "reference", bad.name, "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text
    report = json.loads((out / "check.json").read_text())
    assert report["passed"] is False
    results = {b["backend"]: b for b in report["models"][0]["backends"]}
    assert results["reference"]["passed"] is True
    assert results[bad.name]["passed"] is False
    if bad is CrashingBackend:
        assert "kernel exploded" in results[bad.name]["errors"][0]
    else:
        assert results[bad.name]["worst"]["rel_l2"] == pytest.approx(0.05, rel=0.1)


def test_check_default_backends_are_every_runnable_one(tmp_path, tiny_config, capsys):
    out = tmp_path / "c"
    assert main(["check", "--model", str(tiny_config), "--seeds", "1", "--batch-sizes", "1", "--out", str(out)]) == 0
    report = json.loads((out / "check.json").read_text())
    (model,) = report["models"]
    checked = {b["backend"] for b in model["backends"]}
    skipped = set(model["skipped_backends"])
    assert checked | skipped == set(moekit.backend_names())
    # the ground truth is float64 here; on a GPU `reference` is checked only when named (slow)
    assert "reference" in (checked if not torch.cuda.is_available() else skipped)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model", "no-such-model"], "unknown model"),
        (["--model", PRESET, "--seeds", "0"], "--seeds"),
        (["--model", PRESET, "--batch-sizes", "0"], "not a positive integer"),
        (["--model", PRESET, "--backends", "auto"], "'auto'"),
        (["--model", PRESET, "--backends", "nope"], "unknown backend"),
        (["--model", PRESET, "--seed", "-3"], "--seed must be an integer in [0, 2147483648)"),
    ],
)
def test_check_bad_input_is_one_line_and_exit_2(args, expected, tmp_path, capsys):
    assert main(["check", *args, "--out", str(tmp_path / "o")]) == 2
    assert expected in one_line_error(capsys)
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------- float64 computation


@pytest.mark.parametrize("scheme", ["bf16", "fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token", "fp8-block128"])
def test_float64_moe_matches_the_reference_problem(scheme):
    E, H, N, K, M = 6, 200, 128, 2, 9  # H not a multiple of 128: partial groups and blocks
    w = random_weights(E, H, N, scheme, seed=1)
    tw, ids = random_routing(M, E, K, seed=1, experts=[0, 2, 3])  # experts 1, 4, 5 get no tokens
    x = random_x(M, H, seed=1)
    tw, ids = validate_inputs(x, w, tw, ids)
    ref64 = check.float64_moe(x, w, tw, ids)
    assert ref64.dtype == torch.float64 and ref64.shape == (M, H)
    assert rel_l2(reference_moe(x, w, tw, ids), ref64) < 4e-3
    m = check.metrics(reference_moe(x, w, tw, ids), ref64)
    assert m["cos"] > 0.99999 and m["max_rel"] < 8e-3


def test_metrics_of_identical_and_opposite_outputs():
    a = torch.randn(4, 8, dtype=torch.float64)
    assert check.metrics(a, a) == {"rel_l2": 0.0, "max_rel": 0.0, "cos": pytest.approx(1.0)}
    m = check.metrics(-a, a)
    assert m["rel_l2"] == pytest.approx(2.0) and m["cos"] == pytest.approx(-1.0)
    nan = check.metrics(torch.full_like(a, float("nan")), a)
    assert nan["rel_l2"] == float("inf")


def test_every_scheme_and_class_has_a_threshold():
    for scheme in moekit.SCHEMES.values():
        for cls in check.ACCURACY_CLASSES:
            t = check.threshold_for(scheme.name, cls)
            assert 0 < t.rel_l2 < t.max_rel and 0 < t.min_cos < 1


def test_triton_in_fast_mode_is_checked_as_a_fast_accumulation_kernel(tmp_path, tiny_config, monkeypatch):
    if "triton" not in moekit.backend_names():
        pytest.skip("no triton backend registered")
    fp8, bf16 = moekit.SCHEMES["fp8-channel-token"], moekit.SCHEMES["bf16"]
    assert check.backend_class("triton", fp8) == "kernel"
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    assert check.backend_class("triton", fp8) == "kernel-fast" and check.backend_class("triton", bf16) == "kernel"
    assert check.threshold_for("fp8-channel-token", "kernel-fast").rel_l2 == 3e-2
    assert check.threshold_for("bf16", "kernel-fast") == check.threshold_for("bf16", "kernel")
    out = tmp_path / "c"
    assert main(["check", "--model", str(tiny_config), "--scheme", "fp8-channel-token", "--seeds", "1",
                 "--batch-sizes", "1", "9", "--backends", "triton", "--out", str(out)]) == 0
    (result,) = json.loads((out / "check.json").read_text())["models"][0]["backends"]
    assert result["class"] == "kernel-fast" and result["passed"]
    # the interpreter sums exactly, so on the CPU fast mode still meets the kernel budget
    assert torch.cuda.is_available() or result["worst"]["rel_l2"] < 1e-2


def test_intermediate_granularity_of_triton_follows_its_kernels():
    if "triton" not in moekit.backend_names():
        pytest.skip("no triton backend registered")
    schemes = moekit.SCHEMES
    assert check.intermediate_granularity("triton", schemes["fp8-channel-token"]) == "group"
    assert check.intermediate_granularity("triton", schemes["fp8-block128"]) is None
    assert check.intermediate_granularity("triton", schemes["fp8-tensor-dynamic"]) is None
    assert check.intermediate_granularity("reference", schemes["fp8-channel-token"]) is None
    with pytest.MonkeyPatch.context() as mp:  # fast accumulation: per row, the scheme's own rule
        mp.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
        assert check.intermediate_granularity("triton", schemes["fp8-channel-token"]) is None
        assert check.intermediate_granularity("triton", schemes["fp8-block128"]) is None
    assert not check.gemm1_output_rounded("triton", schemes["fp8-channel-token"])
    if "cutlass" in moekit.backend_names():
        assert check.gemm1_output_rounded("cutlass", schemes["fp8-channel-token"])


class RoundsGemm1Output(ReferenceBackend):
    """float32 like the reference, but GEMM1's output stored in bf16 before SiLU (as cutlass does),
    declared through the `gemm1_output_rounded` attribute."""

    name = "roundsh"
    gemm1_output_rounded = True

    def run(self, x, weights, topk_weights, topk_ids):
        from moekit import quant

        s, M, K, N = weights.scheme, *topk_ids.shape, weights.n
        xq = quant.fake_quantize_activation(x, s.activation, weights.a13_scale)
        w13, w2 = weights.dequantize()
        ids = topk_ids.long()
        h = torch.einsum("mh,mkfh->mkf", xq, w13[ids]).to(x.dtype).float()  # the added rounding point
        act = (torch.nn.functional.silu(h[..., :N]) * h[..., N:]).to(x.dtype).float().reshape(M * K, N)
        act = quant.fake_quantize_activation(act, s.activation, weights.a2_scale).reshape(M, K, N)
        y = torch.einsum("mkn,mkhn->mkh", act, w2[ids])
        return (y * topk_weights[:, :, None]).sum(1).to(x.dtype)


def test_backend_is_compared_with_its_own_rounding_points(tmp_path, tiny_config, registry, monkeypatch):
    registry(RoundsGemm1Output())
    argv = ["check", "--model", str(tiny_config), "--scheme", "fp8-channel-token", "--seeds", "2",
            "--batch-sizes", "1", "7", "64", "--backends", "roundsh"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    report = json.loads((tmp_path / "a" / "check.json").read_text())
    (result,) = report["models"][0]["backends"]
    assert result["problem"] == {"intermediate_granularity": None, "gemm1_output_rounded": True}
    assert result["worst"]["rel_l2"] < 5e-3

    # without the declaration the bf16 rounding of h flips intermediate FP8 roundings: ~2e-2, a fail
    monkeypatch.setattr(RoundsGemm1Output, "gemm1_output_rounded", False)
    assert main([*argv, "--out", str(tmp_path / "b")]) == 1
    report = json.loads((tmp_path / "b" / "check.json").read_text())
    assert 1e-2 < report["models"][0]["backends"][0]["worst"]["rel_l2"] < 5e-2


# ------------------------------------------------------------------ Ctrl-C, earlier results


def test_check_ctrl_c_writes_the_cases_checked_so_far_as_partial(tmp_path, tiny_config, monkeypatch, capsys):
    calls = []
    original = check.fused_moe

    def interrupted_at_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(check, "fused_moe", interrupted_at_third)
    out = tmp_path / "c"
    argv = ["check", "--model", str(tiny_config), "--backends", "reference", "--seeds", "1",
            "--batch-sizes", "1", "5", "9", "--out", str(out)]
    try:
        assert main(argv) == 130
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main: a traceback, and the cases checked lost")
    text = " ".join(capsys.readouterr().out.split())
    assert f"interrupted: wrote the cases checked so far to {out / 'check.partial.json'}" in text
    assert [p.name for p in out.iterdir()] == ["check.partial.json"]  # no check.json: no verdict
    report = json.loads((out / "check.partial.json").read_text())
    assert report["passed"] is None and report["metadata"]["complete"] is False
    (result,) = report["models"][0]["backends"]
    assert [c["batch_size"] for c in result["cases"]] == [1, 5]

    monkeypatch.setattr(check, "fused_moe", original)
    assert main(argv) == 2  # an earlier run's report is not replaced without --overwrite
    assert "already holds the results of an earlier run (check.partial.json)" in one_line_error(capsys)
    assert main([*argv, "--overwrite"]) == 0
    assert [p.name for p in out.iterdir()] == ["check.json"]  # the partial report superseded
    assert json.loads((out / "check.json").read_text())["passed"] is True


def test_check_refuses_to_replace_an_earlier_report_without_overwrite(tmp_path, tiny_config, capsys):
    out = tmp_path / "c"
    argv = ["check", "--model", str(tiny_config), "--backends", "reference", "--seeds", "1",
            "--batch-sizes", "1", "--out", str(out)]
    assert main(argv) == 0
    before = (out / "check.json").read_bytes()
    capsys.readouterr()
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert "already holds the results of an earlier run (check.json)" in line and "--overwrite" in line
    assert (out / "check.json").read_bytes() == before
    assert main([*argv, "--seed", "5", "--overwrite"]) == 0
    assert json.loads((out / "check.json").read_text())["metadata"]["seed"] == 5


def test_a_model_no_backend_can_be_checked_on_is_not_a_pass(tmp_path, tiny_config, monkeypatch, capsys):
    """Every backend refusing the model (all skipped, with their reasons): nothing was checked, so
    the verdict cannot be 'all backends pass' with exit status 0."""
    from moekit.backends import backend_names, get_backend

    for name in backend_names():
        monkeypatch.setattr(type(get_backend(name)), "supports", lambda self, *a, **k: ["not on this machine"])
    out = tmp_path / "c"
    assert main(["check", "--model", str(tiny_config), "--seeds", "1", "--batch-sizes", "1", "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert "all backends pass" not in text and "no backend could be checked on tiny-moe" in text
    report = json.loads((out / "check.json").read_text())
    assert report["passed"] is False and report["models"][0]["backends"] == []
    assert set(report["models"][0]["skipped_backends"]) == set(backend_names())


# ------------------------------------------------------------------------------ the routing check


def test_check_reports_the_routing_kernel_against_its_torch_ops(tmp_path, capsys):
    """Per model, route()'s kernel against its torch ops at the model's own E and rule
    (routing.agreement): in the report, on the terminal, and in the verdict. On the CPU it runs
    only under the interpreter (where the tests run); otherwise it says why it did not."""
    from moekit.routing import agreement

    out = tmp_path / "c"
    assert main(["check", "--model", "deepseek-v3", "--tp", "8", "--backends", "reference", "--seeds", "1",
                 "--batch-sizes", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    routing = json.loads((out / "check.json").read_text())["models"][0]["routing"]
    if not moekit.env.interpreting() and CPU:
        assert routing == {"skipped": check.ROUTING_NOT_CHECKED}
        return
    assert routing["tokens"] == check.ROUTING_TOKENS and routing["passed"] is True
    assert routing["same"] + routing["near_ties"] == routing["tokens"] and routing["disagree"] == 0
    assert routing["worst_weight_rel"] <= agreement.WEIGHT_RTOL
    assert "routing kernel vs torch ops" in " ".join(text.split())


def test_check_skips_the_routing_check_where_the_kernel_cannot_run(tmp_path, monkeypatch, capsys):
    if not CPU:
        pytest.skip("on a GPU the kernel always runs")
    monkeypatch.setattr(moekit.env, "interpreting", lambda: False)
    out = tmp_path / "c"
    assert main(["check", "--model", "mixtral-8x7b", "--backends", "reference", "--seeds", "1", "--batch-sizes", "1",
                 "--out", str(out)]) == 0
    assert json.loads((out / "check.json").read_text())["models"][0]["routing"] == {"skipped": check.ROUTING_NOT_CHECKED}
    assert "not checked here" in " ".join(capsys.readouterr().out.split())  # rich wraps at 80 columns


def test_a_routing_kernel_choosing_other_experts_fails_the_check(tmp_path, monkeypatch, capsys):
    """A kernel whose ids are off by one expert (a plausible indexing slip) fails: exit 1, the
    verdict names the routing kernel, and the report counts the wrong rows."""
    from moekit.routing import fused

    if CPU and not moekit.env.interpreting():
        pytest.skip("the routing kernel runs on CPU tensors only under TRITON_INTERPRET=1")
    real = fused.route_fused

    def shifted(logits, *args, **kwargs):
        weights, ids = real(logits, *args, **kwargs)
        return weights, (ids + 1) % logits.shape[1]

    monkeypatch.setattr(fused, "route_fused", shifted)
    out = tmp_path / "c"
    assert main(["check", "--model", "mixtral-8x7b", "--backends", "reference", "--seeds", "1", "--batch-sizes", "1",
                 "--out", str(out)]) == 1
    text = capsys.readouterr().out
    report = json.loads((out / "check.json").read_text())
    routing = report["models"][0]["routing"]
    assert report["passed"] is False and routing["passed"] is False
    assert routing["disagree"] + routing["near_ties"] == routing["tokens"] and routing["disagree"] > 0
    assert "the routing kernel FAILS on mixtral-8x7b" in " ".join(text.split())


def test_ctrl_c_during_the_routing_check_keeps_the_models_checked(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the second model's routing is checked: the first model's report (and the
    second's backends, with no routing result) land in check.partial.json, as during the backends'."""
    calls = []
    real = check._check_routing

    def interrupted_at_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(check, "_check_routing", interrupted_at_second)
    out = tmp_path / "c"
    assert main(["check", "--model", "mixtral-8x7b", "--model", "olmoe-1b-7b", "--backends", "reference",
                 "--seeds", "1", "--batch-sizes", "1", "--out", str(out)]) == 130
    report = json.loads((out / "check.partial.json").read_text())
    first, second = report["models"]
    assert first["routing"] is not None and second["routing"] is None
    assert second["backends"][0]["passed"] is True and report["passed"] is None


@pytest.mark.parametrize("name,value", [("MOEKIT_FP8_ACCUMULATION", "bogus"), ("MOEKIT_PDL", "maybe")])
def test_check_refuses_a_bad_triton_setting_first(name, value, tmp_path, monkeypatch, capsys):
    """check ran on: a traceback while building its table (triton on an FP8 scheme) or every
    backend, reference included, reported as failing, and a FAIL report written."""
    monkeypatch.setenv(name, value)
    assert main(["check", "--model", PRESET, "--out", str(tmp_path / "o")]) == 2
    assert f"{name}='{value}'" in one_line_error(capsys)
    assert not (tmp_path / "o").exists()
