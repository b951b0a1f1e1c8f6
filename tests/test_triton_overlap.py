"""KernelConfig.OVERLAP / OVERLAP2: GEMM1 / GEMM2 in Gluon with the FP8 promotion overlapped with
the next K step's product (_gluon_kernels.gemm1_overlap_kernel on 64 rows,
gemm1_overlap_tall_kernel on 128, gemm2_overlap_kernel). The config
rules and where the kernels run (CPU), and on a Hopper GPU (marked `gpu`) the layer at the preset
shapes: bitwise equal to the Triton kernels on the same tiles (every operation of the product,
the scales and the epilogue in the same order), against the reference, repeatable, and under
graph replay with fresh routing."""

import dataclasses
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

from helpers import assert_graph_replays_fresh_routing, compile_in_child, random_routing, random_weights, random_x, rel_l2
from test_triton_backend import FAST_REL_L2_TOL, PRESET_SHAPES, assert_matches_reference, reference_for

TILE = KernelConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
OVERLAP = dataclasses.replace(TILE, OVERLAP=1)
# GEMM1 in Gluon on 128 rows (gemm1_overlap_tall_kernel: two 64-column halves in turn)
TALL = dataclasses.replace(OVERLAP, BLOCK_M=128)
# GEMM2 in Gluon on its 128 x 128 tile, after a 128-row GEMM1 (here in Triton)
OVERLAP2 = KernelConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4).with_gemm2(OVERLAP=1)
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


def test_overlap_refuses_other_tiles_naming_the_ones_it_runs():
    assert TALL.problems(get_scheme("fp8-channel-token")) == [] == TALL.problems(get_scheme("fp8-block128"))
    for change in ({"BLOCK_M": 32}, {"BLOCK_M": 256}, {"BLOCK_N": 64}, {"num_warps": 16}, {"BLOCK_M": 128, "BLOCK_N": 256}):
        problems = dataclasses.replace(OVERLAP, **change).problems(get_scheme("fp8-channel-token"))
        assert any("BLOCK_M=64 or 128, BLOCK_N=128, BLOCK_K=128, num_warps=8; got" in p for p in problems), problems
        assert not any("pipeline stages" in p for p in problems), problems  # no stage rule for rows it has no kernel of
    assert any("JOIN and GEMV must be 0" in p
               for p in dataclasses.replace(OVERLAP, JOIN=1).problems(get_scheme("fp8-channel-token")))
    assert "OVERLAP=2 must be 0 or 1" in dataclasses.replace(TILE, OVERLAP=2).problems(get_scheme("fp8-block128"))
    # one stage cannot load while it is read; more than 5 (64 rows) or 4 (128) do not fit in shared memory
    for cfg, high, stages in ((OVERLAP, 5, 1), (OVERLAP, 5, 6), (TALL, 4, 1), (TALL, 4, 5)):
        assert dataclasses.replace(cfg, num_stages=stages).problems(get_scheme("fp8-block128")) == [
            f"OVERLAP=1 runs 2 to {high} pipeline stages on {cfg.BLOCK_M} rows (all are allocated in shared memory); "
            f"got num_stages={stages}"]


def test_overlap_is_gemm1s_alone_and_keeps_its_key():
    cfg = OVERLAP.with_gemm2(BLOCK_N=64, num_warps=4, num_stages=3, N_TILES=8)
    assert cfg.gemm2().OVERLAP == 0 and cfg.gemm1().OVERLAP == 1
    assert config_key(cfg) == "M64-N128-K128-G8-w8-s4-ov+N64-G8-w4-s3-r8"
    assert config_from_key(config_key(cfg)) == cfg and config_from_key(config_key(OVERLAP)) == OVERLAP
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"\[-ov\]"):
        config_from_key("M64-N128-K128-G8-w8-s4-overlap")


def test_overlapped_kernel_runs_only_where_it_can(monkeypatch, interpret_switchable):
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


@pytest.mark.parametrize("half_height", [False, True])
@pytest.mark.parametrize("tile,kernel", [(OVERLAP, "gemm1_overlap_kernel"), (TALL, "gemm1_overlap_tall_kernel")])
def test_gemm1_launches_the_gluon_kernel_of_its_rows(tile, kernel, half_height, device, monkeypatch):
    """Where launch._overlapped allows (here made to, on the CPU), GEMM1 goes to the Gluon kernel
    of the config's rows: 64 to gemm1_overlap_kernel, 128 to gemm1_overlap_tall_kernel, which is
    told launch.GLUON_HALF_HEIGHT (stopped at the launch: Gluon does not run on the CPU)."""
    if device.type != "cpu" or launch.gk is None:
        pytest.skip("the CPU case, with a triton that has Gluon")

    class Launched(Exception):
        pass

    real = launch._launch

    def stop_at_gluon(fn, grid, *args, **kwargs):
        if fn in (launch.gk.gemm1_overlap_kernel, launch.gk.gemm1_overlap_tall_kernel):
            raise Launched(fn, kwargs)
        return real(fn, grid, *args, **kwargs)

    monkeypatch.setattr(launch, "_launch", stop_at_gluon)
    monkeypatch.setattr(launch, "GLUON_HALF_HEIGHT", half_height)
    monkeypatch.setattr(launch, "overlap_available", lambda device: True)
    E, H, N, M, K = 3, 512, 256, 5, 2  # 4 K steps: more than the 3 the pipeline preloads
    w = random_weights(E, H, N, "fp8-channel-token", device=device)
    tw, ids = random_routing(M, E, K, device=device)
    with pytest.raises(Launched) as launched:
        run(random_x(M, H, device=device), w, tw, ids, tile)
    fn, kwargs = launched.value.args
    assert fn is getattr(launch.gk, kernel)
    # the 64-row kernel has no such parameter; the 128-row one gets the switch as 0 or 1
    assert kwargs.get("HALF_HEIGHT") == (int(half_height) if tile is TALL else None)


@pytest.mark.parametrize("scheme", ["fp8-channel-token", "fp8-block128"])
def test_overlap_config_on_the_cpu_runs_the_triton_kernel_it_mirrors(scheme, device, monkeypatch):
    """Under the interpreter an OVERLAP config (64 or 128 rows) runs _kernels.gemm1_kernel on the same tile:
    against the reference, with odd E, idle experts and (per-token scheme) a partial last column
    tile; block weights need N in whole 128-row blocks."""
    if device.type != "cpu":
        pytest.skip("the interpreter case")
    E, H, N, M, K = 5, 256, 208 if scheme == "fp8-channel-token" else 256, 37, 2
    w = random_weights(E, H, N, scheme, device=device)
    tw, ids = random_routing(M, E, K, device=device, experts=[0, 2, 4])
    x = random_x(M, H, device=device)
    if launch.gk is not None:  # the Gluon kernels must not be launched here
        monkeypatch.setattr(launch.gk, "gemm1_overlap_kernel", None)
        monkeypatch.setattr(launch.gk, "gemm1_overlap_tall_kernel", None)
    for tile in (OVERLAP, TALL):
        assert_matches_reference(run(x, w, tw, ids, dataclasses.replace(tile, num_stages=2)), x, w, tw, ids)


# ------------------------------------------------------------------------------ GEMM2's rules


@pytest.mark.parametrize("scheme", ["fp8-channel-token", "fp8-block128"])
def test_overlap2_runs_per_token_and_block_schemes_on_its_tiles(scheme):
    for cfg in (OVERLAP2, OVERLAP2.with_gemm2(num_stages=6, OVERLAP=1), OVERLAP2.with_gemm2(GROUP_M=1, OVERLAP=1)):
        assert cfg.problems(get_scheme(scheme)) == [], cfg
        assert cfg.gemm2().OVERLAP2 == 1 and cfg.gemm1().OVERLAP2 == 0  # GEMM2's alone, as OVERLAP is GEMM1's


@pytest.mark.parametrize("scheme", ["bf16", "fp8-tensor-static", "fp8-tensor-dynamic"])
def test_overlap2_refuses_schemes_without_group_quantized_intermediate(scheme):
    problems = OVERLAP2.problems(get_scheme(scheme))
    assert any(p.startswith("GEMM2: OVERLAP2=1 runs FP8 schemes") and scheme in p for p in problems), problems


def test_overlap2_refuses_other_launches_naming_what_it_runs():
    scheme = get_scheme("fp8-channel-token")
    for change in ({"BLOCK_N": 256}, {"num_warps": 4}, {"BLOCK_N": 64}):
        problems = OVERLAP2.with_gemm2(OVERLAP=1, **change).problems(scheme)
        assert any("BLOCK_N 128x128 with BLOCK_K 128 on 8 warps" in p for p in problems), (change, problems)
    problems = OVERLAP.with_gemm2(OVERLAP=1).problems(scheme)  # the Gluon GEMM1's 64-row tile
    assert problems == ["GEMM2: OVERLAP2=1 runs BLOCK_M x GEMM2's BLOCK_N 128x128 with BLOCK_K 128 on 8 warps; "
                        "got 64x128, BLOCK_K 128, 8 warps"], problems
    assert OVERLAP2.with_gemm2(OVERLAP=1, num_stages=7).problems(scheme) == [
        "GEMM2: OVERLAP2=1 runs 2 to 6 pipeline stages; got GEMM2's num_stages=7"]
    assert OVERLAP2.with_gemm2(OVERLAP=1, N_TILES=8).problems(scheme) == [
        "GEMM2: OVERLAP2=1 runs one column tile per program; got N_TILES2=8"]
    assert "GEMM2: OVERLAP2=2 must be 0 or 1" in OVERLAP2.with_gemm2(OVERLAP=2).problems(scheme)


def test_overlap2_keeps_its_key():
    own = OVERLAP2.with_gemm2(num_stages=5, GROUP_M=1, OVERLAP=1)
    wide = dataclasses.replace(OVERLAP2, num_warps=16).with_gemm2(num_warps=8, OVERLAP=1)  # GEMM1 on 16 warps
    assert config_key(OVERLAP2) == "M128-N128-K128-G8-w8-s4+N128-G8-w8-s4-ov"
    assert config_key(own) == "M128-N128-K128-G8-w8-s4+N128-G1-w8-s5-ov"
    assert config_key(wide) == "M128-N128-K128-G8-w16-s4+N128-G8-w8-s4-ov"
    for cfg in (OVERLAP2, own, wide):
        assert config_from_key(config_key(cfg)) == cfg
        assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert "OVERLAP2" not in TILE.to_dict()  # tables of configs without it stay as they were


def test_overlapped_gemm2_runs_only_where_it_can(monkeypatch, interpret_switchable):
    """Hopper, the FP8 intermediate with 1x128 group scales (A_MODE 4), whole K steps of the
    intermediate, enough of them, 16-byte aligned rows, never under the interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if launch.gk is None:
        pytest.skip("this triton has no Gluon")
    g2 = OVERLAP2.gemm2()
    with assume_capability((9, 0)):
        assert launch._overlapped2(g2, 4, 14336, CUDA)
        assert not launch._overlapped2(OVERLAP2.gemm1(), 4, 14336, CUDA)  # not asked for
        assert not launch._overlapped2(g2, 5, 14336, CUDA)  # fast mode's per-row intermediate
        assert not launch._overlapped2(g2, 2, 14336, CUDA)  # quantized while loading (GEMM1 tiles < 128 wide)
        assert not launch._overlapped2(g2, 4, 704, CUDA)  # 5.5 K steps
        assert not launch._overlapped2(g2, 4, 256, CUDA)  # 2 steps, the pipeline preloads 3
        assert launch._overlapped2(OVERLAP2.with_gemm2(OVERLAP=1, num_stages=3).gemm2(), 4, 256, CUDA)
        values = torch.empty(8, 256 + 16, dtype=torch.float8_e4m3fn)
        assert launch._overlapped2(g2, 4, 512, CUDA, torch.empty(8, 512, dtype=torch.float8_e4m3fn))
        assert not launch._overlapped2(g2, 4, 512, CUDA, torch.empty(8, 520, dtype=torch.float8_e4m3fn)[:, :512])
        assert not launch._overlapped2(g2, 4, 256, CUDA, values[:, 1:257])
        w2 = torch.empty(2, 64, 512 + 8, dtype=torch.float8_e4m3fn)  # rows 520 bytes apart
        assert launch._overlapped2(g2, 4, 512, CUDA, None, torch.empty(2, 64, 512, dtype=torch.float8_e4m3fn))
        assert not launch._overlapped2(g2, 4, 512, CUDA, None, w2[:, :, :512])
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not launch._overlapped2(g2, 4, 14336, CUDA)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with assume_capability((10, 0)):
        assert not launch._overlapped2(g2, 4, 14336, CUDA)


def test_gemm_only_closure_refuses_a_config_the_kernels_cannot_run(device):
    """prepare_gemm_only (moekit bench --mode gemm, the tuner) checks the config as run() does:
    the Gluon GEMM2 on the Gluon GEMM1's 64-row tile would otherwise reach a kernel with no layout
    for it."""
    E, H, N, M, K = 3, 256, 256, 5, 2
    w = random_weights(E, H, N, "fp8-channel-token", device=device)
    tw, ids = random_routing(M, E, K, device=device)
    x = random_x(M, H, device=device)
    with pytest.raises(ValueError, match="GEMM2: OVERLAP2=1 runs BLOCK_M x GEMM2's BLOCK_N 128x128"):
        moekit.get_backend("triton").prepare_gemm_only(x, w, tw, ids, config=OVERLAP.with_gemm2(OVERLAP=1))


@pytest.mark.parametrize("scheme", ["fp8-channel-token", "fp8-block128"])
def test_overlap2_config_on_the_cpu_runs_the_triton_kernel_it_mirrors(scheme, device, monkeypatch):
    """Under the interpreter an OVERLAP2 config runs _kernels.gemm2_kernel on the same tile:
    against the reference, with odd E, idle experts and a partial last column tile of GEMM2
    (H = 208 for the per-token scheme)."""
    if device.type != "cpu":
        pytest.skip("the interpreter case")
    E, M, K = 5, 37, 2
    H, N = (208, 256) if scheme == "fp8-channel-token" else (256, 256)
    w = random_weights(E, H, N, scheme, device=device)
    tw, ids = random_routing(M, E, K, device=device, experts=[0, 2, 4])
    x = random_x(M, H, device=device)
    if launch.gk is not None:  # the Gluon kernel must not be launched here
        monkeypatch.setattr(launch.gk, "gemm2_overlap_kernel", None)
    cfg = OVERLAP2.with_gemm2(num_stages=2, OVERLAP=1)
    assert_matches_reference(run(x, w, tw, ids, cfg), x, w, tw, ids)


# ------------------------------------------------------------------------------ through ptxas


def test_overlapped_kernel_keeps_its_products_in_flight_through_ptxas():
    """scripts/check_overlap_ptxas.py: the Gluon kernel compiled for sm_90a with the installed
    triton's ptxas, without a GPU (in a process of its own: under TRITON_INTERPRET, which the CPU
    tests set, Triton compiles nothing): no serialized wgmma, no spills, for both scale kinds."""
    if launch.gk is None:
        pytest.skip("this triton has no Gluon")
    script = Path(__file__).resolve().parent.parent / "scripts" / "check_overlap_ptxas.py"
    stdout = compile_in_child([str(script)], timeout=600)
    # GEMM1 on 64 rows, on 128 rows with and without the half-height tile, GEMM2: 2 scale kinds each
    assert stdout.count(": ok") == 8, stdout


def _check_script():
    """scripts/check_overlap_ptxas.py as a module (its checks of ptxas's report and of the PTX)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "check_overlap_ptxas.py"
    spec = importlib.util.spec_from_file_location("check_overlap_ptxas", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_spill_check_reads_every_nonzero_count():
    """check_overlap_ptxas.spilled: "180 bytes spill stores" contains "0 bytes spill stores", which
    the first form of the check looked for and so passed a spilling kernel."""
    module = _check_script()
    assert not module.spilled("ptxas info    : 0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
    assert module.spilled("168 bytes stack frame, 180 bytes spill stores, 280 bytes spill loads")
    assert module.spilled("0 bytes stack frame, 0 bytes spill stores, 8 bytes spill loads")
    assert module.spilled("16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")


def test_unbarriered_refill_check_sees_a_missing_barrier():
    """check_overlap_ptxas.unbarriered_refills, on PTX shapes: a copy that some path reaches after
    a wgmma wait counts unless a CTA barrier comes between; paths follow branches, not the text
    (the half-height GEMM1's two tiles are two branches: the end of one is not followed by the
    start of the other); commit_group is no copy."""
    module = _check_script()
    wait, bar = "wgmma.wait_group.sync.aligned 1;", "bar.sync 0;"
    copy, commit = "cp.async.cg.shared.global [ %r1 ], [ %rd1 ], 0x10;", "cp.async.commit_group;"
    add = "add.f32 %r2, %r2, %r3;"
    assert module.unbarriered_refills("\n".join([wait, bar, copy, copy])) == 0
    assert module.unbarriered_refills("\n".join([copy, wait, add, copy, copy])) == 2
    assert module.unbarriered_refills("\n".join([wait, copy, bar, wait, copy])) == 2
    assert module.unbarriered_refills("\n".join([wait, commit])) == 0
    # two branches: the wait ends one, the copy starts the other
    branches = ["@%p1 bra $L__BB0_2;", wait, "bra.uni $L__BB0_3;", "$L__BB0_2:", copy, "$L__BB0_3:", "ret;"]
    assert module.unbarriered_refills("\n".join(branches)) == 0
    # a conditional branch falls through too: wait, then maybe skip the add, then the copy
    assert module.unbarriered_refills("\n".join([wait, "@%p1 bra $L__BB0_2;", add, "$L__BB0_2:", copy])) == 1
    # a loop: the copy at its top is reached from the wait at its bottom through the back edge
    loop = ["$L__BB0_1:", copy, bar, add, wait, "@%p1 bra $L__BB0_1;", "ret;"]
    assert module.unbarriered_refills("\n".join(loop)) == 1
    assert module.unbarriered_refills("\n".join([loop[0], bar, *loop[1:]])) == 0


# ------------------------------------------------------------------------------ on the GPU


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the overlapped GEMMs run on Hopper (sm_90) only")
    if launch.gk is None:
        pytest.skip("this triton has no Gluon")


def _preset_in_mode(name, accumulation, monkeypatch):
    """(E, H, N, K, random weights on the GPU) of a preset shape, in the accumulation mode asked
    for; skipped off Hopper, or in fast mode where the scheme's kernels are those of precise."""
    _hopper()
    E, H, N, K, scheme = PRESET_SHAPES[name]
    if accumulation == "fast" and not accumulation_matters(get_scheme(scheme)):
        pytest.skip(f"{scheme} runs the same kernels in both modes")
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, accumulation)
    return E, H, N, K, random_weights(E, H, N, scheme, device="cuda")


def _assert_bitwise_twins(w, E, H, K, configs, flag, routings, fast=False, device="cuda"):
    """For each routing (M, experts) and config: the layer equals the layer with `flag` ("OVERLAP"
    or "OVERLAP2") cleared (the Triton kernel on the same tile) bitwise, matches the reference
    (fast mode: vLLM's bound) and repeats bitwise. Returns the last routing's inputs."""
    for M, experts in routings:
        tw, ids = random_routing(M, E, K, device=device, experts=experts)
        x = random_x(M, H, device=device)
        for cfg in configs:
            out = run(x, w, tw, ids, cfg)
            assert torch.equal(out, run(x, w, tw, ids, dataclasses.replace(cfg, **{flag: 0}))), (M, experts, cfg)
            if fast:
                assert rel_l2(out, reference_for(x, w, tw, ids)) < FAST_REL_L2_TOL
            else:
                assert_matches_reference(out, x, w, tw, ids)
            assert torch.equal(out, run(x, w, tw, ids, cfg))
    return x, tw, ids


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
    E, H, N, K, w = _preset_in_mode(name, accumulation, monkeypatch)
    own_gemm2 = OVERLAP.with_gemm2(BLOCK_N=64, num_warps=4, num_stages=3, N_TILES=8)
    routings = ((1, None), (300, None), (300, list(range(0, E, 3))[:max(K, 3)]))
    x, tw, ids = _assert_bitwise_twins(w, E, H, K, (OVERLAP, own_gemm2), "OVERLAP", routings, accumulation == "fast")
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
    _assert_small_shape_bitwise(dataclasses.replace(OVERLAP, num_stages=stages), scheme, E, H, N)


@pytest.mark.gpu
@pytest.mark.parametrize("accumulation", ["precise", "fast"])
@pytest.mark.parametrize("name", PRESET_SHAPES)
def test_gpu_overlapped_gemm2_is_bitwise_the_triton_kernel(name, accumulation, monkeypatch):
    """As the GEMM1 case above, for OVERLAP2 (GEMM2 in Gluon where launch._overlapped2 allows: the
    Mixtral, DeepSeek-V3 and Qwen3 shapes; GLM-4.5V's 704 is not whole K steps, and fast mode's
    per-row intermediate of a per-token scheme runs the Triton kernel: the fallback's cases), with
    GEMM1 on 8 and on 16 warps."""
    E, H, N, K, w = _preset_in_mode(name, accumulation, monkeypatch)
    stages3 = OVERLAP2.with_gemm2(num_stages=3, OVERLAP=1)  # DeepSeek-V3's 2 steps take at most 3
    wide = dataclasses.replace(stages3, num_warps=16, GROUP_M=1).with_gemm2(num_warps=8, OVERLAP=1)
    routings = ((1, None), (300, None), (300, list(range(0, E, 3))[:max(K, 3)]))
    x, tw, ids = _assert_bitwise_twins(w, E, H, K, (stages3, wide), "OVERLAP2", routings, accumulation == "fast")
    assert_graph_replays_fresh_routing(lambda x, tw, ids: run(x, w, tw, ids, stages3), x, tw, ids, E)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,E,H,N,stages", [
    ("fp8-channel-token", 5, 208, 640, 3),  # 5 K steps (the odd tail), partial last column tile
    ("fp8-channel-token", 5, 208, 640, 6),  # the deepest pipeline
    ("fp8-block128", 6, 256, 512, 5),  # 4 K steps: exactly the steps the pipeline preloads
    ("fp8-block128", 6, 336, 512, 2),  # the shallowest pipeline, block scales on a partial column tile
    ("fp8-channel-token", 5, 208, 640, 4),  # the shipped and searched depths
])
def test_gpu_overlapped_gemm2_odd_steps_and_pipeline_depths(scheme, E, H, N, stages):
    """The odd tail of GEMM2's loop, 3 to 6 stages, as few steps as stages - 1, a partial last
    column tile: bitwise against the Triton kernel on the same tile, against the reference, with
    idle experts, and under graph replay."""
    _hopper()
    K = 2
    w = random_weights(E, H, N, scheme, device="cuda")
    cfg = OVERLAP2.with_gemm2(num_stages=stages, OVERLAP=1)
    assert cfg.problems(get_scheme(scheme)) == [] and launch._overlapped2(cfg.gemm2(), 4, N, CUDA)
    x, tw, ids = _assert_bitwise_twins(w, E, H, K, (cfg, ), "OVERLAP2", ((1, None), (300, None), (300, [0, 2, 4])))
    assert_graph_replays_fresh_routing(lambda x, tw, ids: run(x, w, tw, ids, cfg), x, tw, ids, E)


@pytest.mark.gpu
def test_gpu_overlapped_gemm2_is_the_kernel_that_ran(monkeypatch):
    """The bitwise comparisons above mean something only if the Gluon GEMM2 ran: at the Mixtral
    and Qwen3 shapes in precise mode, the launch goes to it."""
    _hopper()
    calls = []
    monkeypatch.setattr(launch.gk, "gemm2_overlap_kernel", _Spy(launch.gk.gemm2_overlap_kernel, calls))
    for name in ("mixtral-8x7b", "qwen3-30b-a3b"):
        E, H, N, K, scheme = PRESET_SHAPES[name]
        w = random_weights(E, H, N, scheme, device="cuda")
        tw, ids = random_routing(64, E, K, device="cuda")
        x = random_x(64, H, device="cuda")
        assert_matches_reference(run(x, w, tw, ids, OVERLAP2), x, w, tw, ids)
    assert len(calls) == 2


@pytest.mark.gpu
def test_gpu_overlapped_gemm1_is_the_kernel_that_ran(monkeypatch):
    """The bitwise comparisons here mean something only if the Gluon kernels ran: at the GLM-4.5V
    and DeepSeek-V3 shapes in precise mode, the launch goes to the 64-row kernel for OVERLAP and
    to the 128-row one for TALL."""
    _hopper()
    calls, tall_calls = [], []
    monkeypatch.setattr(launch.gk, "gemm1_overlap_kernel", _Spy(launch.gk.gemm1_overlap_kernel, calls))
    monkeypatch.setattr(launch.gk, "gemm1_overlap_tall_kernel", _Spy(launch.gk.gemm1_overlap_tall_kernel, tall_calls))
    for name in ("glm-4.5v-fp8 tp2", "deepseek-v3 tp8"):
        E, H, N, K, scheme = PRESET_SHAPES[name]
        w = random_weights(E, H, N, scheme, device="cuda")
        tw, ids = random_routing(64, E, K, device="cuda")
        for cfg in (OVERLAP, TALL):
            assert_matches_reference(run(x := random_x(64, H, device="cuda"), w, tw, ids, cfg), x, w, tw, ids)
    assert len(calls) == 2 and len(tall_calls) == 2


class _Spy:
    """A kernel that records its launches ([grid] then the call, as a JIT function's)."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls, self.arg_names = kernel, calls, kernel.arg_names

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


@pytest.mark.gpu
@pytest.mark.parametrize("half_height", [False, True])
@pytest.mark.parametrize("name", PRESET_SHAPES)
def test_gpu_tall_overlapped_gemm1_is_bitwise_the_triton_kernel(name, half_height, monkeypatch):
    """The 128-row Gluon GEMM1 (two 64-column halves, one 1x128 group) at each preset shape, alone
    and followed by the Gluon GEMM2 (where that runs): bitwise the Triton kernel's 128-row tile,
    against the reference, repeated, and under graph replay with fresh routing. GLM-4.5V's 704
    intermediate columns end in a half with no columns, which the kernel skips. With the
    half-height tile (launch.GLUON_HALF_HEIGHT) on, M = 1 runs every block at 64 rows, and
    DeepSeek-V3's and Qwen3's many experts get ~9 and ~19 rows each at M = 300."""
    E, H, N, K, w = _preset_in_mode(name, "precise", monkeypatch)
    monkeypatch.setattr(launch, "GLUON_HALF_HEIGHT", half_height)
    both = TALL.with_gemm2(OVERLAP=1)
    routings = ((1, None), (300, None), (300, list(range(0, E, 3))[:max(K, 3)]))
    x, tw, ids = _assert_bitwise_twins(w, E, H, K, (TALL, both), "OVERLAP", routings)
    assert_graph_replays_fresh_routing(lambda x, tw, ids: run(x, w, tw, ids, both), x, tw, ids, E)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,E,H,N,stages", [
    ("fp8-channel-token", 5, 640, 208, 3),  # odd K tail; the second column tile's second half is partial
    ("fp8-channel-token", 5, 640, 192, 4),  # the second column tile has no second half
    ("fp8-channel-token", 5, 640, 160, 4),  # ... and a partial first half
    ("fp8-channel-token", 5, 512, 320, 2),  # fewest stages
    ("fp8-block128", 6, 512, 256, 4),  # (H = 384 sits at the reference bound: the 64-row test's note)
    ("fp8-block128", 5, 640, 384, 3),
])
@pytest.mark.parametrize("half_height", [False, True])
def test_gpu_tall_overlapped_gemm1_odd_shapes(scheme, E, H, N, stages, half_height, monkeypatch):
    """The 128-row Gluon GEMM1 at small shapes: the loop's odd tail, partial and missing second
    halves, 2 to 4 stages, both scale kinds; bitwise the Triton kernel, against the reference,
    idle experts, graph replay; with the half-height tile on and off (M = 1: every block at 64
    rows; M = 252 on three experts: ~168 rows each, a full block then one of ~40 rows)."""
    monkeypatch.setattr(launch, "GLUON_HALF_HEIGHT", half_height)
    _assert_small_shape_bitwise(dataclasses.replace(TALL, num_stages=stages), scheme, E, H, N)


def _assert_small_shape_bitwise(cfg, scheme, E, H, N):
    """The Gluon GEMM1 of `cfg` runs here (launch._overlapped), and the layer is bitwise its Triton
    twin's, against the reference, at M = 1, 300, and 300 and 252 with idle experts, and under graph
    replay."""
    _hopper()
    K = 2
    w = random_weights(E, H, N, scheme, device="cuda")
    assert cfg.problems(get_scheme(scheme)) == [] and launch._overlapped(cfg, 3, H, CUDA)
    routings = ((1, None), (300, None), (300, [0, 2, 4]), (252, [0, 2, 4]))
    x, tw, ids = _assert_bitwise_twins(w, E, H, K, (cfg, ), "OVERLAP", routings)
    assert_graph_replays_fresh_routing(lambda x, tw, ids: run(x, w, tw, ids, cfg), x, tw, ids, E)
