"""GEMM1's own K step (KernelConfig.BLOCK_K with GEMM2's BLOCK_K2): per-token schemes apply their
activation and weight scales after GEMM1's K loop, so GEMM1 may read K in steps wider than the
128 that GEMM2's 1x128-group intermediate ties GEMM2 to. The config rules, the key, the
promotion interval, and the layer against `reference` at odd sizes, idle experts, M = 1 and 0
(CPU interpreter; preset shapes and bitwise equality with 128-long steps on a GPU)."""

import dataclasses

import pytest
import torch

import moekit
from moekit.backends.triton import KernelConfig, _kernels, launch
from moekit.backends.triton.launch import FP8_ACCUMULATION_ENV
from moekit.spec import get_scheme
from moekit.tune.output import vllm_config
from moekit.tune.space import config_from_key, config_key

from helpers import assert_graph_replays_fresh_routing, random_routing, random_weights, random_x, rel_l2
from test_triton_backend import (FAST_REL_L2_TOL, PRESET_SHAPES, assert_matches_reference, reference_for,
                                 with_accumulation_modes)

STEP128 = KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=2)
WIDE = dataclasses.replace(STEP128, BLOCK_K=256).with_gemm2(BLOCK_K=128)  # GEMM1 256, GEMM2 128
TOKEN = get_scheme("fp8-channel-token")
# the schemes whose GEMM1 applies its scales after the K loop (per token / per tensor activations)
PER_TOKEN_OR_TENSOR = ["bf16", "fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token"]


def run(x, w, tw, ids, cfg):
    return moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)


# ------------------------------------------------------------------------------ config rules


def test_gemm1_k_step_is_gemm1s_alone():
    assert WIDE.BLOCK_K == 256 and WIDE.BLOCK_K2 == 128 and WIDE.has_gemm2
    assert WIDE.gemm1().BLOCK_K == 256 and not WIDE.gemm1().has_gemm2
    assert WIDE.gemm2() == STEP128  # everything else is GEMM1's
    assert STEP128.with_gemm2(BLOCK_K=128) == STEP128  # the same as GEMM1's: stored as unset


def test_a_wider_k_step_runs_gemm1_of_per_token_schemes_only():
    # one K step for both GEMMs: GEMM2's 1x128-group intermediate refuses it, and the message says
    # how to give GEMM1 alone the wider step
    both = dataclasses.replace(STEP128, BLOCK_K=256)
    assert both.problems(TOKEN) == ["BLOCK_K=256 must be 128 for fp8-channel-token's GEMM2 (it reads an intermediate "
                                    "quantized per 1x128 group); GEMM1 alone may take wider steps, with BLOCK_K2=128 "
                                    "for GEMM2"]
    assert WIDE.problems(TOKEN) == []
    assert dataclasses.replace(WIDE, BLOCK_K=512).problems(TOKEN) == []
    assert WIDE.with_gemm2(BLOCK_K=256) == both  # GEMM2's step the same as GEMM1's: stored as unset
    assert both.with_gemm2(BLOCK_N=32).problems(TOKEN) == [  # a GEMM2 launch of its own, with GEMM1's step
        "GEMM2: BLOCK_K=256 must be 128 for fp8-channel-token's GEMM2 (it reads an intermediate quantized per 1x128 group)"]
    # 1x128-group activations and 128x128 weight blocks change their scales every 128 of K in GEMM1
    assert WIDE.problems(get_scheme("fp8-block128")) == [
        "BLOCK_K=256 must be 128 for fp8-block128 (its scales change every 128 of K)"]
    # per-tensor activations and bf16: one scale per tensor (or none), any step in both GEMMs
    for name in ("bf16", "fp8-tensor-static", "fp8-tensor-dynamic"):
        assert both.problems(get_scheme(name)) == [] and WIDE.problems(get_scheme(name)) == []
    # the Gluon GEMM1 has its fixed tile, the GEMV path no GEMM2 K step of its own
    assert any("OVERLAP=1 runs" in p for p in dataclasses.replace(WIDE, BLOCK_M=64, BLOCK_N=128, num_warps=8,
                                                                   num_stages=3, OVERLAP=1).problems(TOKEN))
    gemv = KernelConfig(16, 8, 512, 1, 4, 1, GEMV=1, BLOCK_K2=128)
    assert "BLOCK_K2 is for the tiled path; the GEMV path (GEMV=1) takes only" in gemv.problems(TOKEN)[0]
    with pytest.raises(ValueError, match="gemm='GEMM1': expected 'both', 'gemm1' or 'gemm2'"):
        both.problems(TOKEN, "GEMM1")


def test_key_dict_and_table_entry_name_gemm2s_k_step_where_its_own():
    assert config_key(WIDE) == "M16-N64-K256-G8-w4-s2+N64-K128-G8-w4-s2"
    assert config_from_key(config_key(WIDE)) == WIDE
    # keys without GEMM2's K step (every journal before it) still read as before
    assert config_from_key("M16-N64-K128-G8-w4-s2+N32-G8-w4-s3").BLOCK_K2 == 0
    assert config_from_key("M16-N64-K128-G8-w4-s2+N32-G8-w4-s3") == STEP128.with_gemm2(BLOCK_N=32, num_stages=3)
    assert WIDE.to_dict()["BLOCK_K2"] == 128 and "BLOCK_K2" not in STEP128.to_dict()
    assert KernelConfig.from_dict(WIDE.to_dict()) == WIDE
    assert KernelConfig.from_table_entry({**WIDE.to_dict(), "us": 1.0}) == WIDE
    cfg, why = vllm_config(WIDE, TOKEN)  # vLLM's kernel has one BLOCK_SIZE_K for both GEMMs
    assert cfg is None and "GEMM2 has a launch config of its own" in why


@pytest.mark.parametrize("accumulation,expected", [("precise", (128, 128)), ("fast", (0, 0))])
def test_precise_mode_promotes_every_128_of_k_whatever_the_step(accumulation, expected, monkeypatch):
    """A 256-long step is two promotions, in the order two 128-long steps make them: the sums do
    not change with the step (checked bitwise on a GPU below)."""
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, accumulation)
    assert (launch.fp8_promote(WIDE.gemm1()), launch.fp8_promote(WIDE.gemm2())) == expected
    assert launch.fp8_promote(dataclasses.replace(STEP128, BLOCK_K=64)) == (64 if accumulation == "precise" else 0)


# ------------------------------------------------------------------------------ the kernels


@pytest.mark.parametrize("scheme,accumulation", with_accumulation_modes(PER_TOKEN_OR_TENSOR))
def test_gemm1_in_wide_k_steps_matches_reference(scheme, accumulation, device, monkeypatch):
    """Hidden 400 (GEMM1 reads one whole step of 256 and a partial one of 144, or one partial
    step of 512) and intermediate 208 (GEMM2: a whole step of 128 and a partial one), an idle
    expert, M = 7 with top-2. On the CPU also bitwise equal to steps of 128:
    the interpreter sums each element's K in the same order whatever the step."""
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, accumulation)
    w = random_weights(4, 400, 208, scheme, device=device, seed=11)
    tw, ids = random_routing(7, 4, 2, device=device, experts=[0, 1, 3])
    x = random_x(7, 400, device=device)
    # fp8-channel-token's precise intermediate takes 128-wide groups; bf16's 128 x 512 weight tiles
    # would need twice FP8's shared memory (272 KiB on two stages, over the H100's 227 KiB)
    narrow = dataclasses.replace(STEP128, BLOCK_N=128 if get_scheme(scheme).is_fp8 else 64)
    for k in (256, 512):
        cfg = dataclasses.replace(narrow, BLOCK_K=k).with_gemm2(BLOCK_K=128)
        out = assert_matches_reference(run(x, w, tw, ids, cfg), x, w, tw, ids)
        if device.type == "cpu":
            assert torch.equal(out, run(x, w, tw, ids, narrow)), k


@pytest.mark.parametrize("top_k", [1, 8])
def test_m_one_m_zero_and_top_k_with_wide_gemm1_steps(top_k, device):
    w = random_weights(9, 256, 128, "fp8-channel-token", device=device, seed=2)
    cfg = dataclasses.replace(WIDE, BLOCK_N=128)
    for M in (1, 13):
        tw, ids = random_routing(M, 9, top_k, device=device)
        x = random_x(M, 256, device=device)
        assert_matches_reference(run(x, w, tw, ids, cfg), x, w, tw, ids)
    empty = run(x[:0], w, tw[:0], ids[:0], cfg)
    assert empty.shape == (0, 256) and empty.dtype == x.dtype


def test_each_gemm_is_launched_with_its_own_k_step(device, monkeypatch):
    launches = {}
    real = launch._launch

    def record(kernel, grid, *args, **kwargs):
        launches[kernel] = {k: kwargs[k] for k in ("BLOCK_K", "PROMOTE") if k in kwargs}
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(launch, "_launch", record)
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "precise")
    w = random_weights(3, 256, 128, "fp8-channel-token", device=device)  # launched for real: CUDA or the interpreter
    tw, ids = random_routing(5, 3, 2, device=device)
    run(random_x(5, 256, device=device), w, tw, ids, dataclasses.replace(WIDE, BLOCK_N=128))
    assert launches[_kernels.gemm1_kernel] == dict(BLOCK_K=256, PROMOTE=128)
    assert launches[_kernels.gemm2_kernel] == dict(BLOCK_K=128, PROMOTE=128)


@pytest.mark.gpu
@pytest.mark.parametrize("accumulation", ["precise", "fast"])
@pytest.mark.parametrize("name", [n for n, shape in PRESET_SHAPES.items() if shape[4] == "fp8-channel-token"])
def test_gpu_preset_shapes_with_wide_gemm1_steps(name, accumulation, monkeypatch):
    """The per-token presets (GLM-4.5V TP2, Mixtral-8x7B) at decode tiles with GEMM1 in steps of
    256 (vLLM's tuned step at these sizes): against reference, bitwise repeatable, under graph
    replay with fresh routing, and in precise mode bitwise equal to steps of 128 (the compiler
    promotes every 128 of K inside a 256-long dot, launch.fp8_promote)."""
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, accumulation)
    E, H, N, K, scheme = PRESET_SHAPES[name]
    w = random_weights(E, H, N, scheme, device="cuda")
    # 256-long steps of 16 rows x (64 gate + 64 up) columns: 36 KiB a stage, 4 stages; of 16 x (128 +
    # 128): 68 KiB, 2 stages (128 wide: precise mode's intermediate quantized per 1x128 group inside
    # GEMM1's epilogue, OUT_MODE 3; 64 wide: in a pass of its own)
    for M, base in ((8, KernelConfig(16, 64, 128, 1, 4, 4)), (64, KernelConfig(16, 128, 128, 1, 8, 2))):
        cfg = dataclasses.replace(base, BLOCK_K=256).with_gemm2(BLOCK_K=128)
        tw, ids = random_routing(M, E, K, device="cuda")
        x = random_x(M, H, device="cuda")
        out = run(x, w, tw, ids, cfg)
        if accumulation == "fast":
            assert rel_l2(out, reference_for(x, w, tw, ids)) < FAST_REL_L2_TOL  # test_triton_backend's bound
        else:
            assert_matches_reference(out, x, w, tw, ids)
            assert torch.equal(out, run(x, w, tw, ids, base)), (name, M)
        assert torch.equal(out, run(x, w, tw, ids, cfg))
        assert_graph_replays_fresh_routing(lambda x, tw, ids: run(x, w, tw, ids, cfg), x, tw, ids, E)


def test_keep_a2_is_checked_against_gemm2s_k_step(device):
    """KEEP_A2 holds GEMM2's inner dimension in at most six of GEMM2's K steps: with GEMM1 in
    steps of 256 and GEMM2 in 64, an intermediate of 512 (8 steps of 64) is refused naming 64."""
    w = random_weights(3, 128, 512, "bf16", device=device)
    tw, ids = random_routing(4, 3, 2, device=device)
    cfg = KernelConfig(16, 64, 256, 8, 4, 2).with_gemm2(BLOCK_K=64, N_TILES=2, KEEP_A=1)
    assert cfg.keep_a2_fits(384) and not cfg.keep_a2_fits(385)
    with pytest.raises(ValueError, match="at most 6 K steps of 64; this problem's intermediate has 512 columns"):
        run(random_x(4, 128, device=device), w, tw, ids, cfg)
