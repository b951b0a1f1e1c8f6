import pytest
import torch

from moekit import quant
from moekit.spec import FP8_MAX

FP8_REL_STEP = 2**-3  # e4m3 has 3 mantissa bits: rounding moves a value by at most half of 1/8


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_weight_roundtrip_within_fp8_rounding(granularity):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 200, 130, generator=g) * torch.linspace(0.1, 5, 130)
    q, s = quant.quantize_weight(w, granularity)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == quant.weight_scale_shape(granularity, 3, 200, 130)
    back = quant.dequantize_weight(q, s, granularity)
    # Normal values round to within half a step (1/16 relative); tiny values sit on the subnormal
    # grid, whose spacing is 2**-9 of the scale.
    full_scale = quant.dequantize_weight(torch.ones_like(q), s, granularity)
    bound = (w.abs() * FP8_REL_STEP / 2).clamp(min=full_scale * 2**-10) + 1e-12
    assert ((back - w).abs() <= bound).all()


def test_block_scales_follow_each_block():
    w = torch.ones(1, 256, 256)
    w[0, :128, 128:] *= 10  # one block ten times larger than the others
    q, s = quant.quantize_weight(w, "block")
    assert torch.allclose(s[0], torch.tensor([[1.0, 10.0], [1.0, 1.0]]) / FP8_MAX)
    assert (q.float() == FP8_MAX).all()  # every block's largest value maps to 448


@pytest.mark.parametrize("granularity", ["tensor", "token", "group"])
def test_activation_scale_is_amax_over_448(granularity):
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    q, s = quant.quantize_activation(x, granularity)
    if granularity == "tensor":
        expected = x.abs().amax().reshape(1) / FP8_MAX
    elif granularity == "token":
        expected = x.abs().amax(1) / FP8_MAX
    else:
        padded = torch.nn.functional.pad(x, (0, 84))
        expected = padded.view(5, 3, 128).abs().amax(2) / FP8_MAX
    assert torch.equal(s, expected)
    back = quant.dequantize_activation(q, s, granularity)
    assert (back - x).abs().max() <= x.abs().max() * FP8_REL_STEP / 2


def test_zero_rows_give_zero_not_nan():
    x = torch.zeros(2, 128)
    x[1] = 1.0
    q, s = quant.quantize_activation(x, "token")
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.equal(quant.dequantize_activation(q, s, "token"), x)


def test_static_scale_saturates():
    x = torch.tensor([[1.0, -1000.0, 0.5]])
    q, s = quant.quantize_activation(x, "tensor", static_scale=torch.tensor([1.0]))
    assert q.float().tolist() == [[1.0, -FP8_MAX, 0.5]]
    with pytest.raises(ValueError, match="static activation scales exist only per tensor"):
        quant.quantize_activation(x, "token", static_scale=torch.tensor([1.0]))


def test_unknown_granularity():
    with pytest.raises(ValueError, match="unknown weight granularity 'row'"):
        quant.quantize_weight(torch.ones(1, 2, 2), "row")
    with pytest.raises(ValueError, match="unknown activation granularity 'row'"):
        quant.quantize_activation(torch.ones(2, 2), "row")
