"""Half-height tiles (_kernels._half_tile): with BLOCK_M 128, an expert's last row block holding
at most 64 real rows runs the same GEMM at half the height. Against the reference on every
scheme and both accumulation modes, with row counts that send some experts' last blocks down
each path; on a GPU also at the preset shapes (deterministic, CUDA-graph replay)."""

import pytest
import torch

import moekit
from moekit.accumulation import accumulation_matters
from moekit.backends.triton import KernelConfig
from moekit.spec import get_scheme

from helpers import assert_graph_replays_fresh_routing, max_rel, random_routing, random_weights, random_x, rel_l2
from test_triton_backend import (FAST_REL_L2_TOL, MAX_REL_TOL, PRESET_SHAPES, REL_L2_TOL, SCHEMES, assert_matches_reference,
                                 reference_for)

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
    assert rel_l2(out, ref) < REL_L2_TOL and max_rel(out, ref) < MAX_REL_TOL, rel_l2(out, ref)


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
    assert rel_l2(out, ref) < REL_L2_TOL and max_rel(out, ref) < MAX_REL_TOL, rel_l2(out, ref)
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
