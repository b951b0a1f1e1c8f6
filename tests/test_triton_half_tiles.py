"""Half-height tiles (_kernels._half_tile): with BLOCK_M 128, an expert's last row block holding
at most 64 real rows runs the same GEMM at half the height. Against the reference on every
scheme and both accumulation modes, with row counts that send some experts' last blocks down
each path; on a GPU also at the preset shapes (deterministic, CUDA-graph replay).

Half-width tails (launch._half_tail): GEMM1's last column block holding at most BLOCK_N // 2
real columns runs at half the width, alone and together with half-height rows."""

import pytest
import torch

import moekit
from moekit.accumulation import accumulation_matters
from moekit.backends.triton import KernelConfig, launch
from moekit.spec import get_scheme

from helpers import assert_graph_replays_fresh_routing, max_rel, random_routing, random_weights, random_x, rel_l2
from test_triton_backend import (FAST_REL_L2_TOL, PRESET_SHAPES, REL_L2_TOL, SCHEMES, assert_matches_reference,
                                 max_rel_tol, reference_for)

# 150 tokens, top-2: experts 0, 1, 2, 4 receive 140, 100, 5 and 55 pairs, expert 3 none; with
# 128-row blocks the last blocks hold 12, 100, 5 and 55 real rows: three half tiles, one full
# tile, and a full first block for expert 0.
COUNTS = {0: 140, 1: 100, 2: 5, 4: 55}


def skewed_routing(device):
    pool = torch.tensor([e for e, n in COUNTS.items() for _ in range(n)])
    ids = torch.stack([pool[:150], pool[150:]], dim=1).to(torch.int32)  # two distinct experts per token
    assert (ids[:, 0] != ids[:, 1]).all()
    tw = torch.softmax(torch.randn(150, 2, generator=torch.Generator().manual_seed(3)), dim=1)
    return tw.to(device), ids.to(device)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("accumulation", ["precise", "fast"])
def test_half_tiles_match_the_reference(scheme, accumulation, device, monkeypatch):
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", accumulation)
    n = 256 if scheme == "fp8-block128" else 208  # 128x128 weight blocks need N a multiple of 128
    w = random_weights(5, 160, n, scheme, device=device)
    tw, ids = skewed_routing(device)
    x = random_x(150, 160, device=device)
    last = torch.tensor([c % 128 or 128 for c in COUNTS.values()])
    assert (last <= 64).any() and (last > 64).any()  # both heights run
    cfg = KernelConfig(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64 if scheme == "bf16" else 128, GROUP_M=2)
    out = moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)
    ref = reference_for(x, w, tw, ids)
    assert rel_l2(out, ref) < REL_L2_TOL and max_rel(out, ref) < max_rel_tol(out), rel_l2(out, ref)


@pytest.mark.parametrize("scheme", ["fp8-channel-token", "fp8-block128"])
@pytest.mark.parametrize("accumulation", ["precise", "fast"])
def test_half_tiles_at_the_boundary_with_the_fused_group_quantization(scheme, accumulation, device, monkeypatch):
    """Experts with 64, 65, 192 and 193 rows (top-1): last blocks of exactly half a tile (runs at
    half height), one row more (must run full: a half tile would drop the 65th row), and the same
    after a full block. BLOCK_N 128, so GEMM1 quantizes the intermediate per 1x128 group in its
    epilogue and GEMM2 reads the group scales (precise mode), or the per-row pass runs (fast)."""
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", accumulation)
    counts = (64, 65, 192, 193)
    ids = torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in enumerate(counts)])[:, None]
    M = ids.shape[0]
    tw = torch.ones(M, 1)
    w = random_weights(4, 256, 256, scheme, device=device)
    x = random_x(M, 256, device=device)
    ids, tw = ids.to(device), tw.to(device)
    cfg = KernelConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=2)
    out = moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)
    ref = reference_for(x, w, tw, ids)
    assert rel_l2(out, ref) < REL_L2_TOL and max_rel(out, ref) < max_rel_tol(out), rel_l2(out, ref)
    assert (out.float().abs().amax(dim=1) > 0).all()  # no row left unwritten


@pytest.mark.gpu
@pytest.mark.parametrize("name", PRESET_SHAPES)
@pytest.mark.parametrize("accumulation", ["precise", "fast"])
def test_gpu_half_tiles_at_preset_shapes(name, accumulation, monkeypatch):
    """128-row tiles at M = 600 (2-38 rows per expert on the 128/256-expert shapes, so nearly
    every block is an expert's last and many are half tiles; Mixtral's 150 per expert end in
    22-row halves): against the reference, bitwise stable, and replayed in a CUDA graph with
    fresh routing (which moves blocks between the two heights)."""
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", accumulation)
    E, H, N, K, scheme = PRESET_SHAPES[name]
    w = random_weights(E, H, N, scheme, device="cuda")
    cfg = KernelConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)
    tw, ids = random_routing(600, E, K, device="cuda")
    x = random_x(600, H, device="cuda")
    run = lambda x, tw, ids: moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)  # noqa: E731
    out = run(x, tw, ids)
    if accumulation == "fast" and accumulation_matters(get_scheme(scheme)):
        # the tensor cores' own FP8 sums: fast mode's bound (measured 1.5e-2 and 1.6e-2 here)
        assert rel_l2(out, reference_for(x, w, tw, ids)) < FAST_REL_L2_TOL
    else:
        assert_matches_reference(out, x, w, tw, ids)
    assert torch.equal(out, run(x, tw, ids))
    assert_graph_replays_fresh_routing(run, x, tw, ids, E)


@pytest.mark.parametrize("width, block_n, joined, want", [
    (704, 128, 0, 1),  # GLM-4.5V at TP2: 5 tiles and 64 columns
    (192, 128, 0, 1),  # exactly half a tile left
    (200, 128, 0, 0),  # 72 > 64: the half would drop columns
    (768, 128, 0, 0),  # whole tiles only
    (704, 128, 1, 0),  # JOIN's interleaved tile has no half
    (40, 32, 0, 1),  # a 16-wide half: tl.dot's least
    (20, 16, 0, 0),  # an 8-wide half would be below it
])
def test_half_width_tail_rule(width, block_n, joined, want):
    assert launch._half_tail(width, block_n, joined) == want


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("accumulation, n, block_m", [
    ("precise", 192, 128), ("precise", 200, 128), ("precise", 136, 16),
    # fast mode's FP8 tiles of 64+ rows use JOIN's tile, which has no half: 16-row tiles here
    ("fast", 136, 16),
])
def test_half_width_tail_matches_the_reference(scheme, accumulation, n, block_m, device, monkeypatch):
    """GEMM1's last column block at half width (N = 192 or 136: 64 or 8 of 128 columns left; 128-row
    tiles with the skewed routing also run half-height rows in it, every scheme's quantization of
    the intermediate included, the per-1x128-group epilogue of BLOCK_N 128) and at full width
    (N = 200: 72 left), against the reference; also with the half-width tail switched off, which
    must give the same output: bitwise on a GPU (the same sums of the same products per column).
    The interpreter multiplies with numpy, whose float32 summation order may depend on the tile's
    width (bf16 at N = 192 with 64-row tiles differed, 2026-12-04; most cases come out bitwise
    equal), so there a bf16 output may move by one rounding step (2^-8 relative) in a few elements:
    1e-3 relative L2 admits that, not a wrong or missing column (relative L2 near 1 on it)."""
    if scheme == "fp8-block128":
        pytest.skip("128x128 weight blocks need N a multiple of 128: no tail column block")
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", accumulation)
    w = random_weights(5, 160, n, scheme, device=device)
    tw, ids = skewed_routing(device)
    x = random_x(150, 160, device=device)
    cfg = KernelConfig(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64 if scheme == "bf16" else 128, GROUP_M=2)
    run = lambda: moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)  # noqa: E731
    out = run()
    ref = reference_for(x, w, tw, ids)
    assert rel_l2(out, ref) < REL_L2_TOL and max_rel(out, ref) < max_rel_tol(out), rel_l2(out, ref)
    monkeypatch.setattr(launch, "HALF_WIDTH_TAIL", False)
    full_width = run()
    if device.type == "cuda":
        assert torch.equal(full_width, out)
    else:
        assert rel_l2(out, full_width) < 1e-3


def test_half_width_tail_reaches_the_kernel(device, monkeypatch):
    """The launch passes HALF_TAIL = 1 at a 64-column tail (and the switch turns it off)."""
    seen = []
    real = launch._launch

    def record(kernel, grid, *args, **kwargs):
        if "HALF_TAIL" in kwargs:
            seen.append(kwargs["HALF_TAIL"])
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(launch, "_launch", record)
    w = random_weights(3, 128, 192, "fp8-channel-token", device=device)  # launched for real: CUDA or the interpreter
    tw, ids = random_routing(5, 3, 2, device=device)
    cfg = KernelConfig(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128)
    moekit.get_backend("triton").run(random_x(5, 128, device=device), w, tw, ids, config=cfg)
    monkeypatch.setattr(launch, "HALF_WIDTH_TAIL", False)
    moekit.get_backend("triton").run(random_x(5, 128, device=device), w, tw, ids, config=cfg)
    assert seen == [1, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("accumulation, block_m", [("precise", 64), ("precise", 128), ("fast", 16)])
def test_gpu_half_width_tail_at_glm_shape(accumulation, block_m, monkeypatch):
    """GLM-4.5V at TP2 (N = 704: the last of six 128-wide column blocks holds 64 columns) at
    M = 600 and 3000: against the reference, bitwise equal to the full-width tail, and replayed
    in a CUDA graph with fresh routing. Fast mode with 16-row tiles: its FP8 tiles of 64+ rows
    use JOIN's tile, which has no half (so the comparison would be of a launch with itself)."""
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", accumulation)
    E, H, N, K, scheme = PRESET_SHAPES["glm-4.5v-fp8 tp2"]
    assert launch._half_tail(N, 128, launch._joined(get_scheme(scheme), KernelConfig(BLOCK_M=block_m, BLOCK_N=128))) == 1
    w = random_weights(E, H, N, scheme, device="cuda")
    cfg = KernelConfig(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
    run = lambda x, tw, ids: moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)  # noqa: E731
    for M in (600, 3000):
        tw, ids = random_routing(M, E, K, device="cuda", seed=M)
        x = random_x(M, H, device="cuda")
        out = run(x, tw, ids)
        if accumulation == "fast":
            assert rel_l2(out, reference_for(x, w, tw, ids)) < FAST_REL_L2_TOL
        else:
            assert_matches_reference(out, x, w, tw, ids)
        monkeypatch.setattr(launch, "HALF_WIDTH_TAIL", False)
        assert torch.equal(run(x, tw, ids), out)
        monkeypatch.setattr(launch, "HALF_WIDTH_TAIL", True)
    assert_graph_replays_fresh_routing(run, x, tw, ids, E)
