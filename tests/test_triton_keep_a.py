"""GEMM2 keeping its row block's activations across a run of column tiles (KernelConfig.KEEP_A2,
_kernels._gemm2_resident_run): the config rules, the refusal of an intermediate longer than two K
steps, and the layer against `reference` and bitwise equal to the same runs reloading A per tile,
for every scheme and accumulation mode, at odd sizes, idle experts, half-height tiles, M = 1 and
M = 0 (CPU interpreter; the preset shapes it fits on a GPU)."""

import dataclasses

import pytest
import torch

import moekit
from moekit.backends.triton import KernelConfig, _kernels, launch
from moekit.backends.triton.launch import FP8_ACCUMULATION_ENV
from moekit.spec import get_scheme

from helpers import assert_graph_replays_fresh_routing, random_routing, random_weights, random_x
from test_triton_backend import PRESET_SHAPES, SCHEMES, assert_matches_reference, with_accumulation_modes

BASE = KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=2)
BLOCK = get_scheme("fp8-block128")


def run(x, w, tw, ids, cfg):
    return moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)


# ------------------------------------------------------------------------------ config rules


def test_keep_a_is_gemm2s_alone_and_needs_a_run_of_triton_tiles():
    cfg = BASE.with_gemm2(N_TILES=4, KEEP_A=1)
    assert cfg.KEEP_A2 == 1 and cfg.has_gemm2 and cfg.gemm2().KEEP_A2 == 1 and cfg.gemm1().KEEP_A2 == 0
    assert cfg.problems(BLOCK) == []
    assert cfg.to_dict()["KEEP_A2"] == 1 and "KEEP_A2" not in BASE.with_gemm2(N_TILES=4).to_dict()
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    alone = BASE.with_gemm2(KEEP_A=1)
    assert any("needs N_TILES2 > 1" in p for p in alone.problems(BLOCK))
    gluon = KernelConfig(128, 128, 128, 8, 8, 4).with_gemm2(N_TILES=4, KEEP_A=1, OVERLAP=1)
    assert any("KEEP_A2=1 is a form of the Triton GEMM2" in p for p in gluon.problems(get_scheme("fp8-channel-token")))
    assert any("KEEP_A2=2 must be 0 or 1" in p for p in BASE.with_gemm2(N_TILES=4, KEEP_A=2).problems(BLOCK))


def test_keep_a_fits_an_intermediate_of_two_k_steps_at_most():
    cfg = BASE.with_gemm2(N_TILES=4, KEEP_A=1)
    assert cfg.keep_a2_fits(256) and cfg.keep_a2_fits(96) and not cfg.keep_a2_fits(257)
    assert dataclasses.replace(cfg, BLOCK_K=64).keep_a2_fits(128) and not dataclasses.replace(cfg, BLOCK_K=64).keep_a2_fits(129)


def test_a_longer_intermediate_is_refused_before_any_launch(device, monkeypatch):
    launched = []
    monkeypatch.setattr(launch, "_launch", lambda kernel, *a, **kw: launched.append(kernel))
    w = random_weights(3, 128, 384, "fp8-block128", device=device)  # three K steps of 128
    tw, ids = random_routing(5, 3, 2, device=device)
    with pytest.raises(ValueError, match="KEEP_A2=1 holds GEMM2's inner dimension in at most 2 K steps of 128; "
                                         "this layer's intermediate has 384 columns"):
        run(random_x(5, 128, device=device), w, tw, ids, BASE.with_gemm2(N_TILES=4, KEEP_A=1))
    assert launched == []


def test_the_launch_passes_the_k_steps_it_keeps(device, monkeypatch):
    seen = []
    real = launch._launch

    def record(kernel, grid, *args, **kwargs):
        if kernel is _kernels.gemm2_kernel:
            seen.append(kwargs["KEEP_A_STEPS"])
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(launch, "_launch", record)
    tw, ids = random_routing(5, 3, 2, device=device)
    for n, steps in ((128, 1), (200, 2)):
        w = random_weights(3, 128, n, "fp8-channel-token", device=device)
        run(random_x(5, 128, device=device), w, tw, ids, BASE.with_gemm2(N_TILES=2, KEEP_A=1))
        run(random_x(5, 128, device=device), w, tw, ids, BASE.with_gemm2(N_TILES=2))
    assert seen == [1, 0, 2, 0]


# ------------------------------------------------------------------------------ the kernel


@pytest.mark.parametrize("scheme,accumulation", with_accumulation_modes(SCHEMES))
def test_kept_activations_match_reloaded_ones(scheme, accumulation, device, monkeypatch):
    """Runs of 2 and all 7 of GEMM2's 32-wide column blocks (hidden 208: the last one partial),
    with the intermediate in one K step (96 columns, partial) or two (200: the second partial),
    on 16-row blocks and on 128-row ones (an expert's last block at half height), an idle
    expert, M = 37 at top-2: against reference, and bitwise equal to the same runs loading A
    per tile, whose products, scales and epilogue are the same in the same order. 128x128 weight
    blocks take whole blocks of the intermediate: 128 and 256 columns there."""
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, accumulation)
    gemm1_n = 64 if scheme == "fp8-block128" else 128
    for n in (128, 256) if scheme == "fp8-block128" else (96, 200):
        w = random_weights(4, 208, n, scheme, device=device, seed=7)
        tw, ids = random_routing(37, 4, 2, device=device, experts=[0, 2, 3])
        x = random_x(37, 208, device=device)
        for block_m in (16, 128):
            reload = dataclasses.replace(BASE, BLOCK_M=block_m, BLOCK_N=gemm1_n).with_gemm2(BLOCK_N=32, num_stages=3)
            for n_tiles in (2, 7):
                reloaded = run(x, w, tw, ids, reload.with_gemm2(N_TILES=n_tiles))
                kept = run(x, w, tw, ids, reload.with_gemm2(N_TILES=n_tiles, KEEP_A=1))
                assert torch.equal(kept, reloaded), (n, block_m, n_tiles)
            assert_matches_reference(kept, x, w, tw, ids)


def test_m_one_and_m_zero_with_kept_activations(device):
    w = random_weights(3, 128, 256, "fp8-block128", device=device)
    cfg = BASE.with_gemm2(BLOCK_N=32, N_TILES=3, KEEP_A=1)  # 4 column tiles: a run of 3, then of 1
    tw, ids = random_routing(1, 3, 2, device=device)
    x = random_x(1, 128, device=device)
    assert_matches_reference(run(x, w, tw, ids, cfg), x, w, tw, ids)
    empty = run(x[:0], w, tw[:0], ids[:0], cfg)
    assert empty.shape == (0, 128) and empty.dtype == x.dtype


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n, (_, _, N, _, _) in PRESET_SHAPES.items() if N <= 256])
def test_gpu_preset_shapes_with_kept_activations(name):
    """The preset shapes whose intermediate fits two K steps (DeepSeek-V3 at TP8), at the tables'
    prefill tile (64 rows, GEMM2 64 wide on 4 warps, runs of 8) and with 128-row blocks: against
    reference, bitwise equal to the runs reloading A, and under graph replay with fresh routing."""
    E, H, N, K, scheme = PRESET_SHAPES[name]
    w = random_weights(E, H, N, scheme, device="cuda")
    M = 300
    tw, ids = random_routing(M, E, K, device="cuda")
    x = random_x(M, H, device="cuda")
    for block_m in (64, 128):
        reload = KernelConfig(block_m, 128, 128, 8, 8, 4).with_gemm2(BLOCK_N=64, num_warps=4, num_stages=3, N_TILES=8)
        cfg = reload.with_gemm2(KEEP_A=1)
        out = assert_matches_reference(run(x, w, tw, ids, cfg), x, w, tw, ids)
        assert torch.equal(out, run(x, w, tw, ids, reload))
        assert torch.equal(out, run(x, w, tw, ids, cfg))
        assert_graph_replays_fresh_routing(lambda x, tw, ids: run(x, w, tw, ids, cfg), x, tw, ids, E)
