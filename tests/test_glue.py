"""The Triton glue (moekit.backends.glue) against independent checks and its torch twin.

On the CPU the kernels run in the interpreter (TRITON_INTERPRET=1, set by conftest): tiny shapes.
On a GPU the same tests run the compiled kernels. Values are chosen so that results are exact
(small integers, dyadic weights) and compared bit for bit wherever the operation is exact.
"""

from pathlib import Path

import pytest
import torch

import moekit
from moekit import quant
from moekit.backends import cutlass
from moekit.backends.glue import ops
from moekit.backends.reference import reference_moe

from helpers import max_rel, random_routing, random_weights, random_x, rel_l2

FP8 = torch.float8_e4m3fn


def bits(t: torch.Tensor) -> torch.Tensor:
    """A view for bitwise comparison (FP8 has no comparison ops everywhere)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def int_x(M, H, dtype=torch.bfloat16, device="cpu", seed=0):
    """Integer-valued activations in [-8, 8]: exact in every dtype."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (M, H), generator=g).to(dtype).to(device)


def routing(M, E, K, device, seed=0, experts=None):
    tw, ids = random_routing(M, E, K, seed=seed, experts=experts)
    return tw.to(device), ids.to(device)


def check_layout(layout: ops.Layout, topk_ids: torch.Tensor, E: int, align: int):
    """Every invariant of the permuted layout, checked with plain Python on the host."""
    ids = topk_ids.reshape(-1).cpu().tolist()
    rows = layout.row_of_pair.cpu().tolist()
    counts = layout.counts.cpu().tolist()
    offs = layout.offs.cpu().tolist()
    assert layout.row_of_pair.dtype == torch.int32 and layout.offs.dtype == torch.int32
    assert counts == [ids.count(e) for e in range(E)]
    end = 0
    for e in range(E):
        padded = -(-counts[e] // align) * align
        start, end = end, end + padded
        assert offs[e] == end  # cumulative END of each (padded) group
        mine = [p for p in range(len(ids)) if ids[p] == e]
        # expert e's pairs fill the head of its group, in pair order (stable)
        assert [rows[p] for p in mine] == list(range(start, start + counts[e]))
    assert len(set(rows)) == len(rows)  # a permutation into the buffer
    assert offs[-1] <= layout.num_rows == ops.num_permuted_rows(len(ids), E, align)


# ------------------------------------------------------------------------------------ route


ROUTES = [
    # M, E, K, experts (None: all)
    (9, 7, 3, None),
    (1, 4, 1, None),  # M = 1
    (1, 8, 4, None),
    (12, 6, 2, [2, 5]),  # four experts get nothing
    (17, 3, 1, [1]),  # every token on one expert
    (70, 5, 4, None),  # 280 pairs: three chunks of 128
]


@pytest.mark.parametrize("M,E,K,experts", ROUTES)
@pytest.mark.parametrize("align", [1, 16])
def test_permute_layout_and_rows(device, M, E, K, experts, align):
    x = int_x(M, 24, device=device)
    _, ids = routing(M, E, K, device, experts=experts)
    a, a_scale, layout = ops.permute(x, ids, E, align=align, impl="triton")
    assert a_scale is None and a.dtype == x.dtype and a.shape == (layout.num_rows, 24)
    check_layout(layout, ids, E, align)
    rows = layout.row_of_pair.long()
    assert torch.equal(a[rows], x[torch.arange(M * K, device=device) // K])
    assert torch.equal(layout.counts.cpu(), torch.bincount(ids.reshape(-1).long().cpu(), minlength=E).int())
    # the torch twin builds the very same layout
    _, _, twin = ops.permute(x, ids, E, align=align, impl="torch")
    assert torch.equal(twin.row_of_pair, layout.row_of_pair) and torch.equal(twin.offs, layout.offs)


def test_scan_over_many_tiles(device, monkeypatch):
    """The scan kernel walks the [chunks, experts] counts a tile at a time: make tiles tiny."""
    monkeypatch.setattr(ops, "SCAN_TILE", 16)  # 2 chunks per tile for 8 experts
    M, E, K = 200, 7, 3  # 600 pairs: 5 chunks, 3 tiles
    _, ids = routing(M, E, K, device, seed=3)
    _, _, layout = ops.permute(int_x(M, 16, device=device), ids, E, impl="triton")
    check_layout(layout, ids, E, ops.ALIGN_M)


def test_int64_ids_and_strided_x(device):
    x = int_x(6, 64, device=device)[:, ::2]  # row stride 64, column stride 2
    _, ids = routing(6, 5, 2, device)
    a, _, layout = ops.permute(x, ids.long(), 5, impl="triton")
    assert torch.equal(a[layout.row_of_pair.long()], x[torch.arange(12, device=device) // 2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_permute_keeps_dtype(device, dtype):
    x = int_x(5, 40, dtype, device=device)
    _, ids = routing(5, 4, 2, device)
    a, _, layout = ops.permute(x, ids, 4, impl="triton")
    assert a.dtype == dtype
    assert torch.equal(a[layout.row_of_pair.long()], x.repeat_interleave(2, dim=0))


def test_empty_batch(device):
    x = torch.empty(0, 32, dtype=torch.bfloat16, device=device)
    ids = torch.empty(0, 2, dtype=torch.int32, device=device)
    a, s, layout = ops.permute(x, ids, 4, quant="token", impl="triton")
    assert layout.row_of_pair.numel() == 0 and layout.offs.tolist() == [0, 0, 0, 0] and s.numel() == 0
    act, _ = ops.silu_mul(torch.empty(layout.num_rows, 16, dtype=torch.bfloat16, device=device), layout,
                          act_dtype=torch.bfloat16)
    assert act.shape == (0, 8)
    out = ops.combine(torch.empty(0, 32, device=device), layout, torch.empty(0, 2, device=device),
                      out_dtype=torch.bfloat16)
    assert out.shape == (0, 32)


# ------------------------------------------------------------------------ permute + quantize


def _activation_rows(M, H, device):
    """Random rows spanning many magnitudes, plus a zero row (the amax floor) and a tiny one."""
    x = random_x(M, H, seed=M) * torch.logspace(-3, 3, M)[:, None].to(torch.bfloat16)
    x[1] = 0
    x[2] = x[2] * 1e-30
    return x.to(device)


@pytest.mark.parametrize("mode", ["token", "tensor-dynamic", "tensor-static"])
def test_quantized_permute_equals_moekit_quant(device, mode):
    M, E, K, H = 8, 5, 2, 72
    x = _activation_rows(M, H, device)
    _, ids = routing(M, E, K, device)
    static = torch.tensor([0.0123], device=device) if mode == "tensor-static" else None
    granularity = mode.split("-")[0]
    a, a_scale, layout = ops.permute(x, ids, E, quant=granularity, static_scale=static, impl="triton")
    q, s = quant.quantize_activation(x, granularity, static)
    token = torch.arange(M * K, device=device) // K
    rows = layout.row_of_pair.long()
    assert a.dtype == FP8
    assert torch.equal(bits(a[rows]), bits(q[token]))
    want_scale = s[token] if granularity == "token" else s.expand(M * K)
    assert torch.equal(a_scale[rows], want_scale)


def test_fp8_rounding_ties_subnormals_saturation(device):
    """Every e4m3 midpoint (ties go to even), subnormals, -0 and values past 448 (saturate),
    through a static scale of 1: must be bit-identical to moekit.quant.to_fp8."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].unique()  # all finite e4m3 values, sorted
    mids = (grid[1:] + grid[:-1]) / 2  # exact in float32; in bf16 when 4 significant bits suffice
    # specials: -0, saturation, ties and non-ties below the smallest subnormal (2**-9), on both
    # sides: a negative value rounding to zero must give -0 (byte 0x80) as torch does
    specials = torch.tensor([-0.0, 449.0, -464.0, 500.0, -1e4, 2.0**-10, 3 * 2.0**-10, -(2.0**-11), -(2.0**-10)])
    vals = torch.cat([specials, grid, mids]).to(torch.float32)
    vals = torch.cat([vals, vals[: -vals.numel() % 16]])  # whole rows of 16
    x = vals.view(-1, 16).to(device)  # float32 activations, exact
    ids = torch.zeros(x.shape[0], 1, dtype=torch.int32, device=device)
    one = torch.ones(1, device=device)
    a, _, layout = ops.permute(x, ids, 1, quant="tensor", static_scale=one, impl="triton")
    assert torch.equal(bits(a[layout.row_of_pair.long()]), bits(quant.to_fp8(x, one)))


def test_bf16_rounding_ties(device):
    """combine with one weight of 1 only rounds: float32 -> bf16 must round half to even."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 64, generator=g)
    ties = (base.view(torch.int32) & ~0xFFFF | 0x8000).view(torch.float32)  # exact bf16 midpoints
    y = torch.cat([base, ties, ties.neg()]).to(device)
    ids = torch.zeros(y.shape[0], 1, dtype=torch.int32, device=device)
    _, _, layout = ops.permute(y, ids, 1, align=1, impl="triton")  # rows = identity here
    out = ops.combine(y, layout, torch.ones(y.shape[0], 1, device=device), out_dtype=torch.bfloat16)
    assert torch.equal(out, y.to(torch.bfloat16))


# ------------------------------------------------------------------------------ SiLU-and-mul


def _h_for(layout, N, device, seed=0):
    """GEMM1 output: real rows random; padding rows huge, so that reading them would show."""
    g = torch.Generator().manual_seed(seed)
    h = torch.full((layout.num_rows, 2 * N), 3e4)
    h[layout.row_of_pair.long().cpu()] = torch.randn(layout.row_of_pair.numel(), 2 * N, generator=g) * 3
    return h.to(torch.bfloat16).to(device)


def _silu_mul_torch(h_rows, dtype):
    N = h_rows.shape[1] // 2
    hf = h_rows.float()
    return (torch.nn.functional.silu(hf[:, :N]) * hf[:, N:]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_mul_unquantized(device, dtype):
    M, E, K, N = 7, 4, 2, 40
    _, ids = routing(M, E, K, device)
    _, _, layout = ops.permute(int_x(M, 16, device=device), ids, E, impl="triton")
    h = _h_for(layout, N, device)
    act, scale = ops.silu_mul(h, layout, act_dtype=dtype)
    assert scale is None and act.dtype == dtype and act.shape == (layout.num_rows, N)
    rows = layout.row_of_pair.long()
    want = _silu_mul_torch(h[rows], dtype).float()
    got = act[rows].float()
    # float32 SiLU in both, but exp and the division may differ in the last bits (on a GPU exp is
    # ex2.approx of a rounded g*log2(e): ~|g| * 2**-23 relative, |g| < 16 here): a float32
    # result by up to ~2**-18 (allowed: 2**-16, 4x that), a rounded bf16/fp16 one by one unit in the
    # last place in rare elements, never more. One unit at want's magnitude: for |want| in
    # [2**e, 2**(e+1)) the unit is eps * 2**e <= eps * |want| (eps = torch.finfo(dtype).eps, the unit
    # at 1: 2**-7 for bf16's 8 significant bits, 2**-10 for fp16's 11), and the neighbour below a
    # power of two is nearer still (eps / 2); below the smallest normal the unit is eps * tiny.
    if dtype == torch.float32:
        bound = 2.0**-16 * want.abs() + 1e-30
    else:
        finfo = torch.finfo(dtype)
        bound = finfo.eps * want.abs() + finfo.eps * finfo.tiny
    assert ((got - want).abs() <= bound).all()
    if dtype != torch.float32:
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("mode", ["token", "tensor-dynamic", "tensor-static"])
def test_silu_mul_requant_equals_moekit_quant(device, mode):
    """The quantized intermediate is exactly moekit.quant applied to the kernel's own bf16
    intermediate: per row, ONE amax over the M*K pair rows (padding rows excluded), or static."""
    M, E, K, N = 6, 5, 3, 48
    _, ids = routing(M, E, K, device, experts=[0, 2, 3])
    _, _, layout = ops.permute(int_x(M, 16, device=device), ids, E, impl="triton")
    h = _h_for(layout, N, device, seed=1)
    granularity = mode.split("-")[0]
    static = torch.tensor([0.004], device=device) if mode == "tensor-static" else None
    plain, _ = ops.silu_mul(h, layout, act_dtype=torch.bfloat16)
    act, act_scale = ops.silu_mul(h, layout, act_dtype=torch.bfloat16, quant=granularity, static_scale=static)
    rows = layout.row_of_pair.long()
    q, s = quant.quantize_activation(plain[rows], granularity, static)
    assert act.dtype == FP8
    assert torch.equal(bits(act[rows]), bits(q))
    assert torch.equal(act_scale[rows], s if granularity == "token" else s.expand(rows.numel()))
    if mode == "tensor-dynamic":  # and a second call on the same layout gives the same again
        again, again_scale = ops.silu_mul(h, layout, act_dtype=torch.bfloat16, quant="tensor")
        assert torch.equal(bits(again[rows]), bits(act[rows])) and torch.equal(again_scale[rows], act_scale[rows])


def test_silu_mul_strided_h(device):
    """GEMM outputs may have padded row strides (torch pads rows to 16 bytes)."""
    M, E, K, N = 3, 2, 2, 20
    _, ids = routing(M, E, K, device)
    _, _, layout = ops.permute(int_x(M, 16, device=device), ids, E, impl="triton")
    wide = torch.zeros(layout.num_rows, 2 * N + 8, dtype=torch.bfloat16, device=device)
    h = wide[:, : 2 * N]
    h.copy_(_h_for(layout, N, device))
    a1, _ = ops.silu_mul(h, layout, act_dtype=torch.bfloat16, quant="token")
    a2, _ = ops.silu_mul(h.contiguous(), layout, act_dtype=torch.bfloat16, quant="token")
    rows = layout.row_of_pair.long()
    assert torch.equal(bits(a1[rows]), bits(a2[rows]))


# ---------------------------------------------------------------------------------- combine


@pytest.mark.parametrize("M,E,K,experts", ROUTES[:5])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_combine_exact_and_deterministic(device, M, E, K, experts, out_dtype):
    H = 40
    _, ids = routing(M, E, K, device, experts=experts)
    _, _, layout = ops.permute(int_x(M, 8, device=device), ids, E, impl="triton")
    g = torch.Generator().manual_seed(M)
    y = torch.randint(-16, 17, (layout.num_rows, H), generator=g).to(torch.bfloat16).to(device)
    tw = (torch.randint(1, 8, (M, K), generator=g) / 8).to(device)  # dyadic: every sum exact
    out = ops.combine(y, layout, tw, out_dtype=out_dtype)
    rows = layout.row_of_pair.cpu().view(M, K).tolist()
    want = torch.zeros(M, H, dtype=torch.float64)
    for t in range(M):
        for j in range(K):
            want[t] += float(tw[t, j]) * y[rows[t][j]].double().cpu()
    assert out.dtype == out_dtype
    assert torch.equal(out.cpu(), want.to(out_dtype))
    assert torch.equal(ops.combine(y, layout, tw, out_dtype=out_dtype), out)  # deterministic
    assert torch.equal(ops.combine(y, layout, tw, out_dtype=out_dtype, impl="torch"), out)


def test_combine_weights_rounding_matches_torch_twin(device):
    """Non-dyadic weights: float32 products and sums in the same order in both implementations."""
    M, E, K, H = 6, 4, 3, 56
    tw, ids = routing(M, E, K, device, seed=5)
    _, _, layout = ops.permute(int_x(M, 8, device=device), ids, E, impl="triton")
    g = torch.Generator().manual_seed(6)
    y = torch.randn(layout.num_rows, H, generator=g).to(torch.bfloat16).to(device)
    a = ops.combine(y, layout, tw, out_dtype=torch.bfloat16)
    b = ops.combine(y, layout, tw, out_dtype=torch.bfloat16, impl="torch")
    # identical up to a fused multiply-add on the GPU: the float32 sums differ in their last bits,
    # so the bf16 results by one unit in the last place at most. For |b| in [2**e, 2**(e+1)) that
    # unit is eps * 2**e <= eps * |b| (eps = 2**-7: bf16 keeps 8 significant bits); below the
    # smallest normal it is eps * tiny.
    finfo = torch.finfo(torch.bfloat16)
    assert ((a.float() - b.float()).abs() <= finfo.eps * b.float().abs() + finfo.eps * finfo.tiny).all()


# ------------------------------------------------------------- cutlass wiring, emulated GEMM


def emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs):
    """torch._scaled_grouped_mm (2-D A x 3-D B, row-wise scales, bf16 out) in float32 on any device.

    First the real operator's own checks run on meta tensors (layouts, strides, dtypes, scale
    shapes), so the call must be one the CUDA kernel accepts; then each group is multiplied."""
    meta = torch._scaled_grouped_mm(
        a.to("meta"), b.to("meta"), scale_a.to("meta"), scale_b.to("meta"),
        offs=offs.to("meta"), out_dtype=torch.bfloat16,
    )
    out = torch.zeros(meta.shape, dtype=torch.bfloat16, device=a.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            acc = a[start:end].float() @ b[e].float()
            out[start:end] = (acc * scale_a[start:end, None] * scale_b[e][None, :]).to(torch.bfloat16)
        start = end
    return out


# The cutlass pipeline rounds GEMM1's output h to bf16 before the SiLU (the reference keeps it in
# float32): up to 2**-8 relative on h flips the FP8 rounding of a few percent of the intermediate by
# one e4m3 step, and with a dynamic per-tensor scale a moved amax shifts every element's
# rounding. Emulated at GLM/Mixtral-like shapes (6 seeds each) this gives rel_l2 1.3e-2..2.5e-2
# and max_rel up to 3.1e-2 against the reference; small problems stay below 1.5e-2.
CUTLASS_TOL_L2 = 4e-2
CUTLASS_TOL_MAX = 8e-2

# The glue twins (Triton kernels, torch ops) on the same GEMM outputs h: their SiLU may differ by
# one bf16 unit in fewer than 1% of the intermediate's elements (test_silu_mul_unquantized's
# bound; none on the CPU, where the twins measure bitwise equal). A unit is 2**-4 of the e4m3
# step of the same value up to a factor 2 either way (8 significant bits against 4), so it
# crosses an FP8 rounding boundary with probability <= 2**-3, moving that element by one step
# (<= 2**-3 of itself): <= 2**-3 * sqrt(0.01 * 2**-3) = 4.4e-3 in relative L2, which GEMM2 carries
# over to the output. A flipped amax also moves its scale by up to 2**-7, and every element it
# scales then crosses a boundary with probability 2**-4..2**-3, by one step: ~2.6e-2 RMS over them.
# Per tensor (static) there is no amax: 5e-3. Per token one of the M*K = 10 rows:
# sqrt(4.4e-3**2 + 2.6e-2**2 / 10) = 9.3e-3: 1e-2. Per tensor (dynamic) every row: 3e-2 (as
# test_cutlass_gpu's EMULATION_TOL, for the same reason).
TWIN_TOL = {"fp8-tensor-static": 5e-3, "fp8-channel-token": 1e-2, "fp8-tensor-dynamic": 3e-2}


@pytest.mark.parametrize("scheme", ["fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token"])
def test_cutlass_wiring_with_emulated_gemm(device, scheme):
    E, H, N, M, K = 4, 64, 48, 5, 2
    w = random_weights(E, H, N, scheme, device=device, seed=2)
    x = random_x(M, H, device=device, seed=2)
    tw, ids = routing(M, E, K, device, experts=[0, 1, 3])  # expert 2 gets nothing
    out = cutlass.run_cutlass(x, w, tw, ids, gemm=emulated_scaled_grouped_mm, impl="triton")
    twin = cutlass.run_cutlass(x, w, tw, ids, gemm=emulated_scaled_grouped_mm, impl="torch")
    ref = reference_moe(x, w, tw, ids)
    assert out.shape == (M, H) and out.dtype == torch.bfloat16
    assert rel_l2(out, ref) < CUTLASS_TOL_L2 and max_rel(out, ref) < CUTLASS_TOL_MAX
    assert rel_l2(out, twin) < TWIN_TOL[scheme]  # rare SiLU last-bit flips (derived at TWIN_TOL)
    p = w.prepared["cutlass"]
    assert p.w13_t.data_ptr() == w.w13.data_ptr()  # the weights themselves, no copy
    assert p.w13_scale.shape == (E, 2 * N) and p.w2_scale.shape == (E, H)


@pytest.mark.parametrize("scheme", ["fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token"])
def test_cutlass_wiring_with_no_tokens(device, scheme):
    """The cutlass computation with zero rows (fused_moe returns before the backend at M = 0; the
    backend's own run() at M = 0 is test_cutlass_gpu's), with the emulated GEMM, whose meta call
    makes torch's own checks of the zero-row operands."""
    w = random_weights(3, 64, 48, scheme, device=device, seed=7)
    tw, ids = routing(0, 3, 2, device)
    for impl in ("triton", "torch"):
        out = cutlass.run_cutlass(random_x(0, 64, device=device), w, tw.float(), ids, gemm=emulated_scaled_grouped_mm,
                                  impl=impl)
        assert out.shape == (0, 64) and out.dtype == torch.bfloat16 and out.device.type == torch.device(device).type


def test_cutlass_supports_lists_every_reason():
    s = moekit.MoEShape(8, 200, 45, 2)
    reasons = moekit.get_backend("cutlass").supports(s, moekit.get_scheme("fp8-block128"), torch.device("cpu"), torch.float16)
    text = "\n".join(reasons)
    for needle in ("needs a CUDA device, got cpu", "128x128 block weights", "hidden 200 is not a multiple of 16",
                   "45 is not a multiple of 16", "bfloat16"):
        assert needle in text
    bf16 = moekit.get_backend("cutlass").supports(moekit.MoEShape(8, 256, 128, 2), moekit.get_scheme("bf16"), torch.device("cpu"))
    assert any("`torch` backend" in r for r in bf16)


@pytest.mark.parametrize("scheme", ["fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token"])
def test_cutlass_feeds_the_gemm_exactly(device, scheme):
    """What run_cutlass hands each GEMM, bit for bit: x quantized by the scheme's rule (scales
    written per row), the weights' own transposed views and per-column scales, and for GEMM2 the
    SiLU-and-mul of GEMM1's output requantized by the same rule (per-tensor: ONE scale)."""
    E, H, N, M, K = 4, 32, 16, 6, 2
    w = random_weights(E, H, N, scheme, device=device, seed=4)
    x = random_x(M, H, device=device, seed=4)
    tw, ids = routing(M, E, K, device, experts=[1, 2, 3])
    calls = []

    def spy(a, b, scale_a, scale_b, offs):
        out = emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs)
        calls.append((a, b, scale_a, scale_b, offs, out))
        return out

    cutlass.run_cutlass(x, w, tw, ids, gemm=spy, impl="triton")
    (a1, b1, sa1, sb1, offs1, h), (a2, b2, sa2, sb2, offs2, _) = calls
    _, _, layout = ops.permute(x, ids, E, impl="torch")
    rows = layout.row_of_pair.long()
    token = torch.arange(M * K, device=device) // K
    s = moekit.get_scheme(scheme)
    q, scale = quant.quantize_activation(x, s.activation, w.a13_scale)
    assert torch.equal(offs1, layout.offs) and torch.equal(offs2, layout.offs)
    assert torch.equal(bits(a1[rows]), bits(q[token]))
    assert torch.equal(sa1[rows], scale[token] if s.activation == "token" else scale.expand(M * K))
    assert b1.data_ptr() == w.w13.data_ptr() and b1.shape == (E, H, 2 * N) and b1.stride(1) == 1
    assert b2.data_ptr() == w.w2.data_ptr() and b2.shape == (E, N, H) and b2.stride(1) == 1
    cols13 = w.w13_scale if s.weight == "channel" else w.w13_scale[:, None].expand(E, 2 * N)
    cols2 = w.w2_scale if s.weight == "channel" else w.w2_scale[:, None].expand(E, H)
    assert torch.equal(sb1, cols13) and torch.equal(sb2, cols2)
    plain, _ = ops.silu_mul(h, layout, act_dtype=torch.bfloat16, impl="triton")
    q2, scale2 = quant.quantize_activation(plain[rows], s.activation, w.a2_scale)
    assert torch.equal(bits(a2[rows]), bits(q2))
    assert torch.equal(sa2[rows], scale2 if s.activation == "token" else scale2.expand(M * K))


# ------------------------------------------------------------------------------- input check


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("rows", [500, 1500])  # 2500 ids: one program; 7500: one per block
def test_ids_in_range_is_one_device_side_flag(device, dtype, rows):
    """fused_moe's id check on a GPU (validate_inputs asserts on this flag): every id in [0, E)
    gives 1; a single id below 0 or at E gives 0, wherever it sits: past the first block of ids
    the one program reads, or in any block of the several-program form."""
    E = 7
    ids = torch.randint(0, E, (rows, 5), generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    assert (ids.numel() <= ops.IDS_ONE_PROGRAM_MAX) == (rows == 500) and ids.numel() > 2 * ops.IDS_CHECK_BLOCK
    ok = ops.ids_in_range(ids, E)
    assert ok.dtype == torch.int32 and ok.shape == (1,) and ok.device == ids.device and int(ok) == 1
    low = -(2**31) if dtype == torch.int32 else -(2**40)
    for where, value in ((0, -1), (1234, E), (ids.numel() - 1, E + 1000), (2047, low)):
        bad = ids.clone()
        bad.view(-1)[where] = value
        assert int(ops.ids_in_range(bad, E)) == 0, (where, value)
    assert int(ops.ids_in_range(ids[:, ::2], E)) == 1  # not contiguous: checked on a copy
    assert int(ops.ids_in_range(torch.full((1, 1), E - 1, dtype=dtype, device=device), E)) == 1


def test_fused_moe_id_assertion_names_the_range():
    """The GPU branch of validate_inputs (moekit.api.assert_ids_in_range): under the interpreter
    on the CPU torch._assert_async raises at once, with fused_moe's message. Interpreter only: on a
    GPU machine CPU tensors cannot reach the compiled checking kernel, and on GPU tensors the out-
    of-range call would be a device-side assertion, which ends the process's CUDA context for every
    later test (test_triton_id_check's GPU test runs that in a child process)."""
    from moekit.api import assert_ids_in_range

    if not ops.interpreting():
        pytest.skip("the checking kernel runs on CPU tensors only under TRITON_INTERPRET=1")
    assert_ids_in_range(torch.tensor([[0, 6], [3, 1]]), 7)  # in range: nothing happens
    with pytest.raises(RuntimeError, match=r"moekit: topk_ids outside \[0, 7\)"):
        assert_ids_in_range(torch.tensor([[0, 7]]), 7)


def test_glue_launches_ask_for_fp_fusion_on_a_gpu(monkeypatch):
    """Every glue kernel launch passes backends.triton_options' FP fusion on a GPU (Triton 3.10
    turns it off by default; the glue's roundings were measured with it), none under the
    interpreter, which takes no compile options."""
    from helpers import RecordingKernel
    from moekit.backends.glue import _kernels as k

    calls = []
    monkeypatch.setattr(k, "_ids_in_range_kernel", RecordingKernel(["ids_ptr"], calls))
    ids = torch.zeros(4, 2, dtype=torch.int32)
    monkeypatch.setattr(ops, "interpreting", lambda: False)
    ops.ids_in_range(ids, 8)
    monkeypatch.setattr(ops, "interpreting", lambda: True)
    ops.ids_in_range(ids, 8)
    assert calls[0]["enable_fp_fusion"] is True and "enable_fp_fusion" not in calls[1]
    source = Path(ops.__file__).read_text()  # and every launch site of the module passes them
    assert source.count("launch(k._") == source.count("**_options()") > 0 and "_kernel[" not in source
