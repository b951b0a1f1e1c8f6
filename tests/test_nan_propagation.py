"""A NaN in the activations comes out as NaN, as `reference` gives it, on every backend and path.

torch propagates a NaN through amax, clamp and matmul, so in `reference` a NaN in token t's
activations makes t's whole output NaN (its per-token scale, or its value in every dot product),
and under `fp8-tensor-dynamic` every token's (the tensor's one scale is NaN). A GPU's min / max
instructions instead return the other operand, so a kernel that clamps before FP8 with them turns
the NaN into +-448, a finite, plausible, wrong value. These tests put one NaN into one token and
check that its output is all NaN, and that every other token's output is bitwise what the same
call gives without the NaN (rows do not mix in any GEMM) or, where the scheme's per-tensor scale
takes it in, NaN as well.

The CPU interpreter computes with numpy, which drops a NaN in a maximum as a GPU does (triton
3.9: np.fmax, np.nanmax) but reads e4m3's NaN byte as 480 (conftest.py gives it the GPU's
reading), so the tests show most of the NaN handling on the CPU too; the `device` fixture runs
them on CUDA where there is one (scripts/gpu_check.sh `pending`).
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import moekit
from moekit.backends.base import get_backend
from moekit.backends.glue import ops
from moekit.backends.glue._kernels import _round_act
from moekit.backends.triton import KernelConfig
from moekit.backends.triton._kernels import _to_dtype
from moekit.backends.triton.launch import FP8_ACCUMULATION_ENV, _interpreting

from helpers import random_routing, random_weights, random_x

SCHEMES = ["bf16", "fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token", "fp8-block128"]
E, H, N, K = 6, 256, 256, 2  # multiples of 128: the Gluon kernels' shapes on a Hopper GPU
NAN_TOKEN, NAN_COLUMN = 2, 17

# the triton backend's launch paths (on a Hopper GPU; elsewhere the Triton kernels of the same tiles)
TILE = KernelConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
TRITON_CONFIGS = {
    "gemv": KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=2, num_stages=1, GEMV=1),
    "gemv-late": KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=2, num_stages=1, GEMV=2),
    "gluon-gemm1": dataclasses.replace(TILE, OVERLAP=1),
    "gluon-gemm1-tall-gemm2": dataclasses.replace(TILE, BLOCK_M=128, OVERLAP=1).with_gemm2(OVERLAP=1),
}


def nan_and_clean_inputs(M, scheme, device):
    w = random_weights(E, H, N, scheme, device=device, seed=M)
    tw, ids = random_routing(M, E, K, device=device, seed=M)
    clean = random_x(M, H, device=device, seed=M)
    # a value below the tensor's max where the NaN goes: a maximum that leaves the NaN out is then
    # the clean input's, so a kernel that dropped the NaN from a scale would show it bitwise
    clean[NAN_TOKEN, NAN_COLUMN] = 0.0
    with_nan = clean.clone()
    with_nan[NAN_TOKEN, NAN_COLUMN] = float("nan")
    return w, tw, ids, with_nan, clean


def assert_nan_where_reference_has_it(out, clean_out, scheme, quantizes_activations=True):
    """The NaN token's output all NaN; the others all NaN where a per-tensor dynamic scale takes
    the NaN in (`quantizes_activations`: the torch backend multiplies unquantized activations, so
    no scale ever sees it), else bitwise the clean call's."""
    others = torch.arange(out.shape[0], device=out.device) != NAN_TOKEN
    assert out[NAN_TOKEN].isnan().all(), f"token {NAN_TOKEN}: {int(out[NAN_TOKEN].isnan().sum())} of {H} NaN"
    assert not clean_out.isnan().any()
    if scheme == "fp8-tensor-dynamic" and quantizes_activations:
        assert out[others].isnan().all(), "the tensor's one dynamic scale should be NaN, as reference's"
    else:
        assert torch.equal(out[others], clean_out[others]), "a NaN in one token changed another token's output"


def run_twice(backend, M, scheme, device, config=None):
    w, tw, ids, with_nan, clean = nan_and_clean_inputs(M, scheme, device)
    if config is None:
        return (moekit.fused_moe(with_nan, w, tw, ids, backend=backend),
                moekit.fused_moe(clean, w, tw, ids, backend=backend))
    triton = get_backend("triton")
    return triton.run(with_nan, w, tw, ids, config=config), triton.run(clean, w, tw, ids, config=config)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("backend", ["reference", "torch", "triton", "cutlass"])
@pytest.mark.parametrize("M", [5, 70])  # 70 x 2 pairs: the triton backend's non-decode alignment and quantization
def test_a_nan_token_is_nan_on_every_backend(backend, scheme, M, device):
    reasons = get_backend(backend).supports(moekit.MoEShape(E, H, N, K), moekit.get_scheme(scheme), device)
    if reasons:
        pytest.skip(f"{backend} cannot run {scheme} here: {'; '.join(reasons)}")
    out, clean_out = run_twice(backend, M, scheme, device)
    assert_nan_where_reference_has_it(out, clean_out, scheme, quantizes_activations=backend != "torch")


@pytest.mark.parametrize("mode", ["precise", "fast"])
@pytest.mark.parametrize("scheme", ["fp8-tensor-dynamic", "fp8-channel-token", "fp8-block128"])
@pytest.mark.parametrize("path", sorted(TRITON_CONFIGS))
def test_a_nan_token_is_nan_on_every_triton_path(path, scheme, mode, device, monkeypatch):
    """The GEMV path (M = 3 top-2 on 6 experts: within its E / 2 pairs), the Gluon GEMM1 on 64
    and 128 rows and the Gluon GEMM2, in both accumulation modes (fast mode quantizes
    fp8-channel-token's intermediate per row, in a pass of its own)."""
    config = TRITON_CONFIGS[path]
    if config.problems(moekit.get_scheme(scheme)):
        pytest.skip(f"{path} does not run {scheme}: {config.problems(moekit.get_scheme(scheme))}")
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, mode)
    out, clean_out = run_twice("triton", 3 if config.GEMV else 70, scheme, device, config)
    assert_nan_where_reference_has_it(out, clean_out, scheme)


@triton.jit
def _to_bf16_kernel(v_ptr, glue_ptr, triton_ptr, n, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(v_ptr + offs, mask=ok)
    tl.store(glue_ptr + offs, _round_act(v, tl.bfloat16), mask=ok)
    tl.store(triton_ptr + offs, _to_dtype(v, tl.bfloat16, INTERPRET).to(tl.float32), mask=ok)


def test_rounding_to_bf16_keeps_every_nan(device):
    """The kernels' float32 -> bf16 roundings (the glue's by integer arithmetic, the triton
    backend's under the interpreter) on NaNs of every payload, the GPU's own 0x7FFFFFFF among
    them (it overflowed the rounding into -0.0), and on finite values and infinities, which must
    round as torch does."""
    nan_bits = [0x7FFFFFFF, -1, 0x7FC00000, 0x7F800001, 0x7FFF8000, -0x00400000]  # -1: 0xFFFFFFFF
    nans = torch.tensor(nan_bits, dtype=torch.int32).view(torch.float32)
    finite = torch.cat([torch.randn(50, generator=torch.Generator().manual_seed(0)) * 1e3,
                        torch.tensor([float("inf"), -float("inf"), 3.4e38, -0.0, 1.00390625, 1.01171875])])
    v = torch.cat([nans, finite]).to(device)
    assert v[: len(nan_bits)].isnan().all()
    glue_out, triton_out = torch.empty_like(v), torch.empty_like(v)
    _to_bf16_kernel[(1,)](v, glue_out, triton_out, v.numel(), BLOCK=triton.next_power_of_2(v.numel()),
                          INTERPRET=_interpreting())
    expected = v.to(torch.bfloat16).float()
    for out in (glue_out, triton_out):
        assert out[: len(nan_bits)].isnan().all(), out[: len(nan_bits)]
        assert torch.equal(out[len(nan_bits):], expected[len(nan_bits):])


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_the_glues_per_tensor_scales_keep_a_nan(impl, device):
    """The glue's dynamic per-tensor quantization (the cutlass backend's, which needs a GPU, so
    the test above shows it only there): a NaN in x makes x's one scale NaN (permute), and a NaN
    in one pair's row of GEMM1's output the intermediate's (silu_mul), on every pair's row."""
    M, E, H, N = 6, 4, 256, 64
    x = random_x(M, H, device=device)
    x[NAN_TOKEN, NAN_COLUMN] = float("nan")
    _, ids = random_routing(M, E, K, device=device)
    _, a_scale, layout = ops.permute(x, ids, E, quant="tensor", impl=impl)
    rows = layout.row_of_pair.long()
    assert a_scale[rows].isnan().all()
    h = torch.randn(layout.num_rows, 2 * N, generator=torch.Generator().manual_seed(0)).bfloat16().to(device)
    h[rows[3], 5] = float("nan")
    _, act_scale = ops.silu_mul(h, layout, act_dtype=torch.bfloat16, quant="tensor", impl=impl)
    assert act_scale[rows].isnan().all()
    _, clean_scale = ops.silu_mul(h.nan_to_num(), layout, act_dtype=torch.bfloat16, quant="tensor", impl=impl)
    assert clean_scale[rows].isfinite().all()  # the NaN, not something else, made it NaN
