"""moekit.hf.warmup: one moekit.warmup per distinct experts shape of a transformers model, and the
fused routers' kernel."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import moekit.hf as mh  # noqa: E402
from moekit import compile_ahead  # noqa: E402
from moekit.hf import compile_ahead as hf_ahead  # noqa: E402

from test_hf_tiny import EXPERTS, HIDDEN, INTER, tiny_model  # noqa: E402


@pytest.fixture
def recorded(monkeypatch):
    """The moekit.warmup calls (weights' shape, scheme, top_k, backend, sizes) and warm_routing calls."""
    calls = {"experts": [], "routing": []}

    def experts(weights, top_k, *, batch_sizes, dtype, backend, allow_weight_copies, on_size):
        assert allow_weight_copies is False  # as the experts' own calls (hf/experts.py)
        calls["experts"].append((weights.shape(top_k), weights.scheme.name, top_k, backend, list(batch_sizes), dtype))
        return compile_ahead.WarmupReport({}, (), 0, 0.0)

    monkeypatch.setattr(hf_ahead, "warm_weights", experts)
    monkeypatch.setattr(hf_ahead, "warm_routing", lambda *a: calls["routing"].append(a))
    return calls


def test_one_warmup_per_experts_shape(tmp_path, recorded, device):
    src = tmp_path / "bf16"
    tiny_model("qwen3_moe").save_pretrained(src)  # two MoE layers of one shape
    # on the device the triton backend runs on: on a GPU machine it refuses CPU tensors
    model = mh.from_pretrained(src, scheme="fp8-channel-token", backend="triton", device_map=str(device))
    reports = mh.warmup(model, 4)
    assert len(reports) == 1 and recorded["routing"] == []  # no fused router
    [(shape, scheme, top_k, backend, sizes, dtype)] = recorded["experts"]
    assert (shape.num_experts, shape.hidden, shape.n, top_k) == (EXPERTS, HIDDEN, INTER, 2)
    assert (scheme, backend, sizes, dtype) == ("fp8-channel-token", "triton", [1, 2, 3, 4], torch.bfloat16)


def test_transformers_own_experts_with_the_moekit_implementation(recorded):
    model = tiny_model("olmoe")
    with pytest.raises(ValueError, match="no experts module of this model runs through moekit"):
        mh.warmup(model, 2)
    model.set_experts_implementation("moekit")
    assert len(mh.warmup(model, batch_sizes=[8], top_k=1)) == 1
    [(shape, scheme, top_k, backend, sizes, _)] = recorded["experts"]
    assert (scheme, top_k, backend, sizes) == ("bf16", 1, "auto", [8])


def test_fused_routers_get_routes_kernel(recorded, device):
    model = tiny_model("deepseek_v3").to(device)
    mh.patch_model(model, backend="triton")  # moekit's experts beside the routers: they can be fused
    assert mh.fuse_routers(model) > 0
    mh.warmup(model, 3)
    [(config, experts, sizes, on, dtypes, bias)] = recorded["routing"]  # one router shape
    assert (config.top_k, experts, sizes, dtypes) == (2, EXPERTS, [1, 2, 3], (torch.float32,))
    assert on.type == device.type  # the routers' own device
    assert bias is not None and bias.shape == (EXPERTS,)  # the grouped rule's correction bias


def test_bad_input(recorded):
    model = tiny_model("olmoe")
    model.set_experts_implementation("moekit")
    with pytest.raises(ValueError, match="not both or neither"):
        mh.warmup(model)
    with pytest.raises(ValueError, match="pass top_k"):
        mh.warmup(torch.nn.Linear(2, 2), 2)  # no config to read num_experts_per_tok from


def test_the_real_warmup_runs_on_a_tiny_model(tmp_path, monkeypatch, device):
    """Not recorded: moekit.warmup itself on the model's weights (the interpreter compiles nothing)."""
    src = tmp_path / "bf16"
    tiny_model("mixtral").save_pretrained(src)
    model = mh.from_pretrained(src, scheme="fp8-channel-token", backend="triton", device_map=str(device))
    [report] = mh.warmup(model, batch_sizes=[1, 5])
    assert report.sizes == {"triton": (1, 5)} and report.compiled == ("triton",)
