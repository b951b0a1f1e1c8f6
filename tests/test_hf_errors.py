"""Bad input to moekit.hf: every error names the module and the tensor (or field) at fault."""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("compressed_tensors")

import moekit  # noqa: E402
import moekit.hf as mh  # noqa: E402
from moekit.hf import UnsupportedModelError  # noqa: E402

from test_hf_tiny import fp8_checkpoint, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """A tiny Qwen3-MoE compressed-tensors fp8-channel-token checkpoint written by moekit."""
    return fp8_checkpoint(tmp_path_factory, "qwen3_moe")


def _copy(folder, tmp_path):
    import shutil

    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    return dst


def _edit_tensors(folder, fn):
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = fn(load_file(path))
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(folder, fn):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    fn(config)
    path.write_text(json.dumps(config))


def test_missing_scale_names_module_and_tensor(fp8_dir, tmp_path):
    ckpt = _copy(fp8_dir[0], tmp_path)
    gone = "model.layers.1.mlp.experts.5.up_proj.weight_scale"
    _edit_tensors(ckpt, lambda t: {k: v for k, v in t.items() if k != gone})
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp\.experts: checkpoint has no tensor "
                                                    r"'model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight_scale'"):
        mh.from_pretrained(ckpt)


def test_mismatched_shape_names_tensor(fp8_dir, tmp_path):
    ckpt = _copy(fp8_dir[0], tmp_path)
    key = "model.layers.0.mlp.experts.2.down_proj.weight"
    _edit_tensors(ckpt, lambda t: {**t, key: t[key][:, :64].contiguous()})
    with pytest.raises(UnsupportedModelError, match=r"'model\.layers\.0\.mlp\.experts\.2\.down_proj\.weight' has "
                                                    r"shape \(64, 64\); the model expects \(64, 128\)"):
        mh.from_pretrained(ckpt)


def test_wrong_scale_shape(fp8_dir, tmp_path):
    ckpt = _copy(fp8_dir[0], tmp_path)
    key = "model.layers.0.mlp.experts.0.gate_proj.weight_scale"
    _edit_tensors(ckpt, lambda t: {**t, key: t[key][:3].contiguous()})
    with pytest.raises(UnsupportedModelError, match=r"gate_proj\.weight_scale' has shape \(3, 1\); a per-channel scale"):
        mh.from_pretrained(ckpt)


def test_unsupported_quantization_names_field(fp8_dir, tmp_path):
    ckpt = _copy(fp8_dir[0], tmp_path)

    def int4(config):
        config["quantization_config"]["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4)

    _edit_config(ckpt, int4)
    with pytest.raises(UnsupportedModelError, match=r"quantization_config\.config_groups\.group_0\.weights\.type"):
        mh.from_pretrained(ckpt)


def test_fp8_checkpoint_is_not_converted_to_another_scheme(fp8_dir):
    with pytest.raises(UnsupportedModelError, match="does not convert them to fp8-block128"):
        mh.from_pretrained(fp8_dir[0], scheme="fp8-block128")


def test_static_scheme_needs_calibration(fp8_dir):
    with pytest.raises(UnsupportedModelError, match="calibration="):
        mh.from_pretrained(fp8_dir[1], scheme="fp8-tensor-static")


def test_family_without_fused_experts(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "llama")
    with pytest.raises(UnsupportedModelError, match=r"model_type 'llama' has no fused experts moekit can run"):
        mh.from_pretrained(tmp_path / "llama")
    with pytest.raises(UnsupportedModelError, match=r"LlamaForCausalLM has no experts module"):
        mh.patch_model(model)


def test_experts_moekit_cannot_compute():
    """A transformers experts module with biases is refused, naming the reason."""
    from moekit.hf.experts import ExpertsError, moekit_experts_forward

    experts = tiny_model("qwen3_moe").model.layers[0].mlp.experts
    experts.has_bias = True
    with pytest.raises(ExpertsError, match="Qwen3MoeExperts.*cannot run on moekit: its experts have biases"):
        moekit_experts_forward(experts, torch.randn(3, 64).bfloat16(), torch.zeros(3, 2, dtype=torch.long),
                               torch.ones(3, 2))


def test_unquantized_experts_under_fp8_config_are_logged(fp8_dir, tmp_path, caplog):
    """quantization_config says FP8 but the experts are stored in bf16: loaded as stored, and said."""
    from safetensors.torch import load_file

    ckpt = _copy(fp8_dir[0], tmp_path)
    bf16 = load_file(fp8_dir[1] / "model.safetensors")
    _edit_tensors(ckpt, lambda t: {**{k: v for k, v in t.items() if ".experts." not in k},
                                   **{k: v for k, v in bf16.items() if ".experts." in k}})
    with caplog.at_level(logging.WARNING, logger="moekit.hf"):
        model = mh.from_pretrained(ckpt, backend="reference")
    assert any("experts are stored as torch.bfloat16" in r.getMessage() for r in caplog.records)
    assert {m.scheme.name for m in mh.experts_modules(model).values()} == {"bf16"}


def test_backend_that_cannot_run_fails_at_load(fp8_dir):
    # without device_map the model loads on the CPU, where cutlass refuses on a GPU machine too
    # ("needs a CUDA device, got cpu"; the load check asks about the experts' device)
    with pytest.raises(moekit.BackendUnavailableError, match="needs a CUDA device, got cpu"):
        mh.from_pretrained(fp8_dir[0], backend="cutlass")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        mh.from_pretrained(fp8_dir[0], backend="nope")


def test_save_needs_moekit_experts(tmp_path):
    with pytest.raises(UnsupportedModelError, match="has no moekit experts"):
        mh.save_pretrained(tiny_model("mixtral"), tmp_path / "out")


def test_experts_that_are_not_contiguous_are_refused_by_name():
    """transformers' own experts parameters in another layout than contiguous [E, 2N, H] (the
    triton kernels assume it and read wrong elements otherwise): an ExpertsError naming the
    module and the tensor, not a silently wrong forward."""
    from torch import nn

    from moekit.hf.experts import ExpertsError, moekit_experts_forward

    experts = tiny_model("qwen3_moe").model.layers[0].mlp.experts
    gate_up = experts.gate_up_proj.detach()
    experts.gate_up_proj = nn.Parameter(gate_up.transpose(1, 2).contiguous().transpose(1, 2), requires_grad=False)
    assert torch.equal(experts.gate_up_proj, gate_up) and not experts.gate_up_proj.is_contiguous()
    with pytest.raises(ExpertsError, match=r"Qwen3MoeExperts.*MoEWeights\.w13 is not contiguous"):
        moekit_experts_forward(experts, torch.randn(3, 64).bfloat16(), torch.zeros(3, 2, dtype=torch.long),
                               torch.ones(3, 2))


def test_backend_check_at_load_uses_the_models_dtype(registry):
    """patch_model / from_pretrained check a named backend at load; for FP8 experts the check
    assumed bf16 activations whatever the model's dtype, so a backend refusing fp16 passed the
    load check of an fp16 model and failed at its first forward."""
    from moekit.backends.base import Backend

    class Bf16Only(Backend):
        name = "bf16-only-test"
        description = "refuses every activation dtype but bf16"

        def supports(self, shape, scheme, device, dtype=torch.bfloat16):
            return [] if dtype == torch.bfloat16 else [f"activations must be bfloat16, got {dtype}"]

        def run(self, x, weights, topk_weights, topk_ids):
            return moekit.get_backend("reference").run(x, weights, topk_weights, topk_ids)

    registry(Bf16Only())
    model = tiny_model("qwen3_moe").to(torch.float16)
    with pytest.raises(moekit.BackendUnavailableError, match="activations must be bfloat16, got torch.float16"):
        mh.patch_model(model, scheme="fp8-tensor-dynamic", backend="bf16-only-test")
    mh.patch_model(tiny_model("qwen3_moe"), scheme="fp8-tensor-dynamic", backend="bf16-only-test")  # bf16: runs


def test_experts_of_a_layer_the_model_skips_are_not_read(tmp_path_factory, tmp_path, monkeypatch, caplog):
    """DeepSeek-V3 / GLM-4.5 FP8 checkpoints carry a multi-token-prediction layer (model.layers.61
    / 46 / 92) that transformers skips (_keys_to_ignore_on_load_unexpected): its experts raised
    "belong to no experts module of the model". Here the tiny model's extra layer 2 stands for it."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    src, _ = fp8_checkpoint(tmp_path_factory, "deepseek_v3", "fp8-block128")
    ckpt = _copy(src, tmp_path)
    _edit_tensors(ckpt, lambda t: {**t, **{k.replace("layers.1.", "layers.2."): v.clone()
                                           for k, v in t.items() if k.startswith("model.layers.1.")}})
    monkeypatch.setattr(ds.DeepseekV3PreTrainedModel, "_keys_to_ignore_on_load_unexpected", [r"model\.layers\.2.*"])
    with caplog.at_level(logging.INFO, logger="moekit.hf"):
        model = mh.from_pretrained(ckpt, backend="reference")
    said = [r for r in caplog.records if "model.layers.2.mlp.experts" in r.getMessage()]
    assert said and {r.levelno for r in said} == {logging.INFO}, [r.getMessage() for r in caplog.records]
    want = mh.experts_modules(mh.from_pretrained(src, backend="reference"))
    got = mh.experts_modules(model)
    assert list(got) == list(want) == ["model.layers.1.mlp.experts"]
    assert torch.equal(got["model.layers.1.mlp.experts"].w13.view(torch.uint8),
                       want["model.layers.1.mlp.experts"].w13.view(torch.uint8))

    # experts that transformers does not know to skip: loaded all the same, with a warning
    monkeypatch.setattr(ds.DeepseekV3PreTrainedModel, "_keys_to_ignore_on_load_unexpected", [])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moekit.hf"):
        mh.from_pretrained(ckpt, backend="reference")
    said = [r for r in caplog.records if "model.layers.2.mlp.experts" in r.getMessage()]
    assert said and {r.levelno for r in said} == {logging.WARNING}

    # the opposite case still raises: an experts module of the model without checkpoint tensors
    _edit_tensors(ckpt, lambda t: {k: v for k, v in t.items() if not k.startswith("model.layers.1.mlp.experts.")})
    with pytest.raises(UnsupportedModelError, match=r"has no expert tensors for model\.layers\.1\.mlp\.experts"):
        mh.from_pretrained(ckpt)


# ---- a refused patch_model / from_pretrained: refused early, the model left as it was ----------


def _state(model):
    """What a refused patch_model must leave as it was: each module's class, each parameter and
    buffer (the very tensor object), and the experts implementation."""
    return ({name: type(m) for name, m in model.named_modules()}, dict(model.named_parameters()),
            dict(model.named_buffers()), model.config._experts_implementation)


def _assert_unchanged(model, before, logits, ids):
    types, params, buffers, implementation = _state(model)
    assert types == before[0]
    assert params.keys() == before[1].keys() and all(params[k] is p for k, p in before[1].items())
    assert buffers.keys() == before[2].keys() and all(buffers[k] is b for k, b in before[2].items())
    assert implementation == before[3]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)  # its own forward, as before


def _refused_patch(model, error, match, **kwargs):
    """patch_model(model, **kwargs) raises `error` matching `match`, and the model is as it was."""
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    calls = []
    hook = model.model.layers[0].register_forward_hook(lambda *_: calls.append(1))
    before = _state(model)
    with pytest.raises(error, match=match):
        mh.patch_model(model, **kwargs)
    _assert_unchanged(model, before, logits, ids)
    # a hook registered before can still be removed: its handle holds the module's very hook dict
    assert calls == [1]
    hook.remove()
    with torch.no_grad():
        model(input_ids=ids)
    assert calls == [1]


@pytest.mark.parametrize("scheme", [None, "fp8-block128"])
def test_a_backend_that_cannot_run_leaves_the_model_as_it_was(scheme, monkeypatch):
    """patch_model(backend="cutlass") on the CPU replaced every experts module (and with a scheme
    quantized them, the bf16 originals released) before the backend check refused: the model then
    failed at its first token. The check now comes before any quantization, and the model is
    put back as it was."""
    import moekit.hf.load as load

    quantized = []
    monkeypatch.setattr(load, "_quantize_modules", lambda *a, **k: quantized.append(a))
    _refused_patch(tiny_model("mixtral"), moekit.BackendUnavailableError,
                   r"(?s)backend 'cutlass' .*needs a CUDA device", scheme=scheme, backend="cutlass")
    assert not quantized  # refused before quantizing in vain


def test_a_checkpoint_of_another_model_leaves_the_model_as_it_was(fp8_dir):
    """A Qwen3-MoE checkpoint given to a Mixtral: CheckpointError, which left the experts replaced."""
    _refused_patch(tiny_model("mixtral"), UnsupportedModelError, "no expert tensors found", checkpoint=fp8_dir[0])
    _refused_patch(tiny_model("mixtral"), UnsupportedModelError, "is not a model folder: it has no config.json",
                   checkpoint=fp8_dir[0] / "nowhere")
    _refused_patch(tiny_model("mixtral"), ValueError, "unknown backend 'nope'", backend="nope")
    _refused_patch(tiny_model("mixtral"), ValueError, "fp8-chanel-token", scheme="fp8-chanel-token")


def test_a_checkpoint_refused_at_its_last_layer_leaves_the_model_as_it_was(fp8_dir, tmp_path):
    """A tensor missing at layer 1 is found once layer 0 was refilled from the checkpoint: layer
    0's transformers experts (or moekit's own bf16 ones, buffers and scheme) are put back."""
    ckpt = _copy(fp8_dir[0], tmp_path)
    gone = "model.layers.1.mlp.experts.3.gate_proj.weight_scale"
    _edit_tensors(ckpt, lambda t: {k: v for k, v in t.items() if k != gone})
    match = r"model\.layers\.1\.mlp\.experts: checkpoint has no tensor 'model\.layers\.1\.mlp\.experts\.3\.gate_proj"
    _refused_patch(tiny_model("qwen3_moe"), UnsupportedModelError, match, checkpoint=ckpt)
    ours = mh.from_pretrained(fp8_dir[1], backend="reference")  # moekit's bf16 experts, refilled in place
    _refused_patch(ours, UnsupportedModelError, match, checkpoint=ckpt)
    assert {m.scheme.name for m in mh.experts_modules(ours).values()} == {"bf16"}


def test_moekit_backend_is_checked_at_load(fp8_dir, monkeypatch):
    """MOEKIT_BACKEND, which backend="auto" defers to, was never checked at load: a backend that
    cannot run, or a misspelt one, loaded without complaint and failed at the first token."""
    import moekit.hf.load as load

    monkeypatch.setenv("MOEKIT_BACKEND", "cutlass")
    with pytest.raises(moekit.BackendUnavailableError, match=r"from MOEKIT_BACKEND=cutlass\) cannot run"):
        mh.from_pretrained(fp8_dir[0])
    _refused_patch(tiny_model("mixtral"), moekit.BackendUnavailableError, "MOEKIT_BACKEND=cutlass")
    monkeypatch.setenv("MOEKIT_BACKEND", "tritn")
    monkeypatch.setattr(load, "_model_class", lambda config: pytest.fail("loaded before refusing"))
    with pytest.raises(ValueError, match=r"MOEKIT_BACKEND='tritn': unknown backend 'tritn'"):
        mh.from_pretrained(fp8_dir[0])
    _refused_patch(tiny_model("mixtral"), ValueError, r"MOEKIT_BACKEND='tritn'")
    monkeypatch.setenv("MOEKIT_BACKEND", "reference")
    mh.patch_model(tiny_model("mixtral"))  # one that runs: as before


@pytest.mark.parametrize("calibration, error, match", [
    ("some text", ValueError, r"tokenizer of '.*' encoded the text into no token ids.*tokenizer\.json"),
    (torch.zeros(1, 0, dtype=torch.long), ValueError, r"no token ids \(shape \(1, 0\)\)"),
    (torch.tensor([[1, 2, 300]]), ValueError, r"must be in \[0, 256\) \(the config's vocab_size\); 1 are not, "
                                              r"e\.g\. 300 at \(0, 2\)"),
    (torch.tensor([[-1, 2]]), ValueError, r"must be in \[0, 256\).* e\.g\. -1 at \(0, 0\)"),
    (torch.tensor([[1.5, 2.0]]), TypeError, r"token ids must be an int64 or int32 tensor, got torch\.float32"),
    (torch.ones(1, 2, 3, dtype=torch.long), ValueError, r"\[tokens\] or \[batch, tokens\], got shape \(1, 2, 3\)"),
])
def test_calibration_ids_are_checked_before_the_weights_load(fp8_dir, monkeypatch, calibration, error, match):
    """Calibration ids were never checked: after the whole model loaded, the calibration forward
    failed inside it (a reshape of 0 elements, an embedding's IndexError or dtype error). A
    folder without tokenizer files gives transformers' empty tokenizer, which encodes to nothing."""
    import moekit.hf.load as load

    with monkeypatch.context() as m:
        m.setattr(load, "_model_class", lambda config: pytest.fail("loaded before refusing"))
        with pytest.raises(error, match=match):
            mh.from_pretrained(fp8_dir[1], scheme="fp8-tensor-static", calibration=calibration)
    if not isinstance(calibration, str):  # patch_model takes no text
        _refused_patch(tiny_model("qwen3_moe"), error, match, scheme="fp8-tensor-static", calibration=calibration)


def test_a_nan_scale_names_the_module_and_the_checkpoint_tensor(fp8_dir, tmp_path):
    """MoEWeights' refusal of a NaN scale named only its own field (w13_scale at (5, 128)); the
    missing-tensor and wrong-shape errors name the module and the checkpoint tensor: so does it."""
    ckpt = _copy(fp8_dir[0], tmp_path)
    key = "model.layers.1.mlp.experts.5.up_proj.weight_scale"
    _edit_tensors(ckpt, lambda t: {**t, key: torch.full_like(t[key], float("nan"))})
    with pytest.raises(UnsupportedModelError, match=(
            r"^model\.layers\.1\.mlp\.experts: read from checkpoint tensor "
            r"'model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight_scale': MoEWeights\.w13_scale has 128 value\(s\) "
            r"that are NaN, infinite or negative, e\.g\. nan at \(5, 128\)")):
        mh.from_pretrained(ckpt)


def test_quantizing_in_place_releases_each_modules_originals_as_it_goes(monkeypatch):
    """patch_model(scheme=...) on moekit's own bf16 experts (as from_pretrained gives them): each
    module's bf16 tensors are released once it is quantized, not held to the end for a rollback
    (quantizing comes after every check), so the experts are never in memory twice over."""
    import gc
    import weakref

    import moekit.hf.load as load

    model = tiny_model("qwen3_moe")
    mh.patch_model(model)
    modules = list(mh.experts_modules(model).values())
    for m in modules:  # experts owning their bf16 tensors, not views of transformers' weights
        w = m.moe_weights()
        m.load(type(w)(w.scheme, w.w13.clone(), w.w2.clone()))
    first = weakref.ref(modules[0]._buffers["w13"])
    alive = []
    quantize = load._quantize_module

    def quantize_and_look(m, scheme, calibration):
        quantize(m, scheme, calibration)
        gc.collect()
        alive.append(first() is not None)

    monkeypatch.setattr(load, "_quantize_module", quantize_and_look)
    mh.patch_model(model, scheme="fp8-channel-token")
    assert len(alive) == len(modules) > 1 and not any(alive)
    assert {m.scheme.name for m in modules} == {"fp8-channel-token"}


# ---- arguments and models moekit.hf took without a word -------------------------------------------


def test_transformers_save_pretrained_of_moekit_experts_is_refused(fp8_dir, tmp_path):
    """model.save_pretrained() (transformers' own, which push_to_hub and Trainer call) wrote
    moekit's buffers (experts.w13, w2, scales) and no quantization_config: transformers reloaded
    the folder with random experts and moekit could not read it. It is refused, pointing to
    moekit.hf.save_pretrained; the refusal survives deepcopy and pickling."""
    import copy
    import io

    loaded = mh.from_pretrained(fp8_dir[0], backend="reference")
    patched = mh.patch_model(tiny_model("qwen3_moe"), backend="reference")
    for model in (loaded, patched, copy.deepcopy(patched)):
        for owner in (model, model.model):  # the base model is a PreTrainedModel too
            out = tmp_path / "out"
            with pytest.raises(UnsupportedModelError, match=(
                    rf"^{type(owner).__name__}\.save_pretrained: transformers would write moekit's experts "
                    r"\((model\.)?layers\.0\.mlp\.experts, \.\.\.\).*use moekit\.hf\.save_pretrained\(model, path\)")):
                owner.save_pretrained(out)
            assert not out.exists()
    buffer = io.BytesIO()
    torch.save(patched, buffer)  # (a compressed-tensors checkpoint pickles only after its first forward)
    buffer.seek(0)
    with pytest.raises(UnsupportedModelError, match="use moekit.hf.save_pretrained"):
        torch.load(buffer, weights_only=False).save_pretrained(tmp_path / "out")
    # moekit's own save is the way: transformers reads back what was loaded
    mh.save_pretrained(loaded, tmp_path / "saved")
    assert "quantization_config" in json.loads((tmp_path / "saved" / "config.json").read_text())
    tiny_model("qwen3_moe").save_pretrained(tmp_path / "plain")  # transformers' own experts: saved as ever


def test_quantize_model_without_moekit_experts_is_refused():
    """quantize_model(model, scheme) on transformers' own experts returned None and changed nothing."""
    model = tiny_model("qwen3_moe")
    with pytest.raises(UnsupportedModelError, match=r"^Qwen3MoeForCausalLM has no moekit experts to quantize.*"
                                                    r"moekit\.hf\.patch_model\(model, scheme='fp8-block128'\)"):
        mh.quantize_model(model, "fp8-block128")
    assert not mh.experts_modules(model)
    mh.patch_model(model, backend="reference")
    mh.quantize_model(model, "fp8-block128")  # moekit's bf16 experts: quantized as before
    assert {m.scheme.name for m in mh.experts_modules(model).values()} == {"fp8-block128"}


def test_calibration_for_a_scheme_without_static_scales_is_refused(fp8_dir, monkeypatch):
    """calibration= was silently dropped unless the scheme was fp8-tensor-static (quantize_weights
    refuses it): the user believed scales were measured. Refused before anything loads or changes."""
    import moekit.hf.load as load

    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    cases = [("fp8-channel-token", "scheme fp8-channel-token computes its activation scales per call"),
             (None, "without scheme= the experts are not quantized"),
             ("bf16", "scheme bf16 does not quantize")]
    with monkeypatch.context() as m:
        m.setattr(load, "_model_class", lambda config: pytest.fail("loaded before refusing"))
        for scheme, why in cases:
            match = rf"^calibration: only for scheme fp8-tensor-static \(static activation scales\); {why}"
            with pytest.raises(ValueError, match=match):
                mh.from_pretrained(fp8_dir[1], scheme=scheme, calibration=ids)
            _refused_patch(tiny_model("qwen3_moe"), ValueError, match, scheme=scheme, calibration=ids)
    model = mh.patch_model(tiny_model("qwen3_moe"), backend="reference")
    with pytest.raises(ValueError, match="scheme fp8-tensor-dynamic computes its activation scales per call"):
        mh.quantize_model(model, "fp8-tensor-dynamic", ids)
    assert {m.scheme.name for m in mh.experts_modules(model).values()} == {"bf16"}


def test_offloaded_experts_are_refused_before_anything_changes(fp8_dir, tmp_path):
    """Experts that accelerate offloaded (device_map "disk" / "cpu") are meta tensors its hook loads
    for each forward: patch_model wrapped the meta tensors, and the first forward failed with
    "x is on cpu but the weights are on meta", naming nothing."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(fp8_dir[1], dtype=torch.bfloat16, device_map=device_map,
                                                 offload_folder=tmp_path / "offload").eval()
    assert model.model.layers[1].mlp.experts.gate_up_proj.device.type == "meta"
    match = (r"^model\.layers\.1\.mlp\.experts: the experts' gate_up_proj is on the meta device \(offloaded by "
             r"accelerate's device_map to 'cpu' or 'disk'\); moekit needs the experts' weights in memory")
    from moekit.hf.experts import ExpertsError

    _refused_patch(model, ExpertsError, match)
    _refused_patch(model, ExpertsError, match, checkpoint=fp8_dir[0])


def test_from_pretrained_arguments_that_moekit_sets(fp8_dir, monkeypatch):
    """experts_implementation= and output_loading_info= gave transformers' raw TypeError ("got
    multiple values for keyword argument"). experts_implementation="moekit" (what moekit sets) is
    taken, any other refused by name before loading; output_loading_info returns transformers'
    info, without the expert tensors moekit reads itself."""
    import moekit.hf.load as load

    with monkeypatch.context() as m:
        m.setattr(load, "_model_class", lambda config: pytest.fail("loaded before refusing"))
        with pytest.raises(ValueError, match=r"^experts_implementation='grouped_mm': moekit\.hf\.from_pretrained runs "
                                             r"the experts through moekit \('moekit'\)"):
            mh.from_pretrained(fp8_dir[0], experts_implementation="grouped_mm")
    model = mh.from_pretrained(fp8_dir[0], backend="reference", experts_implementation="moekit")
    assert {m.scheme.name for m in mh.experts_modules(model).values()} == {"fp8-channel-token"}
    model, info = mh.from_pretrained(fp8_dir[0], backend="reference", output_loading_info=True)
    assert {m.scheme.name for m in mh.experts_modules(model).values()} == {"fp8-channel-token"}
    assert not info["unexpected_keys"] and not info["missing_keys"], info


def test_transposed_experts_of_another_family_are_not_sent_to_patch_model():
    """Aria's transposed experts were told to "use moekit.hf.patch_model", which refuses Aria."""
    transformers = pytest.importorskip("transformers")
    from moekit.hf.experts import ExpertsError, moekit_experts_forward

    config = transformers.AriaTextConfig(hidden_size=64, intermediate_size=128, moe_num_experts=8, moe_topk=2,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         vocab_size=256)
    model = transformers.AriaTextForCausalLM(config).bfloat16()
    experts = next(m for m in model.modules() if type(m).__name__ == "AriaExperts")
    if not hasattr(experts, "gate_up_proj"):  # transformers' Aria of another version (the GPU machine's)
        pytest.skip("this transformers' AriaExperts holds no fused gate_up_proj to be transposed")
    with pytest.raises(ExpertsError, match=r"AriaExperts.*its weights are transposed \(\[E, H, 2N\]\), a layout moekit "
                                           r"runs only for Llama-4's experts"):
        moekit_experts_forward(experts, torch.randn(3, 64).bfloat16(), torch.zeros(3, 2, dtype=torch.long),
                               torch.ones(3, 2))
    with pytest.raises(UnsupportedModelError, match="has no experts module of a family moekit runs"):
        mh.patch_model(model)  # what the message does not send it to
