"""fused_moe's input checks, the backend override order and its errors."""

import logging

import pytest
import torch

import moekit
from moekit.select import ENV_VAR

from helpers import random_routing, random_weights, random_x


@pytest.fixture
def problem():
    w = random_weights(4, 128, 128, "fp8-channel-token")
    tw, ids = random_routing(3, 4, 2)
    return random_x(3, 128), w, tw, ids


def test_override_order(problem, monkeypatch):
    x, w, tw, ids = problem
    shape, scheme = w.shape(2), w.scheme
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert moekit.select_backend(shape, scheme, "cpu").source == "heuristic"
    monkeypatch.setenv(ENV_VAR, "reference")
    choice = moekit.select_backend(shape, scheme, "cpu")
    assert (choice.backend, choice.source) == ("reference", "environment")
    # the argument beats the environment (torch: a backend that runs on the CPU on any machine)
    choice = moekit.select_backend(shape, scheme, "cpu", backend="torch")
    assert (choice.backend, choice.source) == ("torch", "argument")
    monkeypatch.setenv(ENV_VAR, "auto")
    assert moekit.select_backend(shape, scheme, "cpu").source == "heuristic"


def test_auto_on_cpu_never_picks_a_refusing_backend(problem, monkeypatch):
    x, w, tw, ids = problem
    monkeypatch.delenv(ENV_VAR, raising=False)
    choice = moekit.select_backend(w.shape(2), w.scheme, "cpu")
    assert choice.backend not in choice.refused
    assert not moekit.get_backend(choice.backend).supports(w.shape(2), w.scheme, torch.device("cpu"))


def test_forced_backend_that_cannot_run_lists_reasons_and_alternatives(problem, monkeypatch):
    x, w, tw, ids = problem
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    moekit.select._supports_cache.clear()
    with pytest.raises(moekit.BackendUnavailableError) as err:
        moekit.fused_moe(x, w, tw, ids, backend="triton")
    text = str(err.value)
    assert "TRITON_INTERPRET" in text and "reference" in text and "backends that can" in text
    monkeypatch.setenv(ENV_VAR, "triton")
    with pytest.raises(moekit.BackendUnavailableError, match=f"{ENV_VAR}=triton"):
        moekit.fused_moe(x, w, tw, ids)


def test_unknown_backend_lists_valid_names(problem):
    x, w, tw, ids = problem
    with pytest.raises(ValueError, match="unknown backend 'fast'.*reference"):
        moekit.fused_moe(x, w, tw, ids, backend="fast")


def test_choice_is_logged_at_debug(problem, caplog):
    x, w, tw, ids = problem
    with caplog.at_level(logging.DEBUG, logger="moekit.select"):
        moekit.fused_moe(x, w, tw, ids, backend="reference")
    assert "reference (argument" in caplog.text


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda x, tw, ids: (x.float().double(), tw, ids), "x has dtype torch.float64"),
        (lambda x, tw, ids: (x[:, :100], tw, ids), "hidden size 100 but the weights expect 128"),
        (lambda x, tw, ids: (x[:2], tw, ids), "routing has 3 rows but x has 2"),
        (lambda x, tw, ids: (x, tw[:, :1], ids), "differ in shape"),
        (lambda x, tw, ids: (x, tw, ids + 10), r"topk_ids must lie in \[0, 4\)"),
        (lambda x, tw, ids: (x, tw, ids - 5), r"topk_ids must lie in \[0, 4\)"),
        (lambda x, tw, ids: (x, tw, ids.float()), "topk_ids has dtype torch.float32"),
        (lambda x, tw, ids: (x, tw.int(), ids), "topk_weights has dtype torch.int32"),
        (lambda x, tw, ids: (x[0], tw, ids), "x must be 2-D"),
        (lambda x, tw, ids: (x, torch.rand(3, 5), torch.zeros(3, 5, dtype=torch.int32)), "top-k must be between 1 and the number of experts"),
    ],
)
def test_bad_inputs(problem, mutate, match):
    x, w, tw, ids = problem
    x, tw, ids = mutate(x, tw, ids)
    with pytest.raises((ValueError, TypeError), match=match):
        moekit.fused_moe(x, w, tw, ids, backend="reference")


def test_weights_validation():
    w = random_weights(2, 128, 128, "fp8-channel-token")
    with pytest.raises(ValueError, match="w13_scale is required"):
        moekit.MoEWeights.from_fp8("fp8-channel-token", w.w13, w.w2, None, w.w2_scale)
    with pytest.raises(ValueError, match=r"w2_scale has shape \(2, 5\); expected \(2, 128\)"):
        moekit.MoEWeights.from_fp8("fp8-channel-token", w.w13, w.w2, w.w13_scale, torch.ones(2, 5))
    with pytest.raises(ValueError, match="w13 has dtype torch.bfloat16; expected torch.float8_e4m3fn"):
        moekit.MoEWeights.from_fp8("fp8-channel-token", w.w13.bfloat16(), w.w2, w.w13_scale, w.w2_scale)
    with pytest.raises(ValueError, match="unknown quantization scheme 'int4'"):
        moekit.quantize_weights(torch.randn(2, 8, 8), torch.randn(2, 8, 4), "int4")
    with pytest.raises(ValueError, match="multiple of 128"):
        moekit.quantize_weights(torch.randn(2, 192, 128), torch.randn(2, 128, 96), "fp8-block128")
    with pytest.raises(ValueError, match="input_scales=.*calibration="):
        moekit.quantize_weights(torch.randn(2, 8, 16), torch.randn(2, 16, 4), "fp8-tensor-static")
    with pytest.raises(ValueError, match="is unquantized but scales were given"):
        moekit.MoEWeights("bf16", torch.randn(2, 8, 16).bfloat16(), torch.randn(2, 16, 4).bfloat16(), torch.ones(2))


def test_static_scales_from_checkpoint_and_calibration():
    w13, w2 = torch.randn(2, 8, 16), torch.randn(2, 16, 4)
    w = moekit.quantize_weights(w13, w2, "fp8-tensor-static", input_scales=(0.5, 0.25))
    assert w.a13_scale.item() == 0.5 and w.a2_scale.item() == 0.25
    x = torch.randn(10, 16)
    w = moekit.quantize_weights(w13, w2, "fp8-tensor-static", calibration=x)
    assert w.a13_scale.item() == pytest.approx(x.abs().max().item() / 448)
    assert w.a2_scale.item() > 0


def test_nbytes_is_the_fp8_size():
    w = random_weights(4, 128, 128, "fp8-channel-token")
    assert w.nbytes == 4 * 3 * 128 * 128 + 4 * (2 * 128 + 128) * 4
