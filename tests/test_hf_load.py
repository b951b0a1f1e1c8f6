"""moekit inside transformers: every family, every FP8 scheme, on tiny random models.

The chain tested for each family (test_family_roundtrip):
  bf16 model (transformers' classes) -> transformers save_pretrained
  -> moekit.hf.from_pretrained(scheme=S): experts quantized on load
  -> moekit.hf.save_pretrained: a compressed-tensors checkpoint
  -> moekit.hf.from_pretrained(FP8 folder): experts read as stored (bitwise the same as before),
     never dequantized, never held in bf16 (spied on, and counted in bytes)
  -> transformers' own compressed-tensors loader reads the same folder and dequantizes the
     experts: bitwise moekit's dequantization (the format is right), and the two models' logits
     agree within what FP8 activation quantization explains.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("compressed_tensors")

import moekit.hf as mh  # noqa: E402
from moekit.hf.families import family_of  # noqa: E402
from moekit.spec import BLOCK, get_scheme  # noqa: E402

from test_hf_tiny import EXPERTS, HIDDEN, INTER, tiny_model  # noqa: E402

# One scheme per family, so that the seven families cover the four FP8 schemes (static included).
SCHEME_OF = {
    "mixtral": "fp8-tensor-dynamic",
    "qwen2_moe": "fp8-channel-token",
    "qwen3_moe": "fp8-block128",
    "olmoe": "fp8-tensor-static",
    "deepseek_v3": "fp8-block128",
    "glm4_moe": "fp8-channel-token",
    "llama4": "fp8-channel-token",
}

# ---- thresholds (logits of the whole tiny model; 2 x 24 positions, vocab 256) -------------------
# moekit `reference` vs the same checkpoint dequantized to bf16 by transformers: both use the very
# same FP8 weights; moekit also rounds each GEMM input to e4m3 (3 mantissa bits, relative error
# <= 2^-4, RMS about 2^-4/sqrt(3) = 3.6% of the largest element of its token/tensor/group), so an
# expert's output moves by <= sqrt(2) * 3.6% ~ 5% RMS. With logits of std ~1.2 (INIT = 0.15),
# two MoE layers, and KL ~ Var(dlogit) / 2, that is KL ~ (0.05 * 1.2 * sqrt(2))^2 / 2 ~ 4e-3;
# routing flips (near-tied router logits) add the same order: bf16 rounding alone (moekit `torch`
# vs transformers, same bf16 math) measures 1e-3..3e-3 here. Measured reference-vs-bf16: 2e-4..9e-3.
# KL_MAX is ~4x the worst measured; broken experts (expert order off by one) give KL ~1 and
# top-1 ~0 (test_broken_experts_fail_the_thresholds), so the thresholds separate right from wrong.
KL_MAX = 0.04
TOP1_MIN = 0.75
# One MoE layer with fixed routing, moekit vs transformers' dequantized experts on the same input:
# `torch` computes transformers' bf16 math (differences: summation order, one bf16 ulp = 0.4%);
# `reference` adds the activation quantization above (<= 5% RMS; 8% leaves margin).
LAYER_TORCH_MAX = 0.02
LAYER_REFERENCE_MAX = 0.08


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def expected_expert_bytes(scheme: str, layers: int, E=EXPERTS, H=HIDDEN, N=INTER) -> int:
    """FP8 weights + float32 scales of `layers` MoE layers, from the scheme's definition."""
    s = get_scheme(scheme)
    weights = E * (2 * N * H + H * N)  # one byte each
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    scales = {"tensor": 2 * E, "channel": E * (2 * N + H),
              "block": E * (cdiv(2 * N, BLOCK) * cdiv(H, BLOCK) + cdiv(H, BLOCK) * cdiv(N, BLOCK))}[s.weight]
    return layers * (weights + 4 * scales + (8 if s.static_activation else 0))


def compare_logits(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(mean KL(b || a) over positions, top-1 agreement) of two logit tensors."""
    la, lb = a.float().log_softmax(-1), b.float().log_softmax(-1)
    kl = (lb.exp() * (lb - la)).sum(-1).mean()
    return float(kl), float((a.argmax(-1) == b.argmax(-1)).float().mean())


def tokens(n=24, batch=2, seed=1):
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


class Spy:
    """Records what would break the no-bf16-experts promise while a model loads: a transformers
    experts module built off the meta device, or transformers dequantizing an expert tensor."""

    def __init__(self, monkeypatch, family_name):
        from transformers.integrations import compressed_tensors as ct

        self.built_on, self.dequantized = [], []
        fam = family_of(family_name)
        cls = fam.original_class(fam.experts_class)
        init = cls.__init__

        def spy_init(module, *a, **k):
            init(module, *a, **k)
            self.built_on.append(module.gate_up_proj.device.type)

        monkeypatch.setattr(cls, "__init__", spy_init)
        convert = ct.CompressedTensorsDequantize.convert

        def spy_convert(op, input_dict, *a, **k):
            self.dequantized += [key for key in input_dict if ".experts." in key]
            return convert(op, input_dict, *a, **k)

        monkeypatch.setattr(ct.CompressedTensorsDequantize, "convert", spy_convert)


@pytest.fixture(scope="module")
def bf16_dirs(tmp_path_factory):
    """family -> folder of a tiny bf16 model saved by transformers (built once per module)."""
    cache = {}

    def get(family):
        if family not in cache:
            folder = tmp_path_factory.mktemp(family)
            tiny_model(family).save_pretrained(folder)
            cache[family] = folder
        return cache[family]

    return get


@pytest.mark.parametrize("family", list(SCHEME_OF))
def test_family_roundtrip(family, bf16_dirs, tmp_path, monkeypatch):
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM

    from moekit.models import parse_quantization_config

    scheme = SCHEME_OF[family]
    src = bf16_dirs(family)
    calibration = {"calibration": tokens(32, 1, seed=5)} if get_scheme(scheme).static_activation else {}
    quantized = mh.from_pretrained(src, scheme=scheme, backend="reference", **calibration)
    fp8_dir = tmp_path / "fp8"
    mh.save_pretrained(quantized, fp8_dir)

    # the quantization_config is one compressed-tensors parses, and the scheme moekit wrote
    qc = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)
    assert parse_quantization_config(qc) == get_scheme(scheme)

    spy = Spy(monkeypatch, family)
    model = mh.from_pretrained(fp8_dir, backend="reference")
    assert spy.built_on and set(spy.built_on) == {"meta"}, spy.built_on
    assert spy.dequantized == []

    # FP8 exactly as saved
    before, after = mh.experts_modules(quantized), mh.experts_modules(model)
    assert list(before) == list(after) and after
    for name in after:
        for key, t in before[name].moe_weights().tensors().items():
            u = getattr(after[name], key)
            assert u.dtype == t.dtype and torch.equal(u.view(torch.uint8) if u.dtype.itemsize == 1 else u,
                                                      t.view(torch.uint8) if t.dtype.itemsize == 1 else t), (name, key)

    # memory: the experts hold FP8 + float32 scales, and no bf16 tensor of expert size exists
    layers = len(after)
    assert mh.experts_nbytes(model) == expected_expert_bytes(scheme, layers)
    for m in after.values():
        assert m.w13.dtype == torch.float8_e4m3fn and m.w2.dtype == torch.float8_e4m3fn
    expert_numels = {EXPERTS * 2 * INTER * HIDDEN, EXPERTS * HIDDEN * INTER, 2 * INTER * HIDDEN, INTER * HIDDEN}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".experts" in name:
            assert t.dtype == torch.float8_e4m3fn or t.dtype == torch.float32, name
        elif "shared" not in name and "mlp" in name and t.dtype != torch.float8_e4m3fn:
            assert t.numel() not in expert_numels or "experts" not in name

    # transformers' own loader dequantizes the same folder: bitwise moekit's dequantization
    reference_bf16 = AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.bfloat16).eval()
    fam = family_of(family)
    fused = hasattr(reference_bf16.get_submodule(next(iter(after))), "gate_up_proj")
    for name, m in after.items():
        hf = reference_bf16.get_submodule(name)
        if fused:
            w13, w2 = m.moe_weights().dequantize()
            gate_up, down = hf.gate_up_proj, hf.down_proj
            if fam.transposed:
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            assert torch.equal(gate_up, w13.to(gate_up.dtype)) and torch.equal(down, w2.to(down.dtype)), name
        else:  # transformers' Llama-4 compressed-tensors path: per-expert FP8 Linear layers (bf16 scales)
            for e, mlp in enumerate(hf):
                for proj, q, sc in ((mlp.gate_proj, m.w13[e, :INTER], m.w13_scale[e, :INTER]),
                                    (mlp.up_proj, m.w13[e, INTER:], m.w13_scale[e, INTER:]),
                                    (mlp.down_proj, m.w2[e], m.w2_scale[e])):
                    assert torch.equal(proj.weight.view(torch.uint8), q.view(torch.uint8)), (name, e)
                    assert torch.equal(proj.weight_scale.float().flatten(), sc.to(proj.weight_scale.dtype).float())
    if fused:
        total_hf = sum(_bytes(t) for t in reference_bf16.state_dict().values())
        total_moekit = sum(_bytes(t) for t in model.state_dict().values())
        bf16_experts = sum(_bytes(reference_bf16.get_submodule(n).gate_up_proj)
                           + _bytes(reference_bf16.get_submodule(n).down_proj) for n in after)
        assert total_moekit == total_hf - bf16_experts + mh.experts_nbytes(model)

    ids = tokens()
    with torch.no_grad():  # (the first forward also lets compressed-tensors decompress its modules)
        want_logits = reference_bf16(ids).logits

    # one MoE layer on the same input and routing: moekit vs transformers' dequantized experts
    name = next(iter(after))
    block_name = name.rsplit(".", 1)[0]
    x = torch.randn(1, 40, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        want = reference_bf16.get_submodule(block_name)(x)
        want = want[0] if isinstance(want, tuple) else want
        # transformers' Llama-4 compressed-tensors path (not fused) quantizes activations itself
        torch_bound = LAYER_TORCH_MAX if fused else LAYER_REFERENCE_MAX
        for backend, bound in (("torch", torch_bound), ("reference", LAYER_REFERENCE_MAX)):
            mh.set_backend(model, backend)
            got = model.get_submodule(block_name)(x)
            got = got[0] if isinstance(got, tuple) else got
            err = float((got.float() - want.float()).norm() / want.float().norm())
            assert err < bound, (backend, err)

    # the whole model: logits against the bf16-dequantized model
    with torch.no_grad():
        mh.set_backend(model, "reference")
        kl, top1 = compare_logits(model(ids).logits, want_logits)
    assert kl < KL_MAX and top1 >= TOP1_MIN, (kl, top1)

    out = model.generate(ids[:1, :4], max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_broken_experts_fail_the_thresholds(bf16_dirs, tmp_path):
    """The logit thresholds can fail: the experts' order off by one is far outside them."""
    from transformers import AutoModelForCausalLM

    src = bf16_dirs("mixtral")
    model = mh.from_pretrained(src, scheme="fp8-channel-token", backend="reference")
    mh.save_pretrained(model, tmp_path / "fp8")
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16)
    ids = tokens()
    with torch.no_grad():
        kl, top1 = compare_logits(model(ids).logits, want(ids).logits)
        assert kl < KL_MAX and top1 >= TOP1_MIN
        for m in mh.experts_modules(model).values():
            m.w13.copy_(m.w13.roll(1, 0))
            m.w13_scale.copy_(m.w13_scale.roll(1, 0))
        kl, top1 = compare_logits(model(ids).logits, want(ids).logits)
    assert kl > 10 * KL_MAX and top1 < TOP1_MIN, (kl, top1)


def test_deepseek_fp8_block_format(bf16_dirs, tmp_path):
    """quant_method "fp8" with weight_scale_inv (DeepSeek-V3's own format) loads as stored."""
    from safetensors.torch import load_file, save_file

    src = bf16_dirs("deepseek_v3")
    ct = mh.from_pretrained(src, scheme="fp8-block128", backend="reference")
    mh.save_pretrained(ct, tmp_path / "ct")
    ds = tmp_path / "ds"
    shutil.copytree(tmp_path / "ct", ds)
    tensors = load_file(ds / "model.safetensors")
    tensors = {k.replace(".weight_scale", ".weight_scale_inv"): v for k, v in tensors.items()}
    save_file(tensors, ds / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((ds / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}
    (ds / "config.json").write_text(json.dumps(config))

    model = mh.from_pretrained(ds, backend="reference")
    a, b = mh.experts_modules(ct), mh.experts_modules(model)
    assert list(a) == list(b)
    for name in a:
        assert b[name].scheme == get_scheme("fp8-block128")
        assert torch.equal(a[name].w13.view(torch.uint8), b[name].w13.view(torch.uint8))
        assert torch.equal(a[name].w2_scale, b[name].w2_scale)
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ct(ids).logits)


def test_experts_implementation_switch(bf16_dirs, monkeypatch):
    """experts_implementation="moekit" on a plain bf16 model: transformers' own experts modules
    run through moekit.fused_moe (counted), everything else unchanged."""
    from transformers import AutoModelForCausalLM

    import moekit.hf.experts as ex

    calls = []
    real = ex.fused_moe
    monkeypatch.setattr(ex, "fused_moe", lambda *a, **k: calls.append(k.get("backend")) or real(*a, **k))
    for family in ("olmoe", "deepseek_v3"):  # bf16 and float32 routing weights
        calls.clear()
        src = bf16_dirs(family)
        base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
        moe = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, experts_implementation="moekit").eval()
        assert moe.config._experts_implementation == "moekit"
        ids = tokens()
        with torch.no_grad():
            want = base(ids).logits
            assert not calls
            got = moe(ids).logits
            assert calls  # moekit ran
            kl, top1 = compare_logits(got, want)
            assert kl < KL_MAX and top1 >= TOP1_MIN, (family, kl, top1)
            n = len(calls)
            base.set_experts_implementation("moekit")
            assert torch.equal(base(ids).logits, got) and len(calls) > n


def test_dense_routing_weights_and_shapes():
    """top_k_weights given as a dense [T, E] score matrix are gathered at top_k_index."""
    from moekit.hf.experts import moekit_experts_forward

    model = tiny_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(5, HIDDEN).bfloat16()
    ids = torch.tensor([[0, 3], [1, 2], [7, 6], [4, 5], [2, 0]])
    w = torch.rand(5, 2)
    dense = torch.zeros(5, EXPERTS).scatter(1, ids, w)
    with torch.no_grad():
        a = moekit_experts_forward(experts, x, ids, w)
        b = moekit_experts_forward(experts, x, ids, dense)
    assert torch.equal(a, b) and a.shape == x.shape


def test_patch_loaded_model_from_checkpoint(bf16_dirs, tmp_path):
    """patch_model(model, checkpoint=...) on a model transformers loaded (experts dequantized):
    the experts become the checkpoint's FP8 tensors and the bf16 copies are released."""
    from transformers import AutoModelForCausalLM

    src = bf16_dirs("qwen2_moe")
    fp8 = mh.from_pretrained(src, scheme="fp8-channel-token", backend="reference")
    mh.save_pretrained(fp8, tmp_path / "fp8")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16).eval()
    before = sum(_bytes(t) for t in model.state_dict().values())
    mh.patch_model(model, checkpoint=tmp_path / "fp8", backend="reference")
    after = sum(_bytes(t) for t in model.state_dict().values())
    layers = len(mh.experts_modules(model))
    assert before - after == layers * EXPERTS * 3 * INTER * HIDDEN * 2 - expected_expert_bytes("fp8-channel-token", layers)
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fp8(ids).logits)


def test_patch_model_quantizes_in_place_and_llama4_bf16():
    """patch_model on bf16 models: Llama-4 (transposed, weight on the input) kept bf16 through
    moekit equals transformers' own forward; quantizing it to FP8 stays within the thresholds."""
    model = tiny_model("llama4")
    ids = tokens()
    with torch.no_grad():
        want = model(ids).logits
        mh.patch_model(model, backend="torch")
        got = model(ids).logits
        assert type(model.model.layers[0].feed_forward).__name__ == "MoekitLlama4TextMoe"
        kl, top1 = compare_logits(got, want)
        assert kl < 1e-2 and top1 >= 0.9, (kl, top1)
        mh.patch_model(model, scheme="fp8-channel-token", backend="reference")
        assert mh.experts_nbytes(model) == expected_expert_bytes("fp8-channel-token", 2)
        kl, top1 = compare_logits(model(ids).logits, want)
    assert kl < KL_MAX and top1 >= TOP1_MIN, (kl, top1)


def test_triton_interpreter_one_layer(bf16_dirs):
    """The triton backend (interpreted on the CPU) runs a loaded FP8 experts module."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton runs on the CPU only under TRITON_INTERPRET=1")
    model = mh.from_pretrained(bf16_dirs("mixtral"), scheme="fp8-channel-token", backend="reference")
    m = next(iter(mh.experts_modules(model).values()))
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(0)).bfloat16()
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 6], [3, 0]])
    w = torch.rand(6, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(x, ids, w)
        m.backend = "triton"
        got = m(x, ids, w)
    # triton quantizes the intermediate per 1x128 group, reference per token (README): both
    # are FP8 roundings of the same values, a few percent apart at most
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 0.05


def test_torch_backend_on_fp8_is_logged(bf16_dirs, caplog):
    """Running FP8 experts on the `torch` backend (a dequantized bf16 copy) is never silent."""
    model = mh.from_pretrained(bf16_dirs("olmoe"), scheme="fp8-tensor-dynamic", backend="torch")
    with caplog.at_level(logging.INFO, logger="moekit.hf"), torch.no_grad():
        model(tokens())
    assert any("dequantized" in r.getMessage() for r in caplog.records)


def test_transformers_fp8_experts_cache_follows_every_tensor():
    """The MoEWeights cached on a transformers FP8 experts module was keyed without
    down_proj_scale_inv: a new down scale kept running with the old one."""
    from helpers import random_weights
    from torch import nn

    from moekit.hf.experts import _hf_weights

    w = random_weights(2, 128, 128, "fp8-block128")
    m = nn.Module()
    m.block_size, m.activation_scheme = [128, 128], "dynamic"
    for name, t in (("gate_up_proj", w.w13), ("down_proj", w.w2), ("gate_up_proj_scale_inv", w.w13_scale),
                    ("down_proj_scale_inv", w.w2_scale)):
        setattr(m, name, nn.Parameter(t, requires_grad=False))
    first = _hf_weights(m, "experts")
    assert _hf_weights(m, "experts") is first  # cached while nothing changes
    m.down_proj_scale_inv = nn.Parameter(w.w2_scale * 2, requires_grad=False)
    again = _hf_weights(m, "experts")
    assert again.w2_scale.data_ptr() == m.down_proj_scale_inv.data_ptr()
    assert torch.equal(again.w2_scale, w.w2_scale * 2)


def test_moekit_experts_load_state_dict_in_place_refreshes_prepared_state():
    """load_state_dict copies into the same buffers (same data_ptr): the cached MoEWeights is
    kept, and the torch backend's dequantized copy of the old values must not be."""
    from helpers import random_weights

    import moekit
    from moekit.hf.experts import MoekitExperts

    old, new = (random_weights(4, 128, 128, "fp8-channel-token", seed=s) for s in (1, 2))
    m = MoekitExperts(4, 128, 128)
    m.load(old)
    m.backend = "torch"
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]])
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        m(x, ids, w)
        weights = m.moe_weights()
        m.load_state_dict(new.tensors())
        assert m.moe_weights() is weights  # the same tensors, new values
        got = m(x, ids, w)
    # the same backend on the same values: bitwise; the stale copy gave the old weights' output
    assert torch.equal(got, moekit.fused_moe(x, new, w, ids, "torch"))
