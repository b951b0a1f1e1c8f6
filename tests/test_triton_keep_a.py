"""GEMM2 keeping its row block's activations across a run of column tiles (KernelConfig.KEEP_A2,
_kernels._gemm2_resident_run): the config rules, the refusal of an intermediate longer than six K
steps, and the layer against `reference` and bitwise equal to the same runs reloading A per tile,
for every scheme and accumulation mode, at odd sizes, idle experts, half-height tiles, M = 1 and
M = 0 (CPU interpreter; the preset shapes it fits on a GPU)."""

import dataclasses
import types

import numpy as np
import pytest
import torch

import moekit
from moekit.backends.triton import KernelConfig, _kernels, launch
from moekit.backends.triton.launch import FP8_ACCUMULATION_ENV
from moekit.spec import get_scheme

from helpers import assert_graph_replays_fresh_routing, random_routing, random_weights, random_x
from test_triton_backend import PRESET_SHAPES, SCHEMES, assert_matches_reference, with_accumulation_modes

# tests that build or patch what the interpreter runs (the GPU runs compiled kernels)
interpreter_only = pytest.mark.skipif(not moekit.env.interpreting(), reason="runs under TRITON_INTERPRET=1 only")
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
    gemv = KernelConfig(16, 8, 512, 1, 4, 1, GEMV=1, KEEP_A2=1)
    assert "KEEP_A2 is for the tiled path" in gemv.problems(BLOCK)[0]


def test_keep_a_fits_an_intermediate_of_six_k_steps_at_most():
    cfg = BASE.with_gemm2(N_TILES=4, KEEP_A=1)
    assert cfg.keep_a2_fits(256) and cfg.keep_a2_fits(704) and cfg.keep_a2_fits(768) and not cfg.keep_a2_fits(769)
    assert dataclasses.replace(cfg, BLOCK_K=64).keep_a2_fits(384) and not dataclasses.replace(cfg, BLOCK_K=64).keep_a2_fits(385)


def test_a_longer_intermediate_is_refused_before_any_launch(device, monkeypatch):
    launched = []
    monkeypatch.setattr(launch, "_launch", lambda kernel, *a, **kw: launched.append(kernel))
    w = random_weights(3, 128, 896, "fp8-block128", device=device)  # seven K steps of 128
    tw, ids = random_routing(5, 3, 2, device=device)
    with pytest.raises(ValueError, match="KEEP_A2=1 holds GEMM2's inner dimension in at most 6 K steps of 128; "
                                         "this problem's intermediate has 896 columns"):
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
    for n in (128, 200, 704, 768):
        w = random_weights(3, 128, n, "fp8-channel-token", device=device)
        run(random_x(5, 128, device=device), w, tw, ids, BASE.with_gemm2(N_TILES=2, KEEP_A=1))
        run(random_x(5, 128, device=device), w, tw, ids, BASE.with_gemm2(N_TILES=2))
    assert seen == [1, 0, 2, 0, 6, 0, 6, 0]


# ------------------------------------------------------------------------------ the kernel


def intermediate_and_real_rows(x, w, ids, K, cfg):
    """(align, GEMM1's intermediate, a mask of its real rows: not an expert's padding) as the
    layer makes them before GEMM2."""
    align = launch.align_pairs(ids, w.num_experts, cfg.BLOCK_M)
    a, a_scale = launch.quantize_input(x, w)
    act = launch.gemm1(a, a_scale, w, align, K, x.dtype, cfg)
    real = torch.zeros(act.values.shape[0], dtype=torch.bool)
    for first, count in zip(align.start.tolist(), align.count.tolist()):
        real[first:first + count] = True
    return align, act, real


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


@pytest.mark.parametrize("scheme", SCHEMES)
def test_kept_activations_over_five_and_six_k_steps(scheme, device, monkeypatch):
    """The intermediate in five K steps (block scales: 640 columns, whole 128x128 blocks) or six
    with the last partial (650: GLM-4.5V's 704 at TP2 is six steps, the last half full), every
    kept step a variable of its own in _gemm2_resident_run: bitwise equal to the runs reloading
    A, and against reference, on 16-row and 128-row blocks (an expert's last at half height)."""
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "precise")
    n = 640 if scheme == "fp8-block128" else 650
    w = random_weights(4, 80, n, scheme, device=device, seed=11)
    tw, ids = random_routing(29, 4, 2, device=device, experts=[0, 1, 3])
    x = random_x(29, 80, device=device)
    for block_m in (16, 128):
        reload = dataclasses.replace(BASE, BLOCK_M=block_m, BLOCK_N=128).with_gemm2(BLOCK_N=32, num_stages=2, N_TILES=2)
        kept = run(x, w, tw, ids, reload.with_gemm2(KEEP_A=1))
        assert torch.equal(kept, run(x, w, tw, ids, reload)), block_m
    assert_matches_reference(kept, x, w, tw, ids)


@pytest.mark.parametrize("scheme,gemm1_n,n", [
    ("bf16", 128, 300),  # K_STEPS 3, the last partial (A_MODE 0)
    ("fp8-channel-token", 64, 400),  # K_STEPS 4, the last partial (A_MODE 2: quantized per group while loading)
    ("fp8-block128", 128, 768),  # K_STEPS 6 of whole 128x128 weight blocks: step 5's block scale (B_SCALE 3)
])
def test_kept_activations_over_three_four_and_six_k_steps(scheme, gemm1_n, n, device, monkeypatch):
    """Each K_STEPS is a kernel of its own: a step's load or product guarded by the wrong count
    (`if K_STEPS > 4` for step 3) compiles and is right at 5 and 6 steps, and wrong or a
    NameError only at 3 or 4."""
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "precise")
    w = random_weights(3, 64, n, scheme, device=device, seed=13)
    tw, ids = random_routing(9, 3, 2, device=device)
    x = random_x(9, 64, device=device)
    reload = dataclasses.replace(BASE, BLOCK_N=gemm1_n).with_gemm2(BLOCK_N=32, num_stages=2, N_TILES=2)
    assert torch.equal(run(x, w, tw, ids, reload.with_gemm2(KEEP_A=1)), run(x, w, tw, ids, reload))


def _record_accumulators(monkeypatch):
    """Patch _gemm2_store (the interpreter looks it up when called) to keep each tile's float32
    accumulator before the epilogue, by (sorted row, column): the output's bf16 rounding hides
    most one-ulp differences of a float32 sum taken in another order."""
    real, seen = _kernels._gemm2_store, {}

    def store(acc, rows, row_ok, cols, col_ok, *rest):
        ok = row_ok.handle.data[:, None] & col_ok.handle.data[None, :]
        r, c = np.nonzero(ok)
        for i, j in zip(r.tolist(), c.tolist()):
            seen[(int(rows.handle.data[i]), int(cols.handle.data[j]))] = acc.handle.data[i, j].view(np.uint32).item()
        return real(acc, rows, row_ok, cols, col_ok, *rest)

    monkeypatch.setattr(_kernels, "_gemm2_store", store)
    return seen


@interpreter_only
@pytest.mark.parametrize("scheme,n", [("bf16", 650), ("fp8-channel-token", 650)])  # A_MODE 0 and 4, six K steps
def test_kept_run_sums_the_same_float32_products_in_the_same_order(scheme, n, monkeypatch):
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "precise")
    w = random_weights(3, 64, n, scheme, seed=13)
    tw, ids = random_routing(9, 3, 2)
    x = random_x(9, 64)
    reload = dataclasses.replace(BASE, BLOCK_N=128).with_gemm2(BLOCK_N=32, num_stages=2, N_TILES=2)
    with monkeypatch.context() as m:
        reloaded = _record_accumulators(m)
        run(x, w, tw, ids, reload)
    with monkeypatch.context() as m:
        kept = _record_accumulators(m)
        run(x, w, tw, ids, reload.with_gemm2(KEEP_A=1))
    assert reloaded and kept == reloaded


@interpreter_only
@pytest.mark.parametrize("scheme,gemm1_n,n", [("bf16", 128, 650), ("fp8-channel-token", 64, 200),
                                              ("fp8-block128", 128, 640)])
def test_kept_a_reads_no_padding_row(scheme, gemm1_n, n, monkeypatch):
    """A missing row mask on the kept A is invisible in the output (a padding row's products land
    in rows the store masks): check the kept steps themselves on an intermediate whose padding
    rows hold NaN."""
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "precise")
    E, H, M, K = 4, 64, 13, 2
    w = random_weights(E, H, n, scheme, seed=7)
    tw, ids = random_routing(M, E, K, experts=[0, 2, 3])
    x = random_x(M, H)
    cfg = dataclasses.replace(BASE, BLOCK_N=gemm1_n).with_gemm2(BLOCK_N=32, N_TILES=2, KEEP_A=1)
    align, act, real = intermediate_and_real_rows(x, w, ids, K, cfg)
    values = torch.full(act.values.shape, float("nan")).to(act.values.dtype)
    values[real] = act.values[real]
    steps, kept_a = [], _kernels._gemm2_kept_a

    def spy(a_ptrs, a_scale_ptr, rows, row_ok, *rest):
        a, step_a = kept_a(a_ptrs, a_scale_ptr, rows, row_ok, *rest)
        steps.append(np.asarray(a.handle.data)[~row_ok.handle.data].astype(np.float32))
        return a, step_a

    monkeypatch.setattr(_kernels, "_gemm2_kept_a", spy)
    launch.gemm2(launch.Intermediate(values, act.scale, act.a_mode), w, align, tw.float(), x.dtype, cfg)
    assert steps and all((s == 0).all() for s in steps)


@pytest.mark.parametrize("scheme,gemm1_n,n", [
    ("fp8-channel-token", 64, 200),  # A_MODE 2: the intermediate quantized per 1x128 group while loading
    ("fp8-block128", 128, 256),  # A_MODE 4 with 128x128 weight blocks (B_SCALE 3): DeepSeek-V3's path
])
def test_kept_activations_in_more_a_modes(scheme, gemm1_n, n, device, monkeypatch):
    """The A_MODEs the test above does not reach with its GEMM1 widths, two K steps each."""
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "precise")
    w = random_weights(4, 208, n, scheme, device=device, seed=7)
    tw, ids = random_routing(37, 4, 2, device=device, experts=[0, 2, 3])
    x = random_x(37, 208, device=device)
    reload = dataclasses.replace(BASE, BLOCK_N=gemm1_n).with_gemm2(BLOCK_N=32, num_stages=3)
    for n_tiles in (2, 7):
        kept = run(x, w, tw, ids, reload.with_gemm2(N_TILES=n_tiles, KEEP_A=1))
        assert torch.equal(kept, run(x, w, tw, ids, reload.with_gemm2(N_TILES=n_tiles))), n_tiles
    assert_matches_reference(kept, x, w, tw, ids)


@pytest.mark.parametrize("scheme", ["bf16", "fp8-block128"])
def test_kept_activations_on_full_height_128_row_blocks(scheme, device, monkeypatch):
    """About 100 rows per expert: 128-row blocks at full height (the tests above run them at half)."""
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "precise")
    n = 256 if scheme == "fp8-block128" else 200
    w = random_weights(4, 208, n, scheme, device=device, seed=7)
    tw, ids = random_routing(150, 4, 2, device=device, experts=[0, 2, 3])
    x = random_x(150, 208, device=device)
    reload = dataclasses.replace(BASE, BLOCK_M=128, BLOCK_N=64 if scheme == "fp8-block128" else 128).with_gemm2(
        BLOCK_N=32, num_stages=3, N_TILES=3)
    kept = run(x, w, tw, ids, reload.with_gemm2(KEEP_A=1))
    assert torch.equal(kept, run(x, w, tw, ids, reload))
    assert_matches_reference(kept, x, w, tw, ids)


@interpreter_only
@pytest.mark.parametrize("poison", [float("nan"), 300.0])  # NaN spoils any product; 300 a group's amax
@pytest.mark.parametrize("scheme,gemm1_n,n,a_mode", [
    ("bf16", 128, 200, 0), ("bf16", 128, 96, 0), ("fp8-channel-token", 64, 96, 2), ("fp8-channel-token", 64, 200, 2),
    ("fp8-channel-token", 128, 200, 4), ("fp8-block128", 128, 256, 4), ("fp8-channel-token", 128, 650, 4),
    ("fp8-block128", 128, 640, 4)])
def test_kept_run_reads_nothing_past_the_intermediate_or_its_rows(scheme, gemm1_n, n, a_mode, poison, monkeypatch):
    """GEMM2 on views into larger buffers filled with poison past the intermediate's n columns,
    past w2's rows and columns, and in the padding rows: a kept run that read any of it past the
    columns (a wrong K mask) would differ from the clean result. A padding row's products land
    only in rows the store masks, so a missing row mask shows only in the kept steps themselves
    (test_kept_a_reads_no_padding_row)."""
    monkeypatch.setenv(FP8_ACCUMULATION_ENV, "precise")
    E, H, M, K = 4, 208, 37, 2
    w = random_weights(E, H, n, scheme, seed=7)
    tw, ids = random_routing(M, E, K, experts=[0, 2, 3])
    x = random_x(M, H)
    cfg = dataclasses.replace(BASE, BLOCK_N=gemm1_n).with_gemm2(BLOCK_N=32, num_stages=3, N_TILES=7)
    align, act, real = intermediate_and_real_rows(x, w, ids, K, cfg)
    assert act.a_mode == a_mode
    rows = act.values.shape[0]
    wide_a = torch.full((rows, n + 128), poison).to(act.values.dtype)
    wide_a[real, :n] = act.values[real]
    poisoned = launch.Intermediate(wide_a[:, :n], act.scale, act.a_mode)
    wide_w2 = torch.full((E, H + 64, n + 128), poison).to(w.w2.dtype)
    wide_w2[:, :H, :n] = w.w2
    w2 = types.SimpleNamespace(scheme=w.scheme, num_experts=E, n=n, hidden=H, w2=wide_w2[:, :H, :n], w2_scale=w.w2_scale)
    clean = launch.gemm2(act, w, align, tw.float(), x.dtype, cfg)
    assert torch.equal(launch.gemm2(poisoned, w2, align, tw.float(), x.dtype, cfg), clean)
    kept = launch.gemm2(poisoned, w2, align, tw.float(), x.dtype, cfg.with_gemm2(KEEP_A=1))
    assert not kept.isnan().any() and torch.equal(kept, clean)


@interpreter_only
@pytest.mark.parametrize("block_m,M", [(16, 37), (128, 37), (128, 150)])  # half and full height
def test_a_keep_a_launch_never_reloads_a_per_tile(block_m, M, monkeypatch):
    """A KEEP_A2 launch never falls back to the per-tile path (same output, lost speed): the
    interpreter looks each helper up in the module when it is called, so a patched _gemm2_tile
    that raises catches it."""
    def no_tile(*args, **kwargs):
        raise AssertionError("a KEEP_A2 launch ran _gemm2_tile")

    w = random_weights(4, 208, 200, "bf16", seed=7)
    tw, ids = random_routing(M, 4, 2, experts=[0, 2, 3])
    x = random_x(M, 208)
    cfg = dataclasses.replace(BASE, BLOCK_M=block_m).with_gemm2(BLOCK_N=32, N_TILES=3, KEEP_A=1)
    want = run(x, w, tw, ids, cfg)
    monkeypatch.setattr(_kernels, "_gemm2_tile", no_tile)
    assert torch.equal(run(x, w, tw, ids, cfg), want)


def test_m_one_and_m_zero_with_kept_activations(device):
    w = random_weights(3, 128, 256, "fp8-block128", device=device)
    cfg = BASE.with_gemm2(BLOCK_N=32, N_TILES=3, KEEP_A=1)  # 4 column tiles: a run of 3, then of 1
    tw, ids = random_routing(1, 3, 2, device=device)
    x = random_x(1, 128, device=device)
    assert_matches_reference(run(x, w, tw, ids, cfg), x, w, tw, ids)
    empty = run(x[:0], w, tw[:0], ids[:0], cfg)
    assert empty.shape == (0, 128) and empty.dtype == x.dtype


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n, (_, _, N, _, _) in PRESET_SHAPES.items()
                                  if N <= KernelConfig.KEEP_A2_STEPS * 128])
def test_gpu_preset_shapes_with_kept_activations(name):
    """The preset shapes whose intermediate fits six K steps (DeepSeek-V3 at TP8, GLM-4.5V at TP2,
    Qwen3-30B-A3B), at a prefill tile (64 rows, GEMM2 64 wide on 4 warps, 3 stages, runs of 8;
    beyond two K steps, where each stage holds every step's weights, on 8 warps with 2 stages:
    on 4 warps the 128-row form spilled, compiled for sm_90 with Triton 3.9) and with 128-row blocks:
    against reference, bitwise equal to the runs reloading A, and under graph replay with fresh
    routing; first with the pairs on K experts only (300 rows each: full-height 128-row blocks)."""
    E, H, N, K, scheme = PRESET_SHAPES[name]
    warps, stages = (4, 3) if N <= 256 else (8, 2)
    w = random_weights(E, H, N, scheme, device="cuda")
    M = 300
    tw, ids = random_routing(M, E, K, device="cuda")
    x = random_x(M, H, device="cuda")
    crowded_tw, crowded_ids = random_routing(M, E, K, device="cuda", experts=list(range(K)))
    for block_m in (64, 128):
        reload = KernelConfig(block_m, 128, 128, 8, 8, 4).with_gemm2(BLOCK_N=64, num_warps=warps, num_stages=stages,
                                                                    N_TILES=8)
        kept = run(x, w, crowded_tw, crowded_ids, reload.with_gemm2(KEEP_A=1))
        assert_matches_reference(kept, x, w, crowded_tw, crowded_ids)
        assert torch.equal(kept, run(x, w, crowded_tw, crowded_ids, reload))
    for block_m in (64, 128):
        reload = KernelConfig(block_m, 128, 128, 8, 8, 4).with_gemm2(BLOCK_N=64, num_warps=warps, num_stages=stages,
                                                                    N_TILES=8)
        cfg = reload.with_gemm2(KEEP_A=1)
        out = assert_matches_reference(run(x, w, tw, ids, cfg), x, w, tw, ids)
        assert torch.equal(out, run(x, w, tw, ids, reload))
        assert torch.equal(out, run(x, w, tw, ids, cfg))
        assert_graph_replays_fresh_routing(lambda x, tw, ids: run(x, w, tw, ids, cfg), x, tw, ids, E)
