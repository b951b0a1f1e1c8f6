"""MoEWeights' layout and dtype rules, and backends' prepared state after in-place writes.

- Layout: the triton kernels take only the outer strides of w13 / w2 (and of the scales) and
  assume the last dimension contiguous; cutlass used to copy what was not contiguous. Tensors
  that are not contiguous are refused by MoEWeights itself, naming the tensor and its strides.
- dtype: unquantized weights meet x of their own dtype (or float32 x, computed in float32).
- Prepared state (torch's dequantized copy, cutlass's expanded per-tensor scales) follows the
  weights' values: an in-place write (copy_, mul_, load_state_dict) makes it be rebuilt.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import random_routing, random_weights, random_x, rel_l2

import moekit
from moekit.backends import cutlass
from moekit.backends.torch_backend import TorchBackend
from moekit.select import select_backend
from moekit.spec import SCHEMES

E, H, N, K, M = 4, 64, 32, 2, 8


def _bf16_experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * N, H, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, N, generator=g) / N**0.5).bfloat16()
    return w13, w2


# ------------------------------------------------------------------------------------ layout


def test_transposed_views_are_refused_with_tensor_and_strides():
    """The reviewer's case: experts stored [E, H, 2N] / [E, N, H] passed as transposed views ran
    on the triton backend with a relative error of 1.3 (any layout but the contiguous one read
    the wrong elements). Now MoEWeights refuses it, naming the tensor, its strides and the fix."""
    w13, w2 = _bf16_experts()
    gu, dn = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()  # [E, H, 2N], [E, N, H]
    with pytest.raises(ValueError, match=r"MoEWeights\.w13 is not contiguous: shape \(4, 64, 64\) with strides "
                                         r"\(4096, 1, 64\), expected strides \(4096, 64, 1\).*w13\.contiguous\(\)"):
        moekit.MoEWeights("bf16", gu.transpose(1, 2), dn.transpose(1, 2))
    with pytest.raises(ValueError, match=r"MoEWeights\.w2 is not contiguous"):
        moekit.MoEWeights("bf16", w13, dn.transpose(1, 2))
    # rows of a larger tensor (last dimension contiguous, not the whole): refused too, so that
    # no backend copies the weights behind the caller's back (cutlass did)
    wide = torch.cat([w13, w13], dim=1)
    with pytest.raises(ValueError, match=r"MoEWeights\.w13 is not contiguous"):
        moekit.MoEWeights("bf16", wide[:, : 2 * N], w2)


def test_scales_that_are_not_contiguous_are_refused():
    w = random_weights(E, 128, 128, "fp8-channel-token")
    scale = w.w13_scale.t().contiguous().t()  # [E, 2N] with swapped strides
    assert not scale.is_contiguous()
    with pytest.raises(ValueError, match=r"MoEWeights\.w13_scale is not contiguous"):
        moekit.MoEWeights.from_fp8("fp8-channel-token", w.w13, w.w2, scale, w.w2_scale)


def test_contiguous_copy_of_a_transposed_checkpoint_runs_right_on_triton():
    """What the error message asks for gives the right result on the backend that was wrong."""
    w13, w2 = _bf16_experts()
    gu, dn = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    w = moekit.MoEWeights("bf16", gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous())
    tw, ids = random_routing(M, E, K)
    x = random_x(M, H)
    ref = moekit.fused_moe(x, w, tw, ids, "reference")
    if select_backend(w.shape(K), w.scheme, x.device, x.dtype, M).refused.get("triton"):
        pytest.skip("triton cannot run on these CPU tensors without TRITON_INTERPRET=1")
    out = moekit.fused_moe(x, w, tw, ids, "triton")
    # bf16 problem: triton rounds GEMM1's output, the intermediate and each pair's output to bf16
    # (2**-8 relative each) where reference keeps float32; three such roundings stay well under
    # 1e-2 relative L2. The transposed-view bug gave 1.25.
    assert rel_l2(out, ref) < 1e-2


# -------------------------------------------------------------------------------------- dtype


def test_unquantized_weights_of_another_half_dtype_are_refused():
    """bf16 x on fp16 weights: before, triton's supports() accepted it (the GPU kernel's dot takes
    one dtype) and torch silently kept a cast copy while copies_weights said False."""
    w13, w2 = _bf16_experts()
    w = moekit.MoEWeights("fp16", w13.half(), w2.half())
    tw, ids = random_routing(M, E, K)
    x = random_x(M, H)  # bf16
    for backend in ("torch", "reference", "auto"):
        with pytest.raises(ValueError, match="x has dtype torch.bfloat16 but the unquantized weights "
                                             r"\(scheme bf16\) are torch.float16"):
            moekit.fused_moe(x, w, tw, ids, backend)
    assert w.prepared == {}  # nothing was cast


def test_float32_activations_on_bf16_weights_are_a_copy_a_layer_avoids():
    """float32 x stays allowed (computed in float32), and the torch backend's float32 cast of
    the weights is now reported by copies_weights, so a MoELayer's auto passes over it."""
    w13, w2 = _bf16_experts()
    w = moekit.MoEWeights("bf16", w13, w2)
    bf16 = moekit.get_scheme("bf16")
    assert TorchBackend().copies_weights(bf16, torch.float32)
    assert not TorchBackend().copies_weights(bf16, torch.bfloat16)
    tw, ids = random_routing(M, E, K)
    x = random_x(M, H, dtype=torch.float32)
    layer = moekit.MoELayer(w)
    out = layer(x, tw, ids)
    assert out.dtype == torch.float32 and "torch" not in w.prepared
    choice = select_backend(w.shape(K), bf16, x.device, torch.float32, M, allow_weight_copies=False)
    assert choice.backend != "torch" and "torch" in choice.avoided


# ------------------------------------------------------------------------------ prepared state


def test_replaced_weights_keep_their_own_derived_state():
    """dataclasses.replace(weights, w13=...) (what MoEWeights.__setattr__ recommends for several
    tensors at once) passed the `prepared` / `_stamps` dicts on: old and new weights shared them,
    and each call of one rebuilt (and freed) the other's dequantized copy."""
    import dataclasses

    w = random_weights(E, 128, 128, "fp8-channel-token", seed=1)
    new = random_weights(E, 128, 128, "fp8-channel-token", seed=2)
    tw, ids = random_routing(M, E, K)
    x = random_x(M, 128)
    moekit.fused_moe(x, w, tw, ids, "torch")
    copy = w.prepared["torch"][x.dtype][0]
    r = dataclasses.replace(w, w13=new.w13.clone(), w13_scale=new.w13_scale.clone())
    assert r.prepared == {} and r._stamps == {}  # fresh: nothing derived from w's tensors
    mixed = moekit.MoEWeights(w.scheme, r.w13, w.w2, r.w13_scale, w.w2_scale)
    for _ in range(2):  # alternating calls: each keeps its own copy, each computing its own weights
        assert torch.equal(moekit.fused_moe(x, r, tw, ids, "torch"), moekit.fused_moe(x, mixed, tw, ids, "torch"))
        out = moekit.fused_moe(x, w, tw, ids, "torch")
        assert w.prepared["torch"][x.dtype][0] is copy
    assert torch.equal(out, moekit.fused_moe(x, moekit.MoEWeights(w.scheme, **w.tensors()), tw, ids, "torch"))
    assert r.prepared["torch"][x.dtype][0] is not copy


def test_torch_backend_sees_weights_written_in_place():
    """The torch backend's dequantized copy was kept after the FP8 weights changed in place
    (a load_state_dict into the same storage): the next call computed with the old weights."""
    w = random_weights(E, 128, 128, "fp8-channel-token", seed=1)
    new = random_weights(E, 128, 128, "fp8-channel-token", seed=2)
    tw, ids = random_routing(M, E, K)
    x = random_x(M, 128)
    moekit.fused_moe(x, w, tw, ids, "torch")  # builds the copy of the old values
    copy = w.prepared["torch"][x.dtype][0]
    for name, t in new.tensors().items():
        getattr(w, name).copy_(t)
    # the same backend on the same values through a fresh MoEWeights: the same computation,
    # bitwise the same result; the stale copy gives the old weights' output (rel_l2 ~ 1.4)
    want = moekit.fused_moe(x, new, tw, ids, "torch")
    assert torch.equal(moekit.fused_moe(x, w, tw, ids, "torch"), want)
    # written again into the same memory: a CUDA graph captured with the old copy reads the new
    # values, and never memory the copy's replacement would have freed
    assert w.prepared["torch"][x.dtype][0] is copy
    # a write through a view of one tensor counts too (views share the version counter)
    w.w2_scale[0].mul_(2)
    twice = moekit.MoEWeights.from_fp8("fp8-channel-token", new.w13, new.w2, new.w13_scale, w.w2_scale.clone())
    assert torch.equal(moekit.fused_moe(x, w, tw, ids, "torch"), moekit.fused_moe(x, twice, tw, ids, "torch"))


def test_cutlass_expanded_scales_follow_the_scales():
    """cutlass expands per-tensor scales to per-column ones once; a scale written in place must
    be expanded again (prepare() runs on the CPU: it only builds views and the expansion)."""
    w = random_weights(E, 128, 128, "fp8-tensor-dynamic")
    p = cutlass.prepare(w)
    assert p is cutlass.prepare(w)  # built once while nothing changes
    assert p.w13_t.data_ptr() == w.w13.data_ptr()  # a view of the weights, no copy
    expanded = p.w13_scale
    w.w13_scale.mul_(3)
    fresh = cutlass.prepare(w)
    assert torch.equal(fresh.w13_scale, w.w13_scale[:, None].expand(E, 256))
    assert fresh.w13_scale is expanded  # written again in place (graphs captured with it stay valid)
    # a scale tensor replaced by another one (new storage) is prepared afresh
    w.w2_scale = w.w2_scale.clone() * 2
    again = cutlass.prepare(w)
    assert again is not p and torch.equal(again.w2_scale, w.w2_scale[:, None].expand(E, 128))


def test_layer_in_place_write_reaches_the_backend():
    """MoELayer dropped its backends' state on load_state_dict only: an in-place write to a
    buffer (layer.w13.copy_(...)) kept the torch backend's stale copy."""
    w = random_weights(E, 128, 128, "fp8-channel-token", seed=1)
    new = random_weights(E, 128, 128, "fp8-channel-token", seed=2)
    layer = moekit.MoELayer(w, backend="torch")
    tw, ids = random_routing(M, E, K)
    x = random_x(M, 128)
    layer(x, tw, ids)
    with torch.no_grad():
        for name, t in new.tensors().items():
            getattr(layer, name).copy_(t)
    assert torch.equal(layer(x, tw, ids), moekit.fused_moe(x, new, tw, ids, "torch"))


def test_quantizing_a_transposed_view_gives_contiguous_fp8_weights():
    """quantize_weights makes new tensors anyway: from a transposed view it used to make FP8
    tensors with the view's strides (wrong on triton); now the same tensors as from a copy."""
    g = torch.Generator().manual_seed(3)
    gu, dn = torch.randn(E, H, 2 * N, generator=g), torch.randn(E, N, H, generator=g)
    views = moekit.quantize_weights(gu.transpose(1, 2), dn.transpose(1, 2), "fp8-channel-token")
    copies = moekit.quantize_weights(gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous(),
                                     "fp8-channel-token")
    for name, t in copies.tensors().items():
        got = getattr(views, name)
        assert got.is_contiguous() and torch.equal(got.view(torch.uint8) if got.dtype != torch.float32 else got,
                                                   t.view(torch.uint8) if t.dtype != torch.float32 else t), name



@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quantize_weights_one_expert_at_a_time_is_bitwise_the_whole_layer(scheme, monkeypatch):
    """quantize_weights converted the whole layer to float32 at once (several GB for 128 experts):
    now every weight quantization sees one expert, and every tensor is bitwise what the whole-layer
    computation (quant.quantize_weight on [E, R, C]) gave; static scales as given or measured."""
    from moekit import quant
    from moekit.weights import _calibrate

    E_, H_, N_ = 3, 200, 128  # H: partial 128-blocks
    g = torch.Generator().manual_seed(5)
    w13 = torch.randn(E_, 2 * N_, H_, generator=g) / H_**0.5  # as helpers.random_weights makes them
    w2 = torch.randn(E_, H_, N_, generator=g) / N_**0.5
    w13[1] *= 40  # experts of different ranges: their scales must stay their own
    s = SCHEMES[scheme]
    if not s.is_fp8:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    calibration = torch.randn(16, H_, generator=g)
    experts_per_call = []
    real = quant.quantize_weight
    monkeypatch.setattr(quant, "quantize_weight",
                        lambda w, granularity: experts_per_call.append(w.shape[0]) or real(w, granularity))
    got = moekit.quantize_weights(w13, w2, scheme, **({"calibration": calibration} if s.static_activation else {}))
    monkeypatch.undo()
    if not s.is_fp8:
        assert experts_per_call == [] and got.w13 is w13 and got.w2 is w2
        return
    assert experts_per_call == [1] * (2 * E_)
    want = dict(zip(("w13", "w13_scale"), quant.quantize_weight(w13, s.weight)))
    want.update(zip(("w2", "w2_scale"), quant.quantize_weight(w2, s.weight)))
    if s.static_activation:
        want["a13_scale"], want["a2_scale"] = _calibrate(w13, w2, calibration)
    assert got.tensors().keys() == want.keys()
    for name, t in want.items():
        u = getattr(got, name)
        assert u.dtype == t.dtype and u.shape == t.shape, name
        assert torch.equal(u.view(torch.uint8), t.view(torch.uint8)), name  # bitwise, NaN or not
    if s.static_activation:  # the scales given rather than measured
        given = moekit.quantize_weights(w13, w2, scheme, input_scales=(0.5, torch.tensor(0.25)))
        assert torch.equal(given.w13.view(torch.uint8), want["w13"].view(torch.uint8))
        assert given.a13_scale.tolist() == [0.5] and given.a2_scale.tolist() == [0.25]


def test_quantize_weights_refuses_mismatched_layers():
    """One expert at a time indexes both tensors by expert: shapes that do not make one layer are
    refused before any is quantized."""
    w13, w2 = torch.randn(2, 64, 32), torch.randn(2, 32, 32)
    for a, b in ((w13, w2[:1]), (w13, w2[:, :16]), (w13[:, :63], w2), (w13[0], w2[0])):
        with pytest.raises(ValueError, match=r"quantize_weights takes w13 \[E, 2N, H\] and w2 \[E, H, N\], got"):
            moekit.quantize_weights(a, b, "fp8-channel-token")
    with pytest.raises(ValueError, match="multiple of 128"):
        moekit.quantize_weights(w13, w2, "fp8-block128")


# ------------------------------------------------- a reviewing helper's findings (this session)


def _torch_state_ptrs(weights):
    from moekit.layer import _tensors_in

    return [t.data_ptr() for t in _tensors_in(weights.prepared["torch"])]


def test_layer_keeps_derived_state_in_place_through_load_state_dict_and_half():
    """MoELayer rebuilt its MoEWeights after load_state_dict() and .half() and dropped the old
    one's derived state: a new dequantized copy (cutlass: new expanded scales) in new memory,
    the old freed under a CUDA graph captured with it. The state now carries over: same memory,
    refreshed to the new values."""
    w = random_weights(E, H, N, "fp8-tensor-dynamic", seed=3)
    layer = moekit.MoELayer(w, backend="torch")
    tw, ids = random_routing(M, E, K)
    x = random_x(M, H)
    layer(x, tw, ids)
    ptrs = _torch_state_ptrs(layer.weights)
    new = random_weights(E, H, N, "fp8-tensor-dynamic", seed=4)
    layer.load_state_dict(new.tensors())
    out = layer(x, tw, ids)
    assert _torch_state_ptrs(layer.weights) == ptrs
    assert torch.equal(out, moekit.fused_moe(x, new, tw, ids, backend="torch"))
    layer.half()  # FP8 weights and float32 scales stay where they are (x's dtype is the activations')
    layer(x, tw, ids)
    assert _torch_state_ptrs(layer.weights) == ptrs


def test_inference_mode_weights_refresh_after_invalidate():
    """Tensors made under inference_mode keep no version counter, so an in-place write (an RL
    weight sync) left the torch backend computing with the old weights. invalidate() refreshes
    the state in place; and state built inside inference_mode is refreshed outside it too (it
    was an inference tensor, which cannot be written there)."""
    tw, ids = random_routing(M, E, K)
    x = random_x(M, H)
    with torch.inference_mode():
        w = random_weights(E, H, N, "fp8-channel-token", seed=5)
        moekit.fused_moe(x, w, tw, ids, backend="torch")
        ptrs = _torch_state_ptrs(w)
        new = random_weights(E, H, N, "fp8-channel-token", seed=6)
        for name, t in new.tensors().items():
            getattr(w, name).copy_(t)
        w.invalidate()
        out = moekit.fused_moe(x, w, tw, ids, backend="torch")
        assert torch.equal(out, moekit.fused_moe(x, new, tw, ids, backend="torch"))
        assert _torch_state_ptrs(w) == ptrs
    plain = random_weights(E, H, N, "fp8-channel-token", seed=5)
    with torch.inference_mode():
        moekit.fused_moe(x, plain, tw, ids, backend="torch")  # state built in inference mode
    plain.w13.copy_(new.w13)
    plain.w13_scale.copy_(new.w13_scale)
    plain.w2.copy_(new.w2)
    plain.w2_scale.copy_(new.w2_scale)
    assert torch.equal(moekit.fused_moe(x, plain, tw, ids, backend="torch"),
                       moekit.fused_moe(x, new, tw, ids, backend="torch"))


def test_a_scale_that_requires_grad_warns_and_runs():
    """Only x, the routing weights, w13 and w2 were looked at: a scale that required grad (an
    nn.Parameter) reached torch.mm(out=...) and raised instead of the documented warning."""
    w = random_weights(E, H, N, "fp8-channel-token", seed=7)
    tw, ids = random_routing(M, E, K)
    x = random_x(M, H)
    want = moekit.fused_moe(x, w, tw, ids, backend="torch")
    w.w13_scale.requires_grad_()
    with pytest.warns(UserWarning, match="inference only"):
        got = moekit.fused_moe(x, w, tw, ids, backend="torch")
    assert torch.equal(got, want)


def test_a_tensor_replaced_after_construction_is_validated():
    """Validation ran in the constructor only: a non-contiguous w13 assigned afterwards gave the
    triton backend garbage (rel L2 1.3). Now refused as the constructor refuses it, the old
    tensor kept."""
    w = random_weights(E, H, N, "fp8-channel-token", seed=8)
    old = w.w13
    with pytest.raises(ValueError, match="w13 is not contiguous"):
        w.w13 = w.w13.transpose(1, 2).contiguous().transpose(1, 2)
    assert w.w13 is old
    with pytest.raises(ValueError, match="w2_scale"):
        w.w2_scale = torch.ones(E, H + 1)
    doubled = w.w2_scale * 2
    w.w2_scale = doubled  # a valid replacement is taken
    assert w.w2_scale is doubled


def test_static_activation_scales_must_be_positive_and_finite():
    """from_fp8 took a13_scale = 0 (every output silently zero) or NaN, which quantize_weights
    refused."""
    w = random_weights(E, H, N, "fp8-tensor-static", seed=9)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="MoEWeights.a13_scale must be positive and finite"):
            moekit.MoEWeights.from_fp8("fp8-tensor-static", w.w13, w.w2, w.w13_scale, w.w2_scale,
                                       torch.tensor([bad]), w.a2_scale)


def test_from_fp8_takes_0d_static_activation_scales():
    """from_fp8 refused a 0-d input_scale ("a13_scale has shape (); expected (1,)"), which older
    checkpoints store and quantize_weights(input_scales=...) takes."""
    w = random_weights(E, H, N, "fp8-tensor-static", seed=9)
    got = moekit.MoEWeights.from_fp8("fp8-tensor-static", w.w13, w.w2, w.w13_scale, w.w2_scale,
                                     w.a13_scale[0].clone(), w.a2_scale[0].clone())
    assert got.a13_scale.shape == (1,) and torch.equal(got.a13_scale, w.a13_scale)
    assert torch.equal(got.a2_scale, w.a2_scale)
    with pytest.raises(ValueError, match=r"MoEWeights.a13_scale has shape \(2,\); expected \(1,\)"):
        moekit.MoEWeights.from_fp8("fp8-tensor-static", w.w13, w.w2, w.w13_scale, w.w2_scale,
                                   w.a13_scale.repeat(2), w.a2_scale)
    with pytest.raises(ValueError, match="MoEWeights.a2_scale must be positive and finite, got 0.0"):
        moekit.MoEWeights.from_fp8("fp8-tensor-static", w.w13, w.w2, w.w13_scale, w.w2_scale,
                                   w.a13_scale, torch.tensor(0.0))


def test_quantize_weights_to_the_unquantized_scheme_casts_float32_as_fp8_schemes_quantize_it():
    """quantize_weights(float32, float32, "bf16") failed ("w13 has dtype torch.float32") where
    every FP8 scheme takes float32 weights. Float32 now becomes the dtype the name says; a half
    is kept as it is (the scheme serves both), and MoEWeights says how to get there itself."""
    w13, w2 = _bf16_experts()
    got = moekit.quantize_weights(w13.float(), w2.float(), "bf16")
    assert got.w13.dtype == torch.bfloat16 and torch.equal(got.w13, w13) and torch.equal(got.w2, w2)
    half = moekit.quantize_weights(w13.float().transpose(1, 2).contiguous().transpose(1, 2), w2.float(), "fp16")
    assert half.w13.dtype == half.w2.dtype == torch.float16 and half.w13.is_contiguous()
    assert moekit.quantize_weights(w13.half(), w2.half(), "bf16").w13.dtype == torch.float16
    with pytest.raises(ValueError, match=r"MoEWeights.w13 has dtype torch.float32; expected torch.bfloat16 or "
                                         r"torch.float16 .*pass w13.bfloat16\(\) / w13.half\(\)"):
        moekit.MoEWeights("bf16", w13.float(), w2.float())


def test_repr_is_a_summary_not_the_tensors():
    """repr printed every tensor: hundreds of lines for one small layer."""
    w = random_weights(E, H, N, "fp8-channel-token", seed=3)
    assert repr(w) == f"MoEWeights(scheme=fp8-channel-token, E={E}, H={H}, N={N}, dtype=torch.float8_e4m3fn, device=cpu)"
    bf16 = moekit.MoEWeights("bf16", *_bf16_experts())
    assert repr(bf16) == f"MoEWeights(scheme=bf16, E={E}, H={H}, N={N}, dtype=torch.bfloat16, device=cpu)"


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if SCHEMES[s].is_fp8])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_weight_scales_that_are_nan_infinite_or_negative_are_refused(scheme, bad):
    """A NaN or infinite weight scale made its channels' outputs NaN on every backend with no
    error (a checkpoint read with the wrong dtype gives such values). Refused at construction and
    on assignment, naming the tensor, the count and where; the old scale kept. Zero stays
    allowed (a channel of zero weights)."""
    w = random_weights(3, 256, 128, scheme, seed=10)  # block scales need N a multiple of 128
    for name in ("w13_scale", "w2_scale"):
        scale = getattr(w, name).clone()
        last = tuple(d - 1 for d in scale.shape)
        scale[last] = bad
        with pytest.raises(ValueError, match=rf"MoEWeights.{name} has 1 value\(s\) that are NaN, infinite or negative.*at {re.escape(str(last))}"):
            moekit.MoEWeights.from_fp8(scheme, w.w13, w.w2, **{**_scales(w), name: scale})
        old = getattr(w, name)
        with pytest.raises(ValueError, match=name):
            setattr(w, name, scale)
        assert getattr(w, name) is old
        scale[last] = 0.0
        setattr(w, name, scale)  # a zero scale is taken
        assert getattr(w, name) is scale


def _scales(w) -> dict:
    return {k: getattr(w, k) for k in ("w13_scale", "w2_scale", "a13_scale", "a2_scale")}


def test_quantize_weights_refuses_arguments_it_would_ignore():
    w13, w2 = _bf16_experts()
    for scheme in ("fp8-channel-token", "fp8-tensor-dynamic", "bf16"):
        with pytest.raises(ValueError, match="only for fp8-tensor-static"):
            moekit.quantize_weights(w13, w2, scheme, input_scales=(0.1, 0.1))
        with pytest.raises(ValueError, match="only for fp8-tensor-static"):
            moekit.quantize_weights(w13, w2, scheme, calibration=torch.randn(4, H))
    for bad in ((0.1,), (torch.tensor([0.1, 0.2]), 0.1), (0.1, 0.1, 0.1)):
        with pytest.raises(ValueError, match="input_scales must be two scalars"):
            moekit.quantize_weights(w13, w2, "fp8-tensor-static", input_scales=bad)


def test_quantize_weights_names_input_scales_and_calibration_of_the_wrong_form():
    """A lone scalar for input_scales raised "'float' object is not iterable", a None among them
    "must be real number, not NoneType", and calibration given as a list or a numpy array
    "'list' object has no attribute 'dim'": none named the argument or the form it takes."""
    import numpy as np

    w13, w2 = _bf16_experts()
    for bad, got in ((0.01, "got float"), (torch.tensor([0.1, 0.2]), "got Tensor"),
                     ((0.01, None), r"got \(float, NoneType\)"), (("0.1", 0.1), r"got \(str, float\)")):
        with pytest.raises(TypeError, match=r"input_scales must be two scalars \(a13, a2\), the scales of GEMM1's "
                                            rf"and GEMM2's inputs.*; {got}"):
            moekit.quantize_weights(w13, w2, "fp8-tensor-static", input_scales=bad)
    x = random_x(4, H, dtype=torch.float32)
    for bad, got in ((x.tolist(), "list"), (x.numpy(), "ndarray"), (x.to(torch.int32), "a tensor of dtype torch.int32")):
        with pytest.raises(TypeError, match=rf"calibration must be a float torch.Tensor of activations \[T, "
                                            rf"hidden={H}\], got {got}"):
            moekit.quantize_weights(w13, w2, "fp8-tensor-static", calibration=bad)
    # the forms it takes: two scalars (numpy's too) or one-element tensors, a float tensor
    a = moekit.quantize_weights(w13, w2, "fp8-tensor-static", input_scales=[np.float32(0.5), torch.tensor([0.25])])
    b = moekit.quantize_weights(w13, w2, "fp8-tensor-static", input_scales=(0.5, 0.25))
    assert torch.equal(a.a13_scale, b.a13_scale) and torch.equal(a.a2_scale, b.a2_scale)
    assert moekit.quantize_weights(w13, w2, "fp8-tensor-static", calibration=x).a13_scale.shape == (1,)


@pytest.mark.parametrize("scheme", ["fp8-channel-token", "bf16"])
def test_quantize_weights_checks_both_weights_dtypes(scheme):
    """An integer w2 was quantized silently (only w13's dtype was checked) while an integer w13
    was refused."""
    w13, w2 = _bf16_experts()
    for name, bad in (("w13", (w13.float() * 100).to(torch.int64)), ("w2", (w2.float() * 100).to(torch.int64))):
        given = {"w13": w13, "w2": w2, name: bad}
        with pytest.raises(ValueError, match=f"quantize_weights needs float weights, got {name} of dtype torch.int64"):
            moekit.quantize_weights(given["w13"], given["w2"], scheme)
    fp8 = random_weights(E, H, N, "fp8-channel-token")
    with pytest.raises(ValueError, match="got w2 of dtype torch.float8_e4m3fn; FP8 weights with their scales are "
                                         "wrapped by MoEWeights.from_fp8"):
        moekit.quantize_weights(w13, fp8.w2, scheme)


def test_the_fp16_scheme_object_casts_to_fp16_as_its_name_does():
    """SCHEMES["fp16"] / get_scheme("fp16") was the bf16 scheme object itself, so
    quantize_weights(w13, w2, SCHEMES["fp16"]) made bf16 weights where the name "fp16" made fp16
    ones (a loop over SCHEMES built bf16 twice). It is now the same unquantized scheme (equal, one
    name in tables) asked for in fp16."""
    from moekit import tables
    from moekit.spec import MoEShape, get_scheme

    w13, w2 = (t.float() for t in _bf16_experts())
    for asked, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        for scheme in (asked, SCHEMES[asked], get_scheme(asked)):
            got = moekit.quantize_weights(w13, w2, scheme)
            assert got.w13.dtype == got.w2.dtype == dtype, (asked, scheme)
            assert got.scheme == SCHEMES["bf16"] and got.scheme.name == "bf16"
    # one unquantized scheme wherever schemes are compared, hashed or filed
    assert SCHEMES["fp16"] == SCHEMES["bf16"] and len({SCHEMES["fp16"], SCHEMES["bf16"]}) == 1
    shape = MoEShape(E, H, N, K)
    assert tables.table_name(shape, SCHEMES["fp16"], "NVIDIA H200") == tables.table_name(shape, SCHEMES["bf16"], "NVIDIA H200")


def test_select_takes_a_schemes_name_and_cutlass_counts_groups_as_torch_does():
    """select_backend with scheme="fp8-channel-token" raised AttributeError ('str' has no
    is_fp8); cutlass took 1024 experts, but torch's grouped GEMMs check group_count < 1024."""
    from moekit.spec import MoEShape

    shape = MoEShape(E, H, N, K)
    assert select_backend(shape, "fp8-channel-token", "cpu").backend == select_backend(
        shape, moekit.spec.get_scheme("fp8-channel-token"), "cpu").backend
    reasons = cutlass.CutlassBackend().supports(MoEShape(1024, 128, 128, 8), moekit.spec.get_scheme("fp8-channel-token"),
                                                torch.device("cpu"))
    assert any("1024 experts" in r and "at most 1023" in r for r in reasons), reasons


def test_a_bad_assignment_of_another_type_is_undone_too():
    w = random_weights(E, H, N, "fp8-tensor-static", seed=10)
    old = w.a13_scale
    with pytest.raises(TypeError):
        w.a13_scale = 2.0  # not a tensor: _check_tensor's TypeError left it in place
    assert w.a13_scale is old


def test_a_scale_of_the_wrong_shape_is_told_its_shape_even_when_not_contiguous():
    """_validate checked contiguity before shapes: a slice of the wrong shape was told to be made
    contiguous, which would not have helped."""
    w = random_weights(E, H, N, "fp8-channel-token", seed=11)
    wide = torch.cat([w.w13_scale, w.w13_scale], dim=1)  # [E, 4N]
    with pytest.raises(ValueError, match=r"MoEWeights\.w13_scale has shape \(4, 32\); expected \(4, 64\)"):
        moekit.MoEWeights.from_fp8("fp8-channel-token", w.w13, w.w2, wide[:, :N], w.w2_scale)


def test_a_replaced_w13_of_another_dtype_names_w13_as_the_cause():
    """w.w13 = w13.half() on bf16 weights blamed w2 ("w2 has dtype bfloat16; expected float16")."""
    w = moekit.MoEWeights("bf16", *_bf16_experts())
    old = w.w13
    with pytest.raises(ValueError, match=r"MoEWeights\.w2 has dtype torch\.bfloat16; expected torch\.float16 \(w13's dtype\)"):
        w.w13 = w.w13.half()
    assert w.w13 is old


def test_a_scheme_assigned_after_construction_is_validated_and_undone():
    """MoEWeights.scheme could be set to anything: another scheme failed later inside a backend
    (TypeError in dequantize_expert), a name with AttributeError ('str' has no is_fp8)."""
    w = moekit.MoEWeights("bf16", *_bf16_experts())
    bf16 = w.scheme
    with pytest.raises(ValueError, match=r"MoEWeights\.w13 has dtype torch\.bfloat16; expected torch\.float8_e4m3fn"):
        w.scheme = "fp8-tensor-dynamic"
    assert w.scheme is bf16
    with pytest.raises(ValueError, match="fp9"):
        w.scheme = "fp9"
    assert w.scheme is bf16
    w.scheme = "fp16"  # a name, of a scheme these tensors suit: taken, as a QuantScheme
    assert w.scheme is SCHEMES["fp16"]


@pytest.mark.parametrize("shape", [(E, 0, H), (0, 2 * N, H), (E, 2 * N, 0)])
def test_empty_dimensions_are_refused_by_name(shape):
    """N = 0 was accepted (fused_moe then failed in MoEShape) and quantize_weights raised
    IndexError from inside its amax."""
    E_, two_n, H_ = shape
    w13 = torch.randn(E_, two_n, H_).bfloat16()
    w2 = torch.randn(E_, H_, two_n // 2).bfloat16()
    with pytest.raises(ValueError, match="E, N and H at least 1"):
        moekit.MoEWeights("bf16", w13, w2)
    with pytest.raises(ValueError, match="E, N and H at least 1"):
        moekit.quantize_weights(w13, w2, "fp8-channel-token")
