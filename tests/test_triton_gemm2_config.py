"""GEMM2's own launch (KernelConfig.BLOCK_N2 / num_warps2 / num_stages2 / GROUP_M2, and N_TILES2:
runs of column tiles per program): the config rules, and the layer against `reference` with GEMM2 tiled unlike GEMM1, for every scheme, in both
accumulation modes where the mode changes the scheme's kernels, at odd sizes and with idle experts (CPU interpreter; preset shapes on a GPU)."""

import dataclasses
import json

import pytest
import torch

import moekit
from moekit.accumulation import accumulation_matters
from moekit.backends.triton import KernelConfig, _kernels, launch
from moekit.backends.triton.config import get_config
from moekit.backends.triton.launch import FP8_ACCUMULATION_ENV
from moekit.spec import get_scheme
from moekit.tune.output import vllm_config
from moekit.tune.space import config_key

from helpers import assert_graph_replays_fresh_routing, random_routing, random_weights, random_x, rel_l2
from test_triton_backend import (FAST_REL_L2_TOL, PRESET_SHAPES, SCHEMES, assert_matches_reference, reference_for,
                                 with_accumulation_modes)

BASE = KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=2)


def run(x, w, tw, ids, cfg):
    return moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)


# ------------------------------------------------------------------------------ config rules


def test_gemm2_launch_takes_its_own_fields_and_only_those():
    cfg = BASE.with_gemm2(BLOCK_N=32, num_warps=2, num_stages=3, GROUP_M=1)
    assert cfg.gemm2() == KernelConfig(16, 32, 128, 1, 2, 3)  # BLOCK_M and BLOCK_K stay GEMM1's
    assert BASE.gemm2() is BASE and not BASE.has_gemm2 and cfg.has_gemm2
    assert BASE.with_gemm2(BLOCK_N=64, num_stages=2) == BASE  # the same as GEMM1's: stored as unset
    assert KernelConfig(16, 64, 128, 8, 4, 2, BLOCK_N2=64) == BASE and not KernelConfig(16, 64, 128, 8, 4, 2, BLOCK_N2=64).has_gemm2
    joined = dataclasses.replace(BASE, JOIN=1).with_gemm2(num_stages=3)
    assert joined.gemm2().JOIN == 0 and joined.gemm1().JOIN == 1  # the joined tile is GEMM1's
    with pytest.raises(TypeError, match="no parameter 'BLOCK_M' of its own"):
        BASE.with_gemm2(BLOCK_M=32)


def test_to_dict_names_gemm2_fields_only_when_set_and_round_trips():
    assert "BLOCK_N2" not in BASE.to_dict()
    cfg = BASE.with_gemm2(num_stages=4)
    assert cfg.to_dict()["num_stages2"] == 4 and "BLOCK_N2" not in cfg.to_dict()
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert config_key(cfg) == config_key(BASE) + "+N64-G8-w4-s4" and config_key(BASE) == "M16-N64-K128-G8-w4-s2"


def test_problems_of_gemm2_fields():
    block = get_scheme("fp8-block128")
    assert BASE.with_gemm2(BLOCK_N=256).problems(block) == ["GEMM2: BLOCK_N=256 must divide 128 for 128x128 weight blocks"]
    assert BASE.with_gemm2(BLOCK_N=48).problems(get_scheme("bf16")) == ["GEMM2: BLOCK_N=48 must be a power of two >= 16"]
    assert "must be 0 (GEMM1's) or positive" in dataclasses.replace(BASE, num_warps2=-4).problems(block)[0]
    gemv = KernelConfig(16, 8, 512, 1, 4, 1, GEMV=1, GROUP_M2=3)
    assert "GROUP_M2 is for the tiled path; the GEMV path (GEMV=1) takes only" in gemv.problems(block)[0]
    assert not KernelConfig(16, 8, 512, 1, 4, 1, GEMV=1, num_stages2=3).problems(block)  # its K-loop depth


def test_runs_of_column_tiles_are_gemm2s_alone():
    cfg = BASE.with_gemm2(N_TILES=8)
    assert cfg.has_gemm2 and cfg.N_TILES2 == 8 and cfg.gemm2_tiles == 8 and BASE.gemm2_tiles == 1
    assert cfg.gemm1() == BASE  # GEMM1 has no runs
    assert cfg.gemm2() == cfg  # GEMM1's launch otherwise: GEMM2 runs this config as it is
    both = BASE.with_gemm2(BLOCK_N=32, num_stages=3, N_TILES=4)
    assert both.gemm2() == dataclasses.replace(KernelConfig(16, 32, 128, 8, 4, 3), N_TILES2=4)
    assert BASE.with_gemm2(N_TILES=1) == BASE  # a run of one tile is one tile per program: unset
    assert cfg.to_dict()["N_TILES2"] == 8 and "N_TILES2" not in BASE.to_dict()
    assert KernelConfig.from_dict(both.to_dict()) == both
    assert config_key(cfg) == config_key(BASE) + "+N64-G8-w4-s2-r8"
    block = get_scheme("fp8-block128")
    assert "N_TILES2=-2 must be 0 or positive" in dataclasses.replace(BASE, N_TILES2=-2).problems(block)[0]
    gemv = KernelConfig(16, 8, 512, 1, 4, 1, GEMV=1, N_TILES2=4)
    assert "N_TILES2 is for the tiled path; the GEMV path (GEMV=1) takes only" in gemv.problems(block)[0]
    assert vllm_config(cfg, get_scheme("fp8-channel-token"))[0] is None  # vLLM's kernel has no runs


def test_vllm_export_refuses_a_gemm2_launch_of_its_own():
    cfg, why = vllm_config(BASE.with_gemm2(num_stages=3), get_scheme("fp8-channel-token"))
    assert cfg is None and "GEMM2 has a launch config of its own" in why


def test_a_table_entry_with_gemm2_fields_is_what_the_backend_runs(tmp_path, monkeypatch):
    from moekit.spec import MoEShape
    from moekit.tables import CONFIG_DIR_ENV, table_name

    shape, scheme = MoEShape(4, 128, 128, 2), get_scheme("fp8-channel-token")
    entry = {**BASE.with_gemm2(BLOCK_N=32, num_stages=3).to_dict(), "us": 1.0}
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / table_name(shape, scheme, "NVIDIA H200")).write_text(
        json.dumps({"meta": {}, "configs": {"64": entry}}))
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    assert get_config(shape, scheme, 64, "NVIDIA H200") == BASE.with_gemm2(BLOCK_N=32, num_stages=3)


# ------------------------------------------------------------------------------ the kernels


@pytest.mark.parametrize("scheme,accumulation", with_accumulation_modes(SCHEMES))
def test_gemm2_tiled_unlike_gemm1_matches_reference(scheme, accumulation, device, monkeypatch):
    """GEMM1 128 wide (fp8-channel-token's group-quantized intermediate, precise) or 64, GEMM2 32
    wide with other warps, stages and grouping: hidden 208 (a partial GEMM2 column block), an
    idle expert, M = 7 with top-2. On the CPU also bitwise equal to GEMM2 tiled as GEMM1."""
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, accumulation)
    gemm1_n = 64 if scheme == "fp8-block128" else 128
    cfg = dataclasses.replace(BASE, BLOCK_N=gemm1_n).with_gemm2(BLOCK_N=32, num_warps=2, num_stages=3, GROUP_M=1)
    w = random_weights(4, 208, 128, scheme, device=device, seed=3)
    tw, ids = random_routing(7, 4, 2, device=device, experts=[0, 1, 3])
    x = random_x(7, 208, device=device)
    out = assert_matches_reference(run(x, w, tw, ids, cfg), x, w, tw, ids)
    if device.type == "cpu":  # the interpreter sums each element's K in the same order whatever the tiles
        assert torch.equal(out, run(x, w, tw, ids, dataclasses.replace(BASE, BLOCK_N=gemm1_n)))


@pytest.mark.parametrize("scheme,accumulation", with_accumulation_modes(SCHEMES))
def test_runs_of_column_tiles_match_one_tile_per_program(scheme, accumulation, device, monkeypatch):
    """GEMM2 programs running 2, 3 and all 7 of its 32-wide column blocks (hidden 208: the last
    one partial; runs of 2 and 3 end short) against reference, and bitwise equal to one tile per
    program: each output tile is the same K loop and epilogue, only the program running it
    changes. Also with 128-row blocks, whose last block of an expert runs at half height."""
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, accumulation)
    gemm1_n = 64 if scheme == "fp8-block128" else 128
    w = random_weights(4, 208, 128, scheme, device=device, seed=5)
    tw, ids = random_routing(37, 4, 2, device=device, experts=[0, 2, 3])
    x = random_x(37, 208, device=device)
    for block_m in (16, 128):
        one = dataclasses.replace(BASE, BLOCK_M=block_m, BLOCK_N=gemm1_n).with_gemm2(BLOCK_N=32, num_stages=3)
        single = assert_matches_reference(run(x, w, tw, ids, one), x, w, tw, ids)
        for n_tiles in (2, 3, 7):
            assert torch.equal(run(x, w, tw, ids, one.with_gemm2(N_TILES=n_tiles)), single), (block_m, n_tiles)


def test_each_gemm_is_launched_with_its_own_parameters(device, monkeypatch):
    launches = {}
    real = launch._launch

    def record(kernel, grid, *args, **kwargs):
        launches[kernel] = {k: kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages",
                                                   "N_TILES") if k in kwargs}
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(launch, "_launch", record)
    w = random_weights(3, 128, 128, "fp8-channel-token", device=device)  # launched for real: CUDA or the interpreter
    tw, ids = random_routing(5, 3, 2, device=device)
    run(random_x(5, 128, device=device), w, tw, ids, BASE.with_gemm2(BLOCK_N=32, num_warps=2, num_stages=3, GROUP_M=1, N_TILES=3))
    assert launches[_kernels.gemm1_kernel] == dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=2)
    assert launches[_kernels.gemm2_kernel] == dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=2, num_stages=3,
                                                   N_TILES=3)


@pytest.mark.parametrize("gemm2", [dict(BLOCK_N=128, num_stages=3), dict(BLOCK_N=32, N_TILES=3)])
def test_m_one_and_m_zero_with_a_gemm2_launch(gemm2, device):
    """A GEMM2 launch of its own, and runs of column tiles (4 tiles of 32: a run of 3, then of 1)."""
    w = random_weights(3, 128, 128, "fp8-channel-token", device=device)
    cfg = BASE.with_gemm2(**gemm2)
    tw, ids = random_routing(1, 3, 2, device=device)
    x = random_x(1, 128, device=device)
    assert_matches_reference(run(x, w, tw, ids, cfg), x, w, tw, ids)
    empty = run(x[:0], w, tw[:0], ids[:0], cfg)  # the backend itself, with the GEMM2 launch
    assert empty.shape == (0, 128) and empty.dtype == x.dtype


@pytest.mark.gpu
@pytest.mark.parametrize("name", PRESET_SHAPES)
def test_gpu_preset_shapes_with_gemm2_launched_otherwise(name):
    """At each preset's prefill-sized tile (BLOCK_M 64): GEMM2 with the variants the tuner tries
    most (3 stages; 256 wide where the scheme allows), against reference and bitwise stable
    under graph replay with fresh routing."""
    E, H, N, K, scheme = PRESET_SHAPES[name]
    w = random_weights(E, H, N, scheme, device="cuda")
    base = KernelConfig(64, 128, 128, 8, 8, 4)
    width = 64 if scheme == "fp8-block128" else 256
    cfg = base.with_gemm2(BLOCK_N=width, num_stages=3, num_warps=8)
    M = 96
    tw, ids = random_routing(M, E, K, device="cuda")
    x = random_x(M, H, device="cuda")
    out = assert_matches_reference(run(x, w, tw, ids, cfg), x, w, tw, ids)
    assert torch.equal(out, run(x, w, tw, ids, cfg))
    assert_graph_replays_fresh_routing(lambda x, tw, ids: run(x, w, tw, ids, cfg), x, tw, ids, E)


@pytest.mark.gpu
@pytest.mark.parametrize("name", PRESET_SHAPES)
def test_gpu_preset_shapes_with_runs_of_column_tiles(name):
    """GEMM2 programs running 8 column tiles each (the tuner's run length) at each preset's
    prefill tile, with a 128-row tile too (half tiles): against reference, bitwise equal to one
    tile per program, and under graph replay with fresh routing."""
    E, H, N, K, scheme = PRESET_SHAPES[name]
    w = random_weights(E, H, N, scheme, device="cuda")
    width = 64 if scheme == "fp8-block128" else 128
    M = 300
    tw, ids = random_routing(M, E, K, device="cuda")
    x = random_x(M, H, device="cuda")
    for block_m in (64, 128):
        one = KernelConfig(block_m, 128, 128, 8, 8, 4).with_gemm2(BLOCK_N=width, num_warps=4, num_stages=3)
        cfg = one.with_gemm2(N_TILES=8)
        out = assert_matches_reference(run(x, w, tw, ids, cfg), x, w, tw, ids)
        assert torch.equal(out, run(x, w, tw, ids, one))
        # runs of 5 end short at every preset (32 or 112 column tiles)
        assert torch.equal(out, run(x, w, tw, ids, one.with_gemm2(N_TILES=5)))
        assert_graph_replays_fresh_routing(lambda x, tw, ids: run(x, w, tw, ids, cfg), x, tw, ids, E)


@pytest.mark.gpu
@pytest.mark.parametrize("accumulation", ["precise", "fast"])
@pytest.mark.parametrize("name", PRESET_SHAPES)
def test_gpu_preset_shapes_on_sixteen_warps(name, accumulation, monkeypatch):
    """GEMM1 on 16 warps (four warpgroups: the tuner's WIDE_TILE_WARPS, shipped at DeepSeek-V3
    M = 8192) on 128x128 tiles, with GEMM2 on 16 warps too and on its own 4-warp launch in runs:
    against reference, bitwise repeatable, and under graph replay with fresh routing."""
    E, H, N, K, scheme = PRESET_SHAPES[name]
    if accumulation == "fast" and not accumulation_matters(get_scheme(scheme)):
        pytest.skip(f"{scheme} runs the same kernels in both modes")
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, accumulation)
    w = random_weights(E, H, N, scheme, device="cuda")
    M = 300
    tw, ids = random_routing(M, E, K, device="cuda")
    x = random_x(M, H, device="cuda")
    wide = KernelConfig(128, 128, 128, 1, 16, 4)
    for cfg in (wide, wide.with_gemm2(BLOCK_N=64, num_warps=4, num_stages=3, N_TILES=8)):
        out = run(x, w, tw, ids, cfg)
        if accumulation == "fast":
            # the tensor cores' own FP8 sums: fast mode's bound (test_triton_backend)
            assert rel_l2(out, reference_for(x, w, tw, ids)) < FAST_REL_L2_TOL
        else:
            assert_matches_reference(out, x, w, tw, ids)
        assert torch.equal(out, run(x, w, tw, ids, cfg))
        assert_graph_replays_fresh_routing(lambda x, tw, ids: run(x, w, tw, ids, cfg), x, tw, ids, E)


def test_every_shipped_triton_table_entry_can_run_its_scheme():
    """The shipped tables (moekit/configs/triton, GEMM2 launches included) load and each entry
    passes KernelConfig.problems for the scheme in its file name; an entry that could not run
    would make the backend fall back to the analytic default without a word."""
    from moekit.backends.triton.config import load_table
    from moekit.tables import SHIPPED_ROOT, parse_table_name

    files = sorted((SHIPPED_ROOT / "triton").glob("*.json"))
    assert files
    for path in files:
        scheme = get_scheme(parse_table_name(path.name)["scheme"])
        table = load_table(path).configs
        assert table, path.name
        for size, cfg in table.items():
            assert cfg.problems(scheme) == [], (path.name, size, cfg)
    assert any(cfg.has_gemm2 for path in files for cfg in load_table(path).configs.values())
