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

import importlib.util
import json
import logging
import shutil
import warnings

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("compressed_tensors")

import moekit  # noqa: E402
import moekit.hf as mh  # noqa: E402
from moekit.hf.families import family_of  # noqa: E402
from moekit.spec import BLOCK, get_scheme  # noqa: E402

from test_hf_tiny import EXPERTS, HIDDEN, INTER, tiny_model  # noqa: E402

# transformers runs a `quant_method: "fp8"` checkpoint's other layers through its own FP8 kernel,
# which on a CUDA machine needs the `kernels` package (the H100 image lacks it: ImportError)
needs_transformers_fp8_kernels = pytest.mark.skipif(
    torch.cuda.is_available() and importlib.util.find_spec("kernels") is None,
    reason="transformers' FP8 layers need the `kernels` package on a CUDA machine",
)

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
        dequantize = getattr(ct, "CompressedTensorsDequantize", None)
        if dequantize is None:  # transformers' converter of this name came in a later version (the H100's lacked it)
            warnings.warn("this transformers has no CompressedTensorsDequantize: the spy sees module builds only")
            return
        convert = dequantize.convert

        def spy_convert(op, input_dict, *a, **k):
            self.dequantized += [key for key in input_dict if ".experts." in key]
            return convert(op, input_dict, *a, **k)

        monkeypatch.setattr(dequantize, "convert", spy_convert)


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


@needs_transformers_fp8_kernels
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


def test_set_backend_and_experts_nbytes_count_transformers_experts_on_moekit():
    """On a model loaded with experts_implementation="moekit", set_backend changed every experts
    module's backend but returned 0, and experts_nbytes said 0: both counted moekit's own
    modules only. transformers' experts running otherwise (eager, or Llama-4's, which its block
    calls directly) are not counted."""
    model = tiny_model("qwen3_moe")
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    assert len(experts) == 2
    assert mh.set_backend(model, "reference") == 0 and mh.experts_nbytes(model) == 0  # not on moekit yet
    model.set_experts_implementation("moekit")
    assert mh.set_backend(model, "torch") == 2
    assert {m.moekit_backend for m in experts} == {"torch"}
    assert mh.experts_nbytes(model) == sum(_bytes(m.gate_up_proj) + _bytes(m.down_proj) for m in experts)
    assert mh.experts_nbytes(model) == 2 * EXPERTS * 3 * HIDDEN * INTER * 2  # bf16
    llama4 = tiny_model("llama4")
    llama4.set_experts_implementation("moekit")
    assert mh.set_backend(llama4, "torch") == 0 and mh.experts_nbytes(llama4) == 0
    mh.patch_model(llama4)
    assert mh.set_backend(llama4, "torch") == 2 and mh.experts_nbytes(llama4) == 2 * EXPERTS * 3 * HIDDEN * INTER * 2


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


def test_triton_interpreter_one_layer(bf16_dirs, device):
    """The triton backend (interpreted on the CPU, compiled on a GPU) runs a loaded FP8 experts
    module. The model loads on the CPU: on a GPU machine the module and its inputs are moved to
    the GPU (CPU tensors there reach no Triton kernel)."""
    import moekit

    if device.type == "cpu" and not moekit.env.interpreting():
        pytest.skip("triton runs on the CPU only under TRITON_INTERPRET=1")
    model = mh.from_pretrained(bf16_dirs("mixtral"), scheme="fp8-channel-token", backend="reference")
    m = next(iter(mh.experts_modules(model).values())).to(device)
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(0)).bfloat16().to(device)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 6], [3, 0]]).to(device)
    w = torch.rand(6, 2, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        want = m(x, ids, w)
        m.backend = "triton"
        got = m(x, ids, w)
    # triton quantizes the intermediate per 1x128 group, reference per token (README): both
    # are FP8 roundings of the same values, a few percent apart at most
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 0.05


def test_torch_backend_on_fp8_is_logged(bf16_dirs, caplog, monkeypatch):
    """Running FP8 experts on the `torch` backend (a dequantized bf16 copy) is never silent: at
    info level, since only a named backend gets there (the argument or MOEKIT_BACKEND). auto
    never picks it for moekit's experts (allow_weight_copies=False): on the CPU they run
    `reference`, without the message (the README said auto's pick was logged as a warning; that
    branch could not be reached and is gone)."""
    model = mh.from_pretrained(bf16_dirs("olmoe"), scheme="fp8-tensor-dynamic", backend="torch")

    def logged() -> list[int]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="moekit.hf"), torch.no_grad():
            model(tokens())
        return [r.levelno for r in caplog.records if "dequantized" in r.getMessage()]

    assert logged() == [logging.INFO] * len(mh.experts_modules(model))
    mh.set_backend(model, "auto")
    assert logged() == []  # the message is said whenever torch is chosen, whoever chose it
    weights = next(iter(mh.experts_modules(model).values())).moe_weights()
    assert moekit.select_backend(weights.shape(2), weights.scheme, "cpu", torch.bfloat16, 64,
                                 allow_weight_copies=False).backend == "reference"
    monkeypatch.setenv("MOEKIT_BACKEND", "torch")
    assert logged() == [logging.INFO] * len(mh.experts_modules(model))


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


def test_half_keeps_fp8_experts_and_their_scales():
    """model.half() / model.to(torch.float16) cast MoekitExperts' FP8 weights to fp16 and their
    float32 scales to fp16 (MoELayer already kept them): FP8 experts now keep every dtype and
    value; bf16 experts follow the model's dtype, as transformers' own experts do."""
    model = mh.patch_model(tiny_model("qwen3_moe"), scheme="fp8-channel-token", backend="reference")
    before = {n: {k: t.clone() for k, t in m.moe_weights().tensors().items()}
              for n, m in mh.experts_modules(model).items()}
    assert model.half() is model
    model.to(torch.float16)
    for name, m in mh.experts_modules(model).items():
        for key, t in m.moe_weights().tensors().items():
            want = before[name][key]
            assert t.dtype == want.dtype, (name, key, t.dtype)
            assert torch.equal(t.view(torch.uint8) if t.dtype.itemsize == 1 else t,
                               want.view(torch.uint8) if want.dtype.itemsize == 1 else want), (name, key)
    assert next(model.lm_head.parameters()).dtype == torch.float16  # the rest of the model did change
    with torch.no_grad():
        logits = model(tokens()).logits
    assert logits.dtype == torch.float16 and bool(logits.isfinite().all())

    bf16 = mh.patch_model(tiny_model("qwen3_moe"), backend="reference").half()
    assert {m.w13.dtype for m in mh.experts_modules(bf16).values()} == {torch.float16}


def _fp8_linear(linear, block_size, activation_scheme):
    """transformers' FP8Linear (what quant_method "fp8" puts in place of a dense Linear on a GPU)
    holding `linear`'s weight quantized: FP8 weight, weight_scale_inv (a multiplier), and for
    static activations activation_scale."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    from moekit import quant

    q, s = quant.quantize_weight(linear.weight.detach().float()[None], "tensor" if block_size is None else "block")
    fp8 = FP8Linear(linear.in_features, linear.out_features, block_size=block_size, activation_scheme=activation_scheme)
    fp8.weight = torch.nn.Parameter(q[0], requires_grad=False)
    fp8.weight_scale_inv = torch.nn.Parameter(s[0].reshape(fp8.weight_scale_inv.shape), requires_grad=False)
    if activation_scheme == "static":
        fp8.activation_scale = torch.nn.Parameter(torch.tensor(0.02), requires_grad=False)
    return fp8


@pytest.mark.parametrize("scheme, block_size, activation_scheme", [
    ("fp8-block128", (128, 128), "dynamic"), ("fp8-tensor-static", None, "static")])
def test_save_gives_fp8_dense_layers_compressed_tensors_names(tmp_path, scheme, block_size, activation_scheme):
    """A model loaded from a quant_method "fp8" checkpoint on a GPU keeps dense FP8 layers
    (FP8Linear: weight_scale_inv, activation_scale); the saved compressed-tensors config makes
    loaders look for weight_scale / input_scale, so these layers reloaded without their scales."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    calibration = {"calibration": tokens(32, 1, seed=5)} if scheme == "fp8-tensor-static" else {}
    model = mh.patch_model(tiny_model("deepseek_v3"), scheme=scheme, backend="reference", **calibration)
    mlp = model.model.layers[0].mlp  # layer 0 is dense (first_k_dense_replace=1)
    mlp.gate_proj = fp8 = _fp8_linear(mlp.gate_proj, block_size, activation_scheme)
    mh.save_pretrained(model, tmp_path / "out")

    saved = load_file(tmp_path / "out" / "model.safetensors")
    key = "model.layers.0.mlp.gate_proj"
    assert not any(k.endswith(("weight_scale_inv", "activation_scale")) for k in saved)
    assert torch.equal(saved[f"{key}.weight"].view(torch.uint8), fp8.weight.view(torch.uint8))
    assert torch.equal(saved[f"{key}.weight_scale"], fp8.weight_scale_inv.reshape(saved[f"{key}.weight_scale"].shape))
    if activation_scheme == "static":
        assert torch.equal(saved[f"{key}.input_scale"], torch.tensor([0.02]))

    # transformers' compressed-tensors loader finds every tensor, the dense layer's scales included
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16, output_loading_info=True)
    # (transformers' fused bf16 experts have no use for the experts' static input scales)
    assert not info["missing_keys"] and not [k for k in info["unexpected_keys"] if ".experts." not in k], info
    layer = reloaded.get_submodule(key)
    assert torch.equal(layer.weight.view(torch.uint8), fp8.weight.view(torch.uint8))
    assert torch.equal(layer.weight_scale.float().flatten(),
                       fp8.weight_scale_inv.to(layer.weight_scale.dtype).float().flatten())
    if activation_scheme == "static":
        assert torch.equal(layer.input_scale.float().flatten(), torch.tensor([0.02]).to(layer.input_scale.dtype).float())


def test_save_refuses_fp8_dense_layers_of_another_scheme(tmp_path):
    """One compressed-tensors config group describes every Linear: dense FP8 layers whose scheme
    is not the experts' cannot be described, and are refused by name."""
    model = mh.patch_model(tiny_model("deepseek_v3"), scheme="fp8-channel-token", backend="reference")
    mlp = model.model.layers[0].mlp
    mlp.up_proj = _fp8_linear(mlp.up_proj, (128, 128), "dynamic")
    with pytest.raises(mh.UnsupportedModelError, match=r"model\.layers\.0\.mlp\.up_proj \(FP8Linear\).*scheme "
                                                       r"fp8-block128 but the experts are fp8-channel-token"):
        mh.save_pretrained(model, tmp_path / "out")


def test_save_copies_one_shard_at_a_time_to_host(tmp_path, monkeypatch):
    """save_pretrained moved every tensor to the CPU before writing the first shard (the whole
    model in host memory); now only the shard being written is: at each write, the bytes copied
    to the host so far are exactly those of the shards written so far. Same files, same tensors."""
    import safetensors.torch as st
    from safetensors.torch import load_file

    from moekit.hf import save

    model = mh.patch_model(tiny_model("qwen3_moe"), scheme="fp8-channel-token", backend="reference")
    mh.save_pretrained(model, tmp_path / "one")
    copied, writes = [], []
    host_copy, save_file = save._host_copy, st.save_file

    def spy_copy(t):
        copied.append(t.numel() * t.element_size())
        return host_copy(t)

    def spy_save(tensors, *args, **kwargs):
        writes.append((sum(copied), sum(t.numel() * t.element_size() for t in tensors.values())))
        return save_file(tensors, *args, **kwargs)

    monkeypatch.setattr(save, "_host_copy", spy_copy)
    monkeypatch.setattr(st, "save_file", spy_save)
    mh.save_pretrained(model, tmp_path / "many", max_shard_size=64 * 1024)
    assert len(writes) > 2
    written = 0
    for copied_by_then, shard_bytes in writes:
        written += shard_bytes
        assert copied_by_then == written
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-{len(writes):05d}.safetensors" for i in range(1, len(writes) + 1)]
    assert index["metadata"]["total_size"] == written
    one = load_file(tmp_path / "one" / "model.safetensors")
    many = {k: v for name in shards for k, v in load_file(tmp_path / "many" / name).items()}
    assert one.keys() == many.keys()
    for k, v in one.items():
        assert torch.equal(v.view(torch.uint8), many[k].view(torch.uint8)), k


def _fbgemm_llama4_checkpoint(folder, fp8_model):
    """`folder` (a bf16 Llama-4 checkpoint) rewritten as fbgemm_fp8 stores Llama-4's experts
    (transformers' FbgemmFp8Llama4TextExperts): fused FP8 gate_up_proj [E, H, 2N] with
    gate_up_proj_scale [E, 1, 2N], down_proj [E, N, H] with down_proj_scale [E, H, 1]."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    for name, m in mh.experts_modules(fp8_model).items():
        assert f"{name}.gate_up_proj" in tensors  # the bf16 fused experts, replaced
        tensors[f"{name}.gate_up_proj"] = m.w13.transpose(1, 2).contiguous()
        tensors[f"{name}.gate_up_proj_scale"] = m.w13_scale[:, None, :].contiguous()
        tensors[f"{name}.down_proj"] = m.w2.transpose(1, 2).contiguous()
        tensors[f"{name}.down_proj_scale"] = m.w2_scale[:, :, None].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                     "modules_to_not_convert": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))


def test_fbgemm_fp8_llama4_fused_experts(bf16_dirs, tmp_path):
    """Llama-4 fbgemm_fp8 checkpoints store the experts fused, in FP8, with *_proj_scale: read_fp8
    knew only per-expert tensors and asked for '...experts.0.gate_proj.weight'. They load as stored
    (bitwise), and a missing scale is named."""
    from safetensors.torch import load_file, save_file

    fp8 = mh.patch_model(tiny_model("llama4"), scheme="fp8-channel-token", backend="reference")
    folder = tmp_path / "fbgemm"
    shutil.copytree(bf16_dirs("llama4"), folder)
    _fbgemm_llama4_checkpoint(folder, fp8)

    # transformers' fbgemm_fp8 loader needs a GPU (fbgemm-gpu): the experts go in through patch_model
    model = mh.patch_model(tiny_model("llama4"), checkpoint=folder, backend="reference")
    want, got = mh.experts_modules(fp8), mh.experts_modules(model)
    assert list(got) == list(want) and len(got) == 2
    for name, m in got.items():
        assert m.scheme == get_scheme("fp8-channel-token")
        for key, t in want[name].moe_weights().tensors().items():
            u = getattr(m, key)
            assert u.dtype == t.dtype and torch.equal(u.view(torch.uint8), t.view(torch.uint8)), (name, key)
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fp8(ids).logits)

    key = f"{next(iter(got))}.down_proj_scale"
    tensors = load_file(folder / "model.safetensors")
    del tensors[key]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(mh.UnsupportedModelError, match=rf"checkpoint has no tensor '{key}' \(fbgemm_fp8 fused experts\)"):
        mh.patch_model(tiny_model("llama4"), checkpoint=folder)


def test_fused_experts_of_the_wrong_shape_or_dtype_are_named(bf16_dirs, tmp_path):
    """The fused tensors' checks (one helper for the bf16 and the fbgemm_fp8 layouts): a missing
    tensor, a shape and a dtype the model does not expect, each named with what was expected."""
    import re

    from safetensors.torch import load_file, save_file

    def edit(folder, fn):
        tensors = load_file(folder / "model.safetensors")
        fn(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

    def refused(folder, pattern):
        with pytest.raises(mh.UnsupportedModelError, match=pattern):
            mh.patch_model(tiny_model("llama4"), checkpoint=folder)

    bf16 = tmp_path / "bf16"
    shutil.copytree(bf16_dirs("llama4"), bf16)
    gu = min(k for k in load_file(bf16 / "model.safetensors") if k.endswith(".experts.gate_up_proj"))
    dn = gu.replace("gate_up_proj", "down_proj")
    shape = tuple(load_file(bf16 / "model.safetensors")[gu].shape)  # [E, H, 2N]
    edit(bf16, lambda t: t.update({gu: t[gu][..., :-2].contiguous()}))
    refused(bf16, rf"checkpoint tensor '{re.escape(gu)}' is torch.bfloat16 \(8, 64, {shape[2] - 2}\); the model "
                  rf"expects a float tensor of shape \(8, 64, {shape[2]}\)")
    edit(bf16, lambda t: t.pop(dn))
    refused(bf16, rf"checkpoint has no tensor '{re.escape(dn)}'")

    fp8 = mh.patch_model(tiny_model("llama4"), scheme="fp8-channel-token", backend="reference")
    fbgemm = tmp_path / "fbgemm"
    shutil.copytree(bf16_dirs("llama4"), fbgemm)
    _fbgemm_llama4_checkpoint(fbgemm, fp8)
    edit(fbgemm, lambda t: t.update({f"{gu}_scale": t[f"{gu}_scale"][:, :, :-1].contiguous()}))
    refused(fbgemm, rf"checkpoint tensor '{re.escape(gu)}_scale' is torch.float32 \(8, 1, {shape[2] - 1}\); the "
                    rf"per-channel scales of these experts are float \(8, 1, {shape[2]}\)")
    edit(fbgemm, lambda t: t.update({dn: t[dn].bfloat16()}))
    refused(fbgemm, rf"checkpoint tensor '{re.escape(dn)}' is torch.bfloat16 .*; the model expects "
                    r"torch.float8_e4m3fn")


def test_fused_fp8_experts_of_another_layout_are_named(bf16_dirs, tmp_path):
    """Fused FP8 experts other than fbgemm_fp8's Llama-4 layout: a clear error naming the layout,
    not a missing '...experts.0.gate_proj.weight'."""
    from safetensors.torch import load_file, save_file

    fp8 = mh.patch_model(tiny_model("qwen3_moe"), scheme="fp8-channel-token", backend="reference")
    folder = tmp_path / "fused"
    shutil.copytree(bf16_dirs("qwen3_moe"), folder)
    tensors = {k: v for k, v in load_file(folder / "model.safetensors").items() if ".experts." not in k}
    for name, m in mh.experts_modules(fp8).items():
        tensors.update({f"{name}.gate_up_proj": m.w13, f"{name}.gate_up_proj_scale": m.w13_scale,
                        f"{name}.down_proj": m.w2, f"{name}.down_proj_scale": m.w2_scale})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fbgemm_fp8"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(mh.UnsupportedModelError, match=r"fused FP8 experts .* are supported only in fbgemm_fp8's "
                                                       r"Llama-4 layout.*family qwen3_moe"):
        mh.patch_model(tiny_model("qwen3_moe"), checkpoint=folder)


def test_static_quantization_on_load_is_one_expert_at_a_time(monkeypatch):
    """fp8-tensor-static on load went through quantize_weights, which then converted the whole layer to
    float32 at once (README: "one expert at a time"): every weight quantization now sees one
    expert, and the result is bitwise quantize_weights' (the same scales, a13 and a2)."""
    from moekit import quant
    from moekit.hf.experts import MoekitExperts
    from moekit.hf.load import _quantize_module
    from moekit.weights import MoEWeights, quantize_weights

    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / 8).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / 11).bfloat16()
    x = torch.randn(40, HIDDEN, generator=g)
    m = MoekitExperts(EXPERTS, HIDDEN, INTER)
    m.load(MoEWeights(get_scheme("bf16"), w13, w2))
    experts_per_call = []
    real = quant.quantize_weight
    monkeypatch.setattr(quant, "quantize_weight", lambda w, granularity: experts_per_call.append(w.shape[0]) or real(w, granularity))
    _quantize_module(m, get_scheme("fp8-tensor-static"), x)
    assert experts_per_call == [1] * (2 * EXPERTS)
    monkeypatch.undo()
    want = quantize_weights(w13, w2, "fp8-tensor-static", calibration=x)
    got = m.moe_weights()
    assert got.scheme == want.scheme
    for key, t in want.tensors().items():
        u = got.tensors()[key]
        assert u.dtype == t.dtype and torch.equal(u.view(torch.uint8), t.view(torch.uint8)), key


@pytest.mark.parametrize("apply_on_input", [False, True])
def test_moekit_experts_take_an_empty_batch(apply_on_input):
    """T = 0 (an empty batch, or a rank with no tokens) gives [0, H], as fused_moe does; reshaping
    the routing to [0, -1] failed before the call."""
    from helpers import random_weights

    from moekit.hf.experts import run_experts

    w = random_weights(4, 64, 64, "bf16")
    x, ids, tw = torch.empty(0, 64, dtype=torch.bfloat16), torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2)
    out = run_experts(torch.nn.Module(), w, x, ids, tw, backend="reference", apply_on_input=apply_on_input)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


def test_dense_router_scores_are_gathered_and_bad_ids_get_moekits_message():
    """Weights [T, E] are gathered at the ids (the same output as [T, K] weights); an id out of
    range is refused by fused_moe's check, naming the range, not by torch's gather."""
    from helpers import random_weights, random_x

    import moekit
    from moekit.hf.experts import run_experts

    w, x = random_weights(4, 64, 64, "bf16"), random_x(3, 64)
    ids = torch.tensor([[2, 0], [1, 3], [3, 2]])
    dense = torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    got = run_experts(torch.nn.Module(), w, x, ids, dense, backend="reference")
    assert torch.equal(got, moekit.fused_moe(x, w, dense.gather(1, ids), ids, backend="reference"))
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\)"):
        run_experts(torch.nn.Module(), w, x, torch.tensor([[4, 0], [1, 3], [3, 2]]), dense, backend="reference")


# ------------------------------------------- saving and loading edge cases (a reviewing helper's)


def test_a_tied_lm_head_is_ignored_by_the_saved_quantization_config(tmp_path):
    """The tied lm_head was dropped as a copy of the embedding before the config's `ignore` was
    made from what remained: compressed-tensors then read lm_head as an FP8 Linear without a
    scale, and the reloaded model gave NaN logits."""
    from test_hf_tiny import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("qwen3_moe")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = mh.from_pretrained(tmp_path / "bf16", scheme="fp8-channel-token", backend="reference")
    mh.save_pretrained(model, tmp_path / "fp8")
    assert "lm_head" in json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["ignore"]
    again = mh.from_pretrained(tmp_path / "fp8", backend="reference")
    with torch.no_grad():
        assert torch.equal(again(input_ids=tokens()).logits, model(input_ids=tokens()).logits)


def _fp8_dense_checkpoint(bf16_folder, fp8_folder, out):
    """`fp8_folder` (moekit's FP8 checkpoint of the bf16 model) with its attention layers FP8 per
    channel too, as compressed-tensors checkpoints of whole models hold them."""
    from safetensors.torch import load_file, save_file

    from moekit import quant

    tensors = load_file(fp8_folder / "model.safetensors")
    config = json.loads((fp8_folder / "config.json").read_text())
    ignore = config["quantization_config"]["ignore"]
    for name in [n for n in ignore if ".self_attn." in n]:
        q, scale = quant.quantize_weight(tensors[f"{name}.weight"][None], "channel")
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = q[0], scale[0][:, None]
        ignore.remove(name)
    shutil.copytree(fp8_folder, out)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_saving_after_a_forward_keeps_dense_fp8_layers_fp8(bf16_dirs, tmp_path):
    """compressed-tensors decompresses dense FP8 layers at the first forward (weight bf16, scale
    kept, input still quantized); saved so, they were written bf16 with stale scales and listed in
    `ignore`, and reloaded they ran unquantized (logits off by 2.5). Now they go back to FP8 with
    their own scales: load, forward, save, load gives the same logits bitwise. A weight changed
    after loading cannot go back, and is refused by name."""
    from safetensors.torch import load_file

    pytest.importorskip("compressed_tensors")
    mh.save_pretrained(mh.from_pretrained(bf16_dirs("qwen3_moe"), scheme="fp8-channel-token", backend="reference"),
                       tmp_path / "experts")
    folder = _fp8_dense_checkpoint(bf16_dirs("qwen3_moe"), tmp_path / "experts", tmp_path / "dense")
    model = mh.from_pretrained(folder, backend="reference")
    with torch.no_grad():
        before = model(input_ids=tokens()).logits
    mh.save_pretrained(model, tmp_path / "after-forward")
    saved = load_file(tmp_path / "after-forward" / "model.safetensors")
    assert saved["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(saved["model.layers.0.self_attn.q_proj.weight"],
                       load_file(folder / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"])
    again = mh.from_pretrained(tmp_path / "after-forward", backend="reference")
    with torch.no_grad():
        assert torch.equal(again(input_ids=tokens()).logits, before)
    q_proj = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        q_proj.weight.mul_(1.1)  # a change after loading, more than a rounding
    with pytest.raises(mh.UnsupportedModelError, match=r"model\.layers\.0\.self_attn\.q_proj: .* changed after loading"):
        mh.save_pretrained(model, tmp_path / "changed")


def test_bf16_llama4_experts_are_saved_fused_as_transformers_reads_them(tmp_path):
    """Unquantized Llama-4 experts were saved per expert, names transformers' Llama-4 does not
    read: it loaded them as missing, newly initialized (logits off by 5). Now fused
    gate_up_proj [E, H, 2N] and down_proj [E, N, H], as Llama-4's own checkpoints."""
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama4")
    with torch.no_grad():
        want = model(input_ids=tokens()).logits
    mh.save_pretrained(mh.patch_model(model, backend="torch"), tmp_path / "bf16")
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16,
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=tokens()).logits, want)


def test_a_refused_patch_model_leaves_the_model_as_it_was(bf16_dirs, tmp_path):
    """transformers' quantized Llama-4 has per-expert layers; patch_model without checkpoint=
    swapped the block for moekit's and its experts for empty ones before refusing: the model no
    longer ran. Now it refuses first, and the model runs as before."""
    from transformers import AutoModelForCausalLM

    mh.save_pretrained(mh.from_pretrained(bf16_dirs("llama4"), scheme="fp8-channel-token", backend="reference"),
                       tmp_path / "fp8")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        before = model(input_ids=tokens()).logits
    with pytest.raises(mh.UnsupportedModelError, match="hold no weights moekit can use .* pass checkpoint="):
        mh.patch_model(model)
    assert type(model.model.layers[0].feed_forward.experts).__name__ != "MoekitExperts"
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens()).logits, before)


def test_calibration_token_ids_as_a_list_are_ids_not_text(bf16_dirs):
    """A list of ids (what a tokenizer's input_ids are) was turned into its text and tokenized:
    the scales were calibrated on other tokens. A list is now the ids themselves; anything but
    ids or a text is a TypeError."""
    from moekit.hf.load import _calibration_ids

    ids = tokens()
    assert torch.equal(_calibration_ids(ids.tolist()), ids) and torch.equal(_calibration_ids(ids[0].tolist()), ids[0])
    by_tensor = mh.from_pretrained(bf16_dirs("olmoe"), scheme="fp8-tensor-static", calibration=ids, backend="reference")
    by_list = mh.from_pretrained(bf16_dirs("olmoe"), scheme="fp8-tensor-static", calibration=ids.tolist(),
                                 backend="reference")
    for (_, a), (_, b) in zip(sorted(mh.experts_modules(by_tensor).items()), sorted(mh.experts_modules(by_list).items())):
        assert torch.equal(a.moe_weights().a13_scale, b.moe_weights().a13_scale)
    for bad in (3.5, [[1, 2], [3]], ["a", "b"], {"ids": 1}):
        with pytest.raises(TypeError, match="calibration"):
            _calibration_ids(bad)
    with pytest.raises(TypeError, match="a text needs the model folder's tokenizer"):
        mh.patch_model(tiny_model("olmoe"), scheme="fp8-tensor-static", calibration="some text")


@needs_transformers_fp8_kernels
def test_static_scheme_on_unquantized_experts_under_an_fp8_config(bf16_dirs, tmp_path, caplog):
    """An FP8 (static) config whose experts are stored bf16: scheme="fp8-tensor-static" left them
    bf16 while the warning said they were quantized. Now they are, and the hint names the scheme."""
    folder = tmp_path / "model"
    shutil.copytree(bf16_dirs("olmoe"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (folder / "config.json").write_text(json.dumps(config))
    model = mh.from_pretrained(folder, scheme="fp8-tensor-static", calibration=tokens(), backend="reference")
    assert {m.scheme.name for m in mh.experts_modules(model).values()} == {"fp8-tensor-static"}
    with caplog.at_level(logging.WARNING):
        mh.from_pretrained(folder, backend="reference")
    assert "pass scheme='fp8-tensor-static' to quantize them" in caplog.text


def test_from_pretrained_dtype_is_checked_first(bf16_dirs):
    """dtype="bfloat16" (transformers' string form) failed deep inside with a raw torch error after
    the whole model had loaded, float32 with a message naming no module. Names and "auto" are
    taken; anything else is refused before loading, saying what is accepted."""
    model = mh.from_pretrained(bf16_dirs("mixtral"), dtype="float16", backend="reference")
    assert model.dtype == torch.float16
    assert mh.from_pretrained(bf16_dirs("mixtral"), dtype="auto", backend="reference").dtype == torch.bfloat16
    for bad in (torch.float32, "float32", "half-ish"):
        with pytest.raises(ValueError, match="moekit runs the model in torch.bfloat16 or torch.float16"):
            mh.from_pretrained(bf16_dirs("mixtral"), dtype=bad)


def _as_transformers_fp8_experts(model):
    """Every experts module of a bf16 model replaced by transformers' own FP8Experts (what its FP8
    quantizer builds for quant_method "fp8" on a GPU), holding the experts quantized to
    fp8-block128 by moekit; returns {name: (FP8Experts, the same weights as MoEWeights)}."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    from moekit.hf.families import family_of_module

    made = {}
    for name, module in list(model.named_modules()):
        if family_of_module(module) is None:
            continue
        w = moekit.quantize_weights(module.gate_up_proj.detach(), module.down_proj.detach(), "fp8-block128")
        fp8 = FP8Experts(model.config, block_size=(BLOCK, BLOCK))
        for attr, t in (("gate_up_proj", w.w13), ("down_proj", w.w2), ("gate_up_proj_scale_inv", w.w13_scale),
                        ("down_proj_scale_inv", w.w2_scale)):
            assert getattr(fp8, attr).shape == t.shape, attr
            setattr(fp8, attr, torch.nn.Parameter(t, requires_grad=False))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, fp8)
        made[name] = (fp8, w)
    assert made
    return made


def _routing(tokens, experts, top_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices
    return ids, torch.rand(tokens, top_k, generator=g).softmax(dim=1)


def test_transformers_fp8_experts_run_through_moekit():
    """transformers 5.25's FP8Experts overrides _apply_gate (its clamped and soft-capped
    variants), which moekit refused as a gate of its own: experts_implementation="moekit" never ran
    on FP8 experts. Its gate is SiLU(gate) * up unless one of its knobs is set, and patch_model now
    takes these modules too (the family is the model's), keeping their FP8 tensors, no copy."""
    from moekit.hf.experts import ExpertsError, MoekitExperts, moekit_experts_forward

    model = tiny_model("qwen3_moe")
    made = _as_transformers_fp8_experts(model)
    x = torch.randn(5, HIDDEN, dtype=torch.bfloat16)
    ids, tw = _routing(5, EXPERTS, model.config.num_experts_per_tok)
    # the experts implementation: the FP8 module as it is, bitwise the reference on its tensors
    fp8, w = next(iter(made.values()))
    fp8.moekit_backend = "reference"
    want = moekit.fused_moe(x, w, tw, ids, backend="reference")
    assert torch.equal(moekit_experts_forward(fp8, x, ids, tw), want)
    # patch_model: the same weights, in moekit's module
    mh.patch_model(model, backend="reference")
    for name, (fp8, w) in made.items():
        m = model.get_submodule(name)
        assert isinstance(m, MoekitExperts) and m.scheme == get_scheme("fp8-block128")
        assert m.moe_weights().w13.data_ptr() == fp8.gate_up_proj.data_ptr()  # no copy
    first = model.get_submodule(next(iter(made)))
    assert torch.equal(first(x, ids, tw), want)
    # a clamped gate is refused, naming what is set, before any module is replaced
    model = tiny_model("qwen3_moe")
    made = _as_transformers_fp8_experts(model)
    fp8, _ = list(made.values())[-1]
    fp8.limit = 7.0
    with pytest.raises(ExpertsError, match=r"its gate is clamped or soft-capped \(limit=7\.0\)"):
        mh.patch_model(model)
    assert all(model.get_submodule(name) is fp8 for name, (fp8, _) in made.items())


def test_a_refused_experts_module_leaves_the_model_as_it_was():
    """patch_model replaced experts modules one at a time: one refused at the last layer left the
    layers before it replaced. Every module is now checked before the first is replaced."""
    from moekit.hf.experts import ExpertsError
    from moekit.hf.families import family_of_module

    model = tiny_model("qwen3_moe")
    originals = {name: m for name, m in model.named_modules() if family_of_module(m) is not None}
    assert len(originals) >= 2
    list(originals.values())[-1].act_fn = torch.nn.GELU()
    with pytest.raises(ExpertsError, match="its activation is GELU, not SiLU"):
        mh.patch_model(model)
    assert all(model.get_submodule(name) is m for name, m in originals.items())


def test_from_pretrained_reads_torch_dtype(bf16_dirs, monkeypatch):
    """torch_dtype= (transformers' former name of dtype, which it still honours) was passed on to
    transformers next to moekit's own dtype=bfloat16 and dropped: a float16 request gave bf16."""
    import moekit.hf.load as load

    model = mh.from_pretrained(bf16_dirs("qwen3_moe"), torch_dtype=torch.float16, backend="reference")
    assert model.dtype == torch.float16
    assert {m.w13.dtype for m in mh.experts_modules(model).values()} == {torch.float16}
    assert mh.from_pretrained(bf16_dirs("qwen3_moe"), backend="reference").dtype == torch.bfloat16  # the default
    monkeypatch.setattr(load, "_model_class", lambda config: pytest.fail("loaded before refusing"))
    with pytest.raises(ValueError, match=r"^torch_dtype=torch\.float32: moekit runs the model in torch\.bfloat16 or "
                                         r"torch\.float16"):
        mh.from_pretrained(bf16_dirs("qwen3_moe"), torch_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^dtype= and torch_dtype= both given"):
        mh.from_pretrained(bf16_dirs("qwen3_moe"), dtype=torch.bfloat16, torch_dtype=torch.float16)


def test_float_keeps_bf16_experts_and_runs_float32_activations():
    """patch_model(model) then model.float(): the bf16 experts were cast to float32, which moekit's
    weights refuse, and the first forward failed 30 frames deep naming MoEWeights.w13. They now
    stay bf16 (as MoELayer's do; FP8 experts keep every dtype) and run the float32 activations in
    float32: transformers' float32 model computes the same products of the same bf16 values."""
    want_model = tiny_model("mixtral").float()
    model = mh.patch_model(tiny_model("mixtral"), backend="reference")
    assert model.float() is model and model.dtype == torch.float32
    assert {m.w13.dtype for m in mh.experts_modules(model).values()} == {torch.bfloat16}
    ids = tokens()
    with torch.no_grad():
        got, want = model(ids).logits, want_model(ids).logits
    assert got.dtype == torch.float32
    # float32 sums of the same products in another order: a few float32 ulps of the logits
    assert float((got - want).norm() / want.norm()) < 1e-5
    model.half()  # to fp16 they follow, as before
    assert {m.w13.dtype for m in mh.experts_modules(model).values()} == {torch.float16}


def test_an_ignore_entry_naming_one_layers_experts_is_that_layers_only(tmp_path_factory, tmp_path, caplog):
    """compressed-tensors matches an ignore entry (not "re:") to one module's name. An ignore list
    naming layer 0's experts one by one (as llm-compressor writes them), beside layer 0's experts
    stored bf16, made moekit read every layer's experts as bf16 and refuse layer 1's FP8 ones with
    "the config has no FP8 quantization_config". Names and a regex of the same modules now load
    alike: the named layer as stored (bf16), the other FP8, as transformers loads the folder."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from test_hf_tiny import fp8_checkpoint

    fp8, bf16 = fp8_checkpoint(tmp_path_factory, "qwen3_moe")
    stored = {"fp8": load_file(fp8 / "model.safetensors"), "bf16": load_file(bf16 / "model.safetensors")}

    def folder(name, layer, ignore, experts_stored):
        out = tmp_path / name
        shutil.copytree(fp8, out)
        prefix = f"model.layers.{layer}.mlp.experts."
        tensors = {k: v for k, v in stored["fp8"].items() if not k.startswith(prefix)}
        tensors.update({k: v for k, v in stored[experts_stored].items() if k.startswith(prefix)})
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"]["ignore"] += ignore
        (out / "config.json").write_text(json.dumps(config))
        return out

    ids = tokens()
    for layer in (0, 1):
        names = [f"model.layers.{layer}.mlp.experts.{e}.{p}" for e in range(EXPERTS)
                 for p in ("gate_proj", "up_proj", "down_proj")]
        for form, ignore in (("names", names), ("regex", [rf"re:model[.]layers[.]{layer}[.]mlp[.]experts[.].*"])):
            out = folder(f"{form}{layer}", layer, ignore, "bf16")
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="moekit.hf"):
                model = mh.from_pretrained(out, backend="reference")
            assert not caplog.records, [r.getMessage() for r in caplog.records]  # bf16 where the config says so
            schemes = {name: m.scheme.name for name, m in mh.experts_modules(model).items()}
            assert schemes == {f"model.layers.{i}.mlp.experts": "bf16" if i == layer else "fp8-channel-token"
                               for i in (0, 1)}, (form, layer)
            with torch.no_grad():
                kl, top1 = compare_logits(model(ids).logits,
                                          AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)(ids).logits)
            assert kl < KL_MAX and top1 >= TOP1_MIN, (form, layer, kl, top1)
    # experts named by the ignore list but stored FP8: the message says what the config says of them
    layer0 = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(EXPERTS) for p in ("gate_proj", "up_proj", "down_proj")]
    out = folder("named_but_fp8", 0, layer0, "fp8")
    with pytest.raises(mh.UnsupportedModelError, match=(
            r"^model\.layers\.0\.mlp\.experts: 'model\.layers\.0\.mlp\.experts' holds FP8 expert weights but the "
            r"config's quantization_config leaves them unquantized \(its ignore list names them")):
        mh.from_pretrained(out, backend="reference")


def test_experts_whose_activation_is_the_silu_function():
    """LFM2-MoE's experts hold act_fn = torch.nn.functional.silu (a function, not a module) and
    compute SiLU(gate) * up as moekit does: refused under experts_implementation="moekit" as "its
    activation is function, not SiLU". They run, giving transformers' own output."""
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.lfm2_moe.modeling_lfm2_moe")
    from moekit.hf.experts import moekit_experts_forward

    config = transformers.Lfm2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                        num_experts_per_tok=2)
    experts = modeling.Lfm2MoeExperts(config).bfloat16()
    assert experts.act_fn is torch.nn.functional.silu
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.1)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.1)
    x = torch.randn(16, HIDDEN, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:2] for _ in range(16)])
    w = torch.rand(16, 2, generator=g)
    experts.moekit_backend = "reference"
    with torch.no_grad():
        got = moekit_experts_forward(experts, x, ids, w)
        want = experts(x, ids, w)  # transformers' eager forward
    # bf16 math on both sides, summed in another order: LAYER_TORCH_MAX is one layer's bf16 gap
    assert float((got.float() - want.float()).norm() / want.float().norm()) < LAYER_TORCH_MAX


def test_an_ignore_list_naming_every_expert_leaves_scheme_free(tmp_path_factory, tmp_path):
    """compressed-tensors writes `ignore` as the names of the unquantized Linear modules: a
    checkpoint whose experts are all stored bf16 names every expert projection one by one. The
    model-level reading of the config (sampled names at layer 93 / expert 255) took that for FP8,
    and from_pretrained(scheme="fp8-tensor-dynamic") was refused with "the checkpoint is
    fp8-channel-token". The scheme is now decided from each module's own names: all bf16, so
    scheme= quantizes them (from_pretrained, patch_model with the checkpoint, eval's --scheme);
    where one layer stays FP8, a scheme= other than its own is refused naming that layer."""
    from safetensors.torch import load_file, save_file

    from moekit.hf.eval import _check_scheme
    from test_hf_tiny import fp8_checkpoint

    fp8, bf16 = fp8_checkpoint(tmp_path_factory, "qwen3_moe")
    stored = {"fp8": load_file(fp8 / "model.safetensors"), "bf16": load_file(bf16 / "model.safetensors")}
    projections = ("gate_proj", "up_proj", "down_proj")

    def folder(name, layers):
        """The FP8 checkpoint with `layers`' experts stored bf16 and named in `ignore`."""
        out = tmp_path / name
        shutil.copytree(fp8, out)
        prefixes = tuple(f"model.layers.{i}.mlp.experts." for i in layers)
        tensors = {k: v for k, v in stored["fp8"].items() if not k.startswith(prefixes)}
        tensors.update({k: v for k, v in stored["bf16"].items() if k.startswith(prefixes)})
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"]["ignore"] += [f"{p}{e}.{proj}" for p in prefixes for e in range(EXPERTS)
                                                    for proj in projections]
        (out / "config.json").write_text(json.dumps(config))
        return out

    layers = json.loads((fp8 / "config.json").read_text())["num_hidden_layers"]
    every = folder("every", range(layers))
    for scheme in ("fp8-tensor-dynamic", "fp8-block128"):
        model = mh.from_pretrained(every, scheme=scheme, backend="reference")
        assert {m.scheme.name for m in mh.experts_modules(model).values()} == {scheme}
        assert _check_scheme(scheme, every).name == scheme
    model = mh.patch_model(tiny_model("qwen3_moe"), scheme="fp8-tensor-dynamic", backend="reference",
                           checkpoint=every)
    assert {m.scheme.name for m in mh.experts_modules(model).values()} == {"fp8-tensor-dynamic"}

    # layer 0 bf16, the others FP8 as stored: their own scheme quantizes layer 0 to it; another is refused
    some = folder("some", [0])
    model = mh.from_pretrained(some, scheme="fp8-channel-token", backend="reference")
    assert {m.scheme.name for m in mh.experts_modules(model).values()} == {"fp8-channel-token"}
    with pytest.raises(mh.UnsupportedModelError, match=r"the checkpoint's experts model\.layers\.1\.mlp\.experts "
                                                        r"are fp8-channel-token; moekit loads FP8 experts as stored"):
        mh.from_pretrained(some, scheme="fp8-tensor-dynamic", backend="reference")


def test_a_tensor_assigned_to_moekit_experts_weights_becomes_its_buffer():
    """MoekitExperts, as MoELayer (FollowsWeights): a tensor assigned to the weights moe_weights()
    gives split the module: forward ran the new tensor, state_dict() kept the old buffer, and a
    later load_state_dict wrote into buffers forward no longer read. A copy follows its own."""
    import copy

    model = mh.patch_model(tiny_model("qwen3_moe"), backend="reference")
    m = next(iter(mh.experts_modules(model).values()))
    w = m.moe_weights()
    g = torch.Generator().manual_seed(3)
    new = (torch.randn(w.w13.shape, generator=g) * 0.05).to(w.w13.dtype)
    x = torch.randn(3, w.hidden, generator=g).to(w.w13.dtype)
    ids, tw = torch.tensor([[0, 1]] * 3), torch.full((3, 2), 0.5, dtype=x.dtype)

    def want(w13):
        return moekit.fused_moe(x, moekit.MoEWeights(w.scheme, w13, w.w2), tw, ids, "reference")

    w.w13 = new
    assert m.state_dict(keep_vars=True)["w13"] is new and m.moe_weights() is w  # the same weights run on
    assert torch.equal(m(x, ids, tw), want(new))
    m.to("cpu")
    assert m.moe_weights().w13 is new
    zeros = {k: torch.zeros_like(v) if k == "w13" else v for k, v in m.state_dict().items()}
    m.load_state_dict(zeros)
    assert torch.equal(m(x, ids, tw), want(zeros["w13"]))
    twin = copy.deepcopy(m)
    twin.moe_weights().w13 = new.clone()
    assert twin.state_dict(keep_vars=True)["w13"] is twin.moe_weights().w13
    assert torch.equal(twin(x, ids, tw), want(new)) and torch.equal(m(x, ids, tw), want(zeros["w13"]))


def test_from_pretrained_works_out_each_modules_scheme_once(tmp_path_factory, monkeypatch):
    """from_pretrained reads each experts module's scheme from the checkpoint's expert names before
    building the model (to refuse a scheme= it cannot honour); fill_from_checkpoint then read them
    all again. It now takes them as worked out: one reading per module, the same schemes."""
    from moekit.hf import load
    from test_hf_tiny import fp8_checkpoint

    fp8, _ = fp8_checkpoint(tmp_path_factory, "qwen3_moe")
    real = load._module_scheme
    read = []
    monkeypatch.setattr(load, "_module_scheme",
                        lambda raw, folder, prefix, *a: read.append(prefix) or real(raw, folder, prefix, *a))
    model = mh.from_pretrained(fp8, backend="reference")
    modules = mh.experts_modules(model)
    assert sorted(read) == sorted(modules), read  # each module once (its prefix is its name here)
    assert {m.scheme.name for m in modules.values()} == {"fp8-channel-token"}
