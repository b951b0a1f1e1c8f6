"""The reference backend against an independent float64 loop over tokens and their experts."""

import pytest
import torch

import moekit
from moekit.backends.reference import reference_moe

from helpers import random_routing, random_weights, random_x, rel_l2

SCHEMES = ["bf16", "fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token", "fp8-block128"]
FP8 = torch.float8_e4m3fn


def _fake_quant(x: torch.Tensor, granularity: str, static=None) -> torch.Tensor:
    """float64 quantize-dequantize written independently of moekit.quant: one row or group at a time."""
    def q(v, s):
        return (v / s).clamp(-448, 448).float().to(FP8).double() * s

    x = x.double()
    if static is not None:
        return q(x, float(static))
    if granularity == "tensor":
        return q(x, max(float(x.abs().max()), 1e-10) / 448)
    out = torch.empty_like(x)
    width = x.shape[1] if granularity == "token" else 128
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], width):
            seg = x[r, c : c + width]
            out[r, c : c + width] = q(seg, max(float(seg.abs().max()), 1e-10) / 448)
    return out


def _dequant_weight(q, s, granularity):
    q = q.double()
    if granularity is None:
        return q
    if granularity == "tensor":
        return q * float(s)
    if granularity == "channel":
        return q * s.double()[:, None]
    out = torch.empty_like(q)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (
                q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] * float(s[i, j])
            )
    return out


def float64_moe(x, w, topk_weights, topk_ids):
    scheme = w.scheme
    g = scheme.weight
    N = w.n
    xq = _fake_quant(x, scheme.activation, w.a13_scale) if scheme.is_fp8 else x.double()
    M, K = topk_ids.shape
    acts = torch.empty(M * K, N, dtype=torch.float64)
    for t in range(M):
        for j in range(K):
            e = int(topk_ids[t, j])
            w13 = _dequant_weight(w.w13[e], None if g is None else w.w13_scale[e], g)
            h = w13 @ xq[t]
            acts[t * K + j] = torch.nn.functional.silu(h[:N]) * h[N:]
    acts = acts.to(x.dtype).double()  # kernels store the intermediate in the activations' dtype
    if scheme.is_fp8:
        acts = _fake_quant(acts, scheme.activation, w.a2_scale)
    out = torch.zeros(M, w.hidden, dtype=torch.float64)
    for t in range(M):
        for j in range(K):
            e = int(topk_ids[t, j])
            w2 = _dequant_weight(w.w2[e], None if g is None else w.w2_scale[e], g)
            out[t] += float(topk_weights[t, j]) * (w2 @ acts[t * K + j])
    return out


# float32 accumulation over a few hundred terms is ~1e-6 relative; the rest is the bf16 output
# and rare FP8 rounding flips where the float32 and float64 intermediates straddle a rounding
# boundary. bf16 keeps 8 significant bits: rounding the output moves each element by at most
# 2**-8 = 3.9e-3 of itself, so the L2 error by at most that; random roundings give the RMS
# 2**-7 * sqrt(0.541) / sqrt(12) = 1.66e-3 (uniform within half a unit, a unit being 2**-7..2**-8
# of the value over a binade; measured 1.4e-3..1.8e-3). A flipped FP8 element moves by one step
# (<= 2**-3 of itself), so a fraction f of flips adds ~2**-3 * sqrt(f) in quadrature: 5e-3 covers
# the rounding's worst case and, beside its typical 1.7e-3, flips of up to ~0.14% of the intermediate.
REFERENCE_TOL = 5e-3


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(
    "E,H,N,M,K", [(3, 200, 128, 5, 2), (7, 136, 256, 9, 3), (4, 64, 128, 1, 1)]
)
def test_reference_matches_float64_loop(scheme, E, H, N, M, K):
    w = random_weights(E, H, N, scheme, seed=E + M)
    x = random_x(M, H, seed=M)
    tw, ids = random_routing(M, E, K, seed=E)
    out = moekit.fused_moe(x, w, tw, ids, backend="reference")
    assert out.shape == (M, H) and out.dtype == x.dtype
    assert rel_l2(out, float64_moe(x, w, tw, ids)) < REFERENCE_TOL


@pytest.mark.parametrize("scheme", ["bf16", "fp8-channel-token"])
def test_odd_intermediate_when_scheme_allows(scheme):
    w = random_weights(5, 97, 45, scheme)  # neither dimension a power of two (block needs N % 128)
    x = random_x(6, 97)
    tw, ids = random_routing(6, 5, 2)
    assert rel_l2(moekit.fused_moe(x, w, tw, ids, backend="reference"), float64_moe(x, w, tw, ids)) < REFERENCE_TOL


def test_fp16_scheme_name_with_fp16_activations():
    """"fp16" (the README's name for the unquantized scheme with fp16 weights) is the bf16 scheme
    (equal to it; it only casts float32 weights to fp16 in quantize_weights); with fp16 weights and activations the reference matches the float64 loop (which rounds its
    intermediate to fp16 as well). fp16 keeps 11 significant bits: the output's rounding moves
    each element by at most 2**-11 = 4.9e-4 (RMS 2.1e-4; measured 1.9e-4..2.2e-4 over six seeds);
    no FP8 rounding here, only rare one-unit flips of the fp16 intermediate (float32 and float64
    on either side of a rounding boundary): 1e-3 is twice the output's worst case."""
    assert moekit.get_scheme("fp16") == moekit.get_scheme("bf16")
    w = random_weights(3, 136, 96, "fp16", dtype=torch.float16, seed=3)
    assert w.w13.dtype == w.w2.dtype == torch.float16 and not w.scheme.is_fp8
    x = random_x(5, 136, dtype=torch.float16, seed=3)
    tw, ids = random_routing(5, 3, 2, seed=3)
    out = moekit.fused_moe(x, w, tw, ids, backend="reference")
    assert out.shape == (5, 136) and out.dtype == torch.float16
    assert rel_l2(out, float64_moe(x, w, tw, ids)) < 1e-3


def test_experts_without_tokens_and_edge_sizes():
    w = random_weights(7, 128, 128, "fp8-block128")
    tw, ids = random_routing(4, 7, 2, experts=[1, 5])  # five experts get nothing
    x = random_x(4, 128)
    assert rel_l2(moekit.fused_moe(x, w, tw, ids, backend="reference"), float64_moe(x, w, tw, ids)) < REFERENCE_TOL
    empty = moekit.fused_moe(x[:0], w, tw[:0], ids[:0], backend="reference")
    assert empty.shape == (0, 128)


@pytest.mark.parametrize("scheme", ["bf16", "fp8-tensor-dynamic", "fp8-channel-token", "fp8-block128"])
@pytest.mark.parametrize("granularity", [None, "token", "group"])
def test_reference_moe_called_directly_with_no_tokens(scheme, granularity):
    """reference_moe itself (not through fused_moe, which returns early for M = 0), as the
    accuracy check and the tests call it: no rows to quantize or combine is an empty result, not
    a reshape of zero elements with an inferred dimension."""
    w = random_weights(3, 256, 128, scheme)
    tw, ids = random_routing(4, 3, 2)
    out = reference_moe(random_x(4, 256)[:0], w, tw[:0], ids[:0], intermediate_granularity=granularity)
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16


def test_intermediate_granularity_override_changes_only_the_intermediate():
    w = random_weights(3, 256, 384, "fp8-channel-token")
    x = random_x(8, 256)
    tw, ids = random_routing(8, 3, 2)
    token = reference_moe(x, w, tw, ids)
    group = reference_moe(x, w, tw, ids, intermediate_granularity="group")
    # Different quantization of the intermediate: close (both within FP8 noise) but not equal.
    # One e4m3 rounding is ~2.65e-2 RMS relative (uniform within half a step, a step being
    # 2**-3..2**-4 of the value: 2**-3 * sqrt(0.541) / sqrt(12)). In each row the group holding the
    # row's max has the row's scale and rounds identically; elsewhere the two roundings are
    # independent: at most sqrt(2) * 2.65e-2 = 3.75e-2 in L2 even if no group shared its row's scale,
    # which GEMM2's random weights carry over to the output (measured 2.8e-2 with 2 of 3 groups
    # differing). 4e-2 is that ceiling plus 7% for the sampling spread.
    assert not torch.equal(token, group)
    assert rel_l2(group, token) < 4e-2


def test_reference_runs_whatever_tf32_api_the_caller_used():
    """The reference keeps float32 matmuls exact by switching TF32 off for its own matmuls. It read
    the legacy `allow_tf32` flag, which raises once a caller has set torch's new `fp32_precision`
    ("mix of the legacy and new APIs"), so the ground truth failed. Now it goes through the new
    setting and restores the caller's."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has only the legacy TF32 flag")
    saved = matmul.fp32_precision
    g = torch.Generator().manual_seed(11)
    w = random_weights(3, 64, 32, "bf16")
    tw, ids = random_routing(5, 3, 2)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    try:
        matmul.fp32_precision = "tf32"
        out = moekit.fused_moe(x, w, tw, ids, "reference")
        assert matmul.fp32_precision == "tf32"  # the caller's setting, restored
    finally:
        matmul.fp32_precision = saved
    assert torch.equal(out, moekit.fused_moe(x, w, tw, ids, "reference"))  # the same exact float32 path


def test_reference_can_round_gemm1_output_as_cutlass_does():
    """reference_moe(round_gemm1_output=True) stores GEMM1's output in x's dtype before SiLU, as
    cutlass does (bench's rel_err of cutlass compares against it, so that it measures errors, not
    that design choice). Against the float64 computation with the same rounding point it agrees to
    its own bf16 output rounding (unit roundoff 2**-9; 1.6e-3 measured here, with the rare FP8
    requantization flips an ulp of bf16 causes); without it, the bf16 rounding of h moves many
    intermediate values across FP8 steps (1.6e-2 measured): the bounds keep the two apart."""
    from moekit.check import float64_moe

    w = random_weights(5, 256, 128, "fp8-channel-token")
    x = random_x(33, 256)
    tw, ids = random_routing(33, 5, 2)
    rounded = reference_moe(x, w, tw, ids, round_gemm1_output=True)
    assert rel_l2(rounded, float64_moe(x, w, tw, ids, round_gemm1_output=True)) < 4e-3
    assert rel_l2(rounded, float64_moe(x, w, tw, ids, round_gemm1_output=False)) > 8e-3
    assert rel_l2(reference_moe(x, w, tw, ids), float64_moe(x, w, tw, ids)) < 4e-3
