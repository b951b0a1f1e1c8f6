"""KernelConfig.OVERLAP: GEMM1 in Gluon with the FP8 promotion overlapped with the next K step's
product (_gluon_kernels.gemm1_overlap_kernel). The config rules and where the kernel runs (CPU),
and on a Hopper GPU (marked `gpu`) the layer at the preset shapes: bitwise equal to the Triton
kernel on the same tile (every operation of the product, the scales and the epilogue in the same
order), against the reference, repeatable, and under graph replay with fresh routing."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moekit
from moekit.accumulation import accumulation_matters
from moekit.backends.base import assume_capability
from moekit.backends.triton import KernelConfig, launch
from moekit.backends.triton.launch import FP8_ACCUMULATION_ENV
from moekit.spec import get_scheme
from moekit.tune.space import config_from_key, config_key

from helpers import assert_graph_replays_fresh_routing, random_routing, random_weights, random_x, rel_l2
from test_triton_backend import FAST_REL_L2_TOL, PRESET_SHAPES, assert_matches_reference, reference_for

TILE = KernelConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
OVERLAP = dataclasses.replace(TILE, OVERLAP=1)
CUDA = torch.device("cuda", 0)


def run(x, w, tw, ids, cfg):
    return moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)


# ------------------------------------------------------------------------------ config rules


@pytest.mark.parametrize("scheme", ["fp8-channel-token", "fp8-block128"])
def test_overlap_runs_per_token_and_block_schemes_on_its_tile(scheme):
    assert OVERLAP.problems(get_scheme(scheme)) == []
    assert OVERLAP.with_gemm2(BLOCK_N=64, num_warps=4, num_stages=3, N_TILES=8).problems(get_scheme(scheme)) == []


@pytest.mark.parametrize("scheme", ["bf16", "fp8-tensor-static", "fp8-tensor-dynamic"])
def test_overlap_refuses_schemes_without_group_quantized_intermediate(scheme):
    problems = OVERLAP.problems(get_scheme(scheme))
    assert any("OVERLAP=1 runs FP8 schemes" in p and scheme in p for p in problems), problems


def test_overlap_refuses_other_tiles_naming_the_one_it_runs():
    for change in ({"BLOCK_M": 128}, {"BLOCK_N": 64}, {"num_warps": 16}):
        problems = dataclasses.replace(OVERLAP, **change).problems(get_scheme("fp8-channel-token"))
        assert any("BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8" in p for p in problems), problems
    assert any("JOIN and GEMV must be 0" in p
               for p in dataclasses.replace(OVERLAP, JOIN=1).problems(get_scheme("fp8-channel-token")))
    assert "OVERLAP=2 must be 0 or 1" in dataclasses.replace(TILE, OVERLAP=2).problems(get_scheme("fp8-block128"))
    for stages in (1, 6):  # one stage cannot load while it is read; six do not fit in shared memory
        assert dataclasses.replace(OVERLAP, num_stages=stages).problems(get_scheme("fp8-block128")) == [
            f"OVERLAP=1 runs 2 to 5 pipeline stages (each 40 KiB of shared memory); got num_stages={stages}"]


def test_overlap_is_gemm1s_alone_and_keeps_its_key():
    cfg = OVERLAP.with_gemm2(BLOCK_N=64, num_warps=4, num_stages=3, N_TILES=8)
    assert cfg.gemm2().OVERLAP == 0 and cfg.gemm1().OVERLAP == 1
    assert config_key(cfg) == "M64-N128-K128-G8-w8-s4-ov+N64-G8-w4-s3-r8"
    assert config_from_key(config_key(cfg)) == cfg and config_from_key(config_key(OVERLAP)) == OVERLAP
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"\[-ov\]"):
        config_from_key("M64-N128-K128-G8-w8-s4-overlap")


def test_overlapped_kernel_runs_only_where_it_can(monkeypatch):
    """Hopper, the 1x128-group output (OUT_MODE 3), whole K steps, enough of them, never under
    the interpreter; elsewhere the Triton kernel runs the same tile."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if launch.gk is None:
        pytest.skip("this triton has no Gluon")
    with assume_capability((9, 0)):
        assert launch._overlapped(OVERLAP, 3, 4096, CUDA)
        assert not launch._overlapped(TILE, 3, 4096, CUDA)  # not asked for
        assert not launch._overlapped(OVERLAP, 0, 4096, CUDA)  # fast mode's per-row intermediate
        assert not launch._overlapped(OVERLAP, 3, 4096 + 64, CUDA)  # K not in whole steps
        assert not launch._overlapped(OVERLAP, 3, 256, CUDA)  # 2 steps, the pipeline preloads 3
        assert launch._overlapped(dataclasses.replace(OVERLAP, num_stages=3), 3, 256, CUDA)
        assert not launch._overlapped(OVERLAP, 3, 4096, torch.device("cpu"))
        # 16-byte aligned rows only (its cp.async copies are 16 bytes wide)
        rows = torch.empty(8, 4096 + 16, dtype=torch.float8_e4m3fn)
        w13 = torch.empty(2, 256, 4096, dtype=torch.float8_e4m3fn)
        assert launch._overlapped(OVERLAP, 3, 4096, CUDA, rows[:, :4096], w13)
        assert not launch._overlapped(OVERLAP, 3, 4096, CUDA, rows[:, 1:4097], w13)
        assert not launch._overlapped(OVERLAP, 3, 4096, CUDA, torch.empty(8, 4104, dtype=torch.float8_e4m3fn)[:, :4096], w13)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not launch._overlapped(OVERLAP, 3, 4096, CUDA)
    for cap in ((8, 9), (10, 0)):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with assume_capability(cap):
            assert not launch._overlapped(OVERLAP, 3, 4096, CUDA), cap


@pytest.mark.parametrize("scheme", ["fp8-channel-token", "fp8-block128"])
def test_overlap_config_on_the_cpu_runs_the_triton_kernel_it_mirrors(scheme, device, monkeypatch):
    """Under the interpreter an OVERLAP config runs _kernels.gemm1_kernel on the same tile:
    against the reference, with odd E, idle experts and (per-token scheme) a partial last column
    tile; block weights need N in whole 128-row blocks."""
    if device.type != "cpu":
        pytest.skip("the interpreter case")
    E, H, N, M, K = 5, 256, 208 if scheme == "fp8-channel-token" else 256, 37, 2
    w = random_weights(E, H, N, scheme, device=device)
    tw, ids = random_routing(M, E, K, device=device, experts=[0, 2, 4])
    x = random_x(M, H, device=device)
    if launch.gk is not None:  # the Gluon kernel must not be launched here
        monkeypatch.setattr(launch.gk, "gemm1_overlap_kernel", None)
    assert_matches_reference(run(x, w, tw, ids, dataclasses.replace(OVERLAP, num_stages=2)), x, w, tw, ids)


# ------------------------------------------------------------------------------ through ptxas


def test_overlapped_kernel_keeps_its_products_in_flight_through_ptxas():
    """scripts/check_overlap_ptxas.py: the Gluon kernel compiled for sm_90a with the installed
    triton's ptxas, without a GPU (in a process of its own: under TRITON_INTERPRET, which the CPU
    tests set, Triton compiles nothing): no serialized wgmma, no spills, for both scale kinds."""
    if launch.gk is None:
        pytest.skip("this triton has no Gluon")
    from triton.backends.nvidia.compiler import get_ptxas

    if not Path(get_ptxas(90).path).exists():
        pytest.skip("this triton ships no ptxas")
    script = Path(__file__).resolve().parent.parent / "scripts" / "check_overlap_ptxas.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count(": ok") == 2, done.stdout


def test_unbarriered_refill_check_sees_a_missing_barrier():
    """check_overlap_ptxas.unbarriered_refills, on PTX shapes: a copy after a wgmma wait counts
    unless a CTA barrier comes between."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "check_overlap_ptxas.py"
    spec = importlib.util.spec_from_file_location("check_overlap_ptxas", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    wait, bar, copy = "wgmma.wait_group.sync.aligned 1;", "bar.sync 0;", "cp.async.cg.shared.global [ %r1 ], [ %rd1 ], 0x10;"
    assert module.unbarriered_refills("\n".join([wait, bar, copy, copy])) == 0
    assert module.unbarriered_refills("\n".join([copy, wait, "add.f32 %r2, %r2, %r3;", copy, copy])) == 1
    assert module.unbarriered_refills("\n".join([wait, copy, bar, wait, copy])) == 2


# ------------------------------------------------------------------------------ on the GPU


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the overlapped GEMM1 runs on Hopper (sm_90) only")
    if launch.gk is None:
        pytest.skip("this triton has no Gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("accumulation", ["precise", "fast"])
@pytest.mark.parametrize("name", PRESET_SHAPES)
def test_gpu_overlapped_gemm1_is_bitwise_the_triton_kernel(name, accumulation, monkeypatch):
    """At each preset shape, M = 1 and 300 and a routing that leaves most experts idle: the layer
    with OVERLAP=1 (GEMM1 in Gluon where launch._overlapped allows) is bitwise the layer on the
    same tile in Triton, matches the reference, repeats bitwise and replays in a CUDA graph with
    fresh routing; with GEMM2 on a launch of its own too. (In fast mode a per-token scheme's
    intermediate is quantized per row, so there the Triton kernel runs: the case checks that
    fallback.)"""
    _hopper()
    E, H, N, K, scheme = PRESET_SHAPES[name]
    if accumulation == "fast" and not accumulation_matters(get_scheme(scheme)):
        pytest.skip(f"{scheme} runs the same kernels in both modes")
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, accumulation)
    w = random_weights(E, H, N, scheme, device="cuda")
    own_gemm2 = OVERLAP.with_gemm2(BLOCK_N=64, num_warps=4, num_stages=3, N_TILES=8)
    for M, experts in ((1, None), (300, None), (300, list(range(0, E, 3))[:max(K, 3)])):
        tw, ids = random_routing(M, E, K, device="cuda", experts=experts)
        x = random_x(M, H, device="cuda")
        for cfg in (OVERLAP, own_gemm2):
            out = run(x, w, tw, ids, cfg)
            assert torch.equal(out, run(x, w, tw, ids, dataclasses.replace(cfg, OVERLAP=0))), (M, experts, cfg)
            if accumulation == "fast":
                assert rel_l2(out, reference_for(x, w, tw, ids)) < FAST_REL_L2_TOL
            else:
                assert_matches_reference(out, x, w, tw, ids)
            assert torch.equal(out, run(x, w, tw, ids, cfg))
    assert_graph_replays_fresh_routing(lambda x, tw, ids: run(x, w, tw, ids, OVERLAP), x, tw, ids, E)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,E,H,N,stages", [
    ("fp8-channel-token", 5, 640, 208, 3),  # 5 K steps (the odd tail), E not a power of two, N = 1.6 tiles
    ("fp8-channel-token", 5, 640, 208, 5),  # the deepest pipeline
    ("fp8-block128", 6, 512, 256, 5),  # 4 K steps: exactly the steps the pipeline preloads
])
def test_gpu_overlapped_gemm1_odd_steps_and_pipeline_depths(scheme, E, H, N, stages):
    """The preset shapes all have an even number of K steps and 4 stages: here the odd tail of
    the loop, 3 and 5 stages, and as few steps as stages - 1, bitwise against the Triton kernel on
    the same tile, against the reference, with idle experts, and under graph replay."""
    _hopper()
    K = 2
    w = random_weights(E, H, N, scheme, device="cuda")
    cfg = dataclasses.replace(OVERLAP, num_stages=stages)
    assert cfg.problems(get_scheme(scheme)) == [] and launch._overlapped(cfg, 3, H, CUDA)
    for M, experts in ((1, None), (300, None), (300, [0, 2, 4])):
        tw, ids = random_routing(M, E, K, device="cuda", experts=experts)
        x = random_x(M, H, device="cuda")
        out = run(x, w, tw, ids, cfg)
        assert torch.equal(out, run(x, w, tw, ids, dataclasses.replace(cfg, OVERLAP=0))), (M, experts)
        assert_matches_reference(out, x, w, tw, ids)
        assert torch.equal(out, run(x, w, tw, ids, cfg))
    assert_graph_replays_fresh_routing(lambda x, tw, ids: run(x, w, tw, ids, cfg), x, tw, ids, E)


@pytest.mark.gpu
def test_gpu_overlapped_gemm1_is_the_kernel_that_ran(monkeypatch):
    """The bitwise comparison above means something only if the Gluon kernel ran: at the GLM-4.5V
    and DeepSeek-V3 shapes in precise mode, the launch goes to it."""
    _hopper()
    calls = []
    real = launch.gk.gemm1_overlap_kernel
    monkeypatch.setattr(launch.gk, "gemm1_overlap_kernel", _Spy(real, calls))
    for name in ("glm-4.5v-fp8 tp2", "deepseek-v3 tp8"):
        E, H, N, K, scheme = PRESET_SHAPES[name]
        w = random_weights(E, H, N, scheme, device="cuda")
        tw, ids = random_routing(64, E, K, device="cuda")
        assert_matches_reference(run(x := random_x(64, H, device="cuda"), w, tw, ids, OVERLAP), x, w, tw, ids)
    assert len(calls) == 2


class _Spy:
    """A kernel that records its launches ([grid] then the call, as a JIT function's)."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls, self.arg_names = kernel, calls, kernel.arg_names

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]
