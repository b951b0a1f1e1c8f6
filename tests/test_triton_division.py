"""The triton backend's division by a quantization scale (_kernels._divide_rn, inside every
quantizing kernel and GEMM epilogue: two FMAs on the reciprocal instead of a division per
element) against IEEE division, the FP8 values it gives against moekit.quant.to_fp8, the
reference's rule, and the quantizer's chunks of columns writing only their own scales. Under
TRITON_INTERPRET=1 on the CPU; on CUDA on a GPU machine."""

import pytest
import torch
import triton
import triton.language as tl

import moekit
from moekit.backends.triton import launch
from moekit.backends.triton._kernels import _divide_rn
from moekit.quant import scale_from_amax, to_fp8

from helpers import random_weights


@triton.jit
def _divide_kernel(a_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    a = tl.load(a_ptr + offs, mask=ok, other=1.0)
    s = tl.full((BLOCK,), 1.0, tl.float32) * tl.load(scale_ptr)
    inv = tl.div_rn(tl.full((BLOCK,), 1.0, tl.float32), s)
    tl.store(out_ptr + offs, _divide_rn(a, s, inv), mask=ok)


def every_bf16_value(device) -> torch.Tensor:
    """All 65,536 bf16 bit patterns as float32: every finite value, +-0, +-inf and NaNs."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().to(device)


@pytest.mark.parametrize("scale", [
    scale_from_amax(torch.tensor(1.0)).item(),  # a row of values up to 1
    scale_from_amax(torch.tensor(3.0e38)).item(),  # a row near float32's end: quotients of at most 448
    scale_from_amax(torch.tensor(0.0)).item(),  # an all-zero row: the 1e-10 floor
    0.37,  # a static scale of no particular form
    1e-30,  # a static scale so small that quotients overflow to infinity
    float("inf"), 0.0,  # what a NaN-free amax cannot give, but a static scale can
])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter multiplies inf by 0 as numpy does, loudly
def test_division_by_the_scale_is_ieee_division_for_every_bf16_value(scale, device):
    """Bitwise IEEE's quotient (NaN where it is NaN), signed zeros and infinities included: where
    a * (1/s) is zero or the correction is NaN, the product itself is the quotient; elsewhere
    Markstein's correction rounds it correctly. The one exception: |a| below 2**-102, whose
    residual a - q * s (about 2**-24 of a) falls among float32's subnormals and loses bits; those
    quotients may differ in their last bits, but they are tiny or, over a scale as small as 1e-30,
    still rounded to the same FP8 value (asserted)."""
    a = every_bf16_value(device)
    s = torch.tensor([scale], dtype=torch.float32, device=device)
    got = torch.empty_like(a)
    _divide_kernel[(triton.cdiv(a.numel(), 1024),)](a, s, got, a.numel(), BLOCK=1024)
    expected = a / s
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    mismatch = (got.view(torch.int32) != expected.view(torch.int32)) & ~nan
    tiny = a.abs() < 2.0**-102
    assert not (mismatch & ~tiny).any(), f"quotients differ, e.g. of {a[mismatch & ~tiny][:4].tolist()}"
    e4m3 = torch.float8_e4m3fn
    assert torch.equal(got[mismatch].to(e4m3).view(torch.uint8), expected[mismatch].to(e4m3).view(torch.uint8))


def test_a_static_scale_saturates_what_overflows_as_the_reference_does(device):
    """x / scale past e4m3's range clamps to +-448, also where the quotient overflows float32 (an
    inf in x, 3e38 over a small scale): the reference's to_fp8; NaN stays NaN."""
    w = random_weights(3, 256, 128, "fp8-tensor-static", device=device)
    x = torch.randn(2, 256, device=device).to(torch.bfloat16)
    s = float(w.a13_scale)
    x[0, :6] = torch.tensor([float("inf"), -float("inf"), 3.0e38, -3.0e38, 449 * s, -449 * s])
    x[1, 0] = float("nan")
    q, scale = launch.quantize_input(x, w)
    expected = to_fp8(x.float(), w.a13_scale.float())
    assert torch.equal(q.float().isnan(), expected.float().isnan())
    finite = ~expected.float().isnan()
    assert torch.equal(q.view(torch.uint8)[finite], expected.view(torch.uint8)[finite])
    assert q[0, :6].float().abs().eq(448).all()  # saturated, not NaN


def test_the_chunk_of_columns_must_be_a_power_of_two_of_whole_groups(monkeypatch):
    w = random_weights(3, 256, 128, "fp8-block128", device="cpu")
    x = torch.randn(1, 256).to(torch.bfloat16)
    for bad in (100, 384, 64):
        monkeypatch.setattr(launch, "QUANTIZE_CHUNK", bad)
        with pytest.raises(ValueError, match="QUANTIZE_CHUNK must be 0 or a power of two >= 128"):
            launch.quantize_input(x, w)
    assert moekit  # the package imported as a user would


@pytest.mark.parametrize("H", [600, 1024, 1100])
def test_group_scales_are_written_inside_their_row_only(H, device, monkeypatch):
    """Chunks of 256 columns, 1x128 groups: each program writes the scales of its own groups and
    no others. The scales go into a wider buffer (4 guard columns per row, a sentinel in them):
    every guard keeps its sentinel, every group's scale is moekit.quant's."""
    from moekit.backends.triton import _kernels as k
    from moekit.quant import quantize_activation

    monkeypatch.setattr(launch, "QUANTIZE_CHUNK", 256)
    M, groups = 3, triton.cdiv(H, 128)
    x = torch.randn(M, H, device=device).to(torch.bfloat16) * 3
    q = torch.empty(M, H, dtype=torch.float8_e4m3fn, device=device)
    guarded = torch.full((M, groups + 4), -7.0, device=device)
    columns = launch._quantize_columns(H, 1)
    launch._launch(k.quantize_rows_kernel, (M, triton.cdiv(H, columns)), x, q, guarded, guarded, H=H,
                   stride_x=x.stride(0), stride_q=q.stride(0), stride_s=guarded.stride(0), BLOCK_H=columns,
                   GROUP=128, INTERPRET=launch._interpreting(), MODE=1, FROM_AMAX=False)
    expected_q, expected_scale = quantize_activation(x, "group")
    assert torch.equal(guarded[:, groups:], torch.full((M, 4), -7.0, device=device))
    assert torch.equal(guarded[:, :groups], expected_scale)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))
