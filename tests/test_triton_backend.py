"""The triton backend against `reference`: under TRITON_INTERPRET=1 on the CPU (small shapes),
and at the real preset shapes on a GPU (marked `gpu`)."""

import dataclasses
import types

import pytest
import torch

import moekit
from moekit.accumulation import accumulation_matters
from moekit.backends.reference import reference_moe
from moekit.backends.triton import KernelConfig
from moekit.backends.triton.launch import align_pairs

from helpers import assert_graph_replays_fresh_routing, max_rel, random_routing, random_weights, random_x, rel_l2

SCHEMES = ["bf16", "fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token", "fp8-block128"]

# Tolerances. The reference multiplies the same quantized inputs in float32, so the differences
# are roundings, not quantization. bf16 keeps 8 significant bits: one round-to-nearest moves a
# value by at most half a unit, 2**-8 (3.9e-3) of itself (fp16, 11 bits: 2**-11). Three such
# roundings separate the two results: each pair's weighted output is stored in bf16 before the
# combine (the reference sums in float32), and the two final outputs are each rounded to bf16.
#  - rel L2: a round-to-nearest error is uniform within +-half a unit, and a unit is 2**-7..2**-8
#    of the value over a binade, so one rounding's RMS relative error is
#    2**-7 * sqrt(E[1/m**2] = 0.541) / sqrt(12) = 1.66e-3; three independent ones: sqrt(3) x 1.66e-3
#    = 2.9e-3 (measured 2.6e-3 to 3.2e-3 on the CPU). The float32 sums also run in another order,
#    which now and then moves an intermediate value across an FP8 rounding boundary (one element
#    off by one FP8 step, at most 2**-3 of itself): a fraction f of such flips adds ~2**-3 * sqrt(f)
#    (moekit/check.py), measured up to 5e-3 in all on the GPU (BENCHMARKS.md, precise mode).
#    REL_L2_TOL = 1e-2 is 2x that and 3x the rounding estimate, yet below the 3 * 2**-8 = 1.2e-2
#    that three worst-case roundings of every element would reach; a wrong scale, row or expert
#    gives 1e-1 or more.
#  - max rel (|out - ref| over max |ref|): the three roundings bound each element by
#    3 * 2**-8 = 1.17e-2 of max |ref| (the K pair terms' magnitudes at the largest outputs sum to
#    at most ~max |ref| on these data: measured <= 1.04). One FP8 flip moves an output by
#    2**-3 * |weight * a_j * w2_ij|: on average 3e-4..1.6e-3 of max |ref| on these data (6e-2 for
#    the very largest a_j and w2_ij, too rare to bound). MAX_REL_TOL = 2e-2 is the rounding bound
#    plus 8e-3, five times an average flip (measured <= 7.1e-3 on the CPU); a wrong scale or row
#    moves max rel to 1e-1 or more.
REL_L2_TOL = 1e-2
MAX_REL_TOL = 2e-2
# On a GPU, in precise mode too, GEMM1's products are summed by the FP8 tensor cores within each
# 128-deep K step (promoted to float32 between steps): its sums are less exact than the interpreter's
# float32 ones, so more intermediate values cross an FP8 rounding boundary (rel L2 up to 5.3e-3 on the
# H200 against 2.8e-3 on the CPU, same data). A flip at one of the few largest a_j * w2_ij terms is
# what the bound above leaves out as rare, and on the GPU it is not rare enough: measured on the H200
# (BENCHMARKS.md, nineteenth session; E = 5, H = 640, N = 160/192/208, M = 1 to 300, 64- and 128-row
# tiles bitwise alike) up to 2.12e-2 of max |ref|, as far from the float64 computation (2.07e-2) as
# from the reference: one flip of an intermediate at 2**-3 of a term worth ~0.17 of max |ref|.
# MAX_REL_TOL_GPU = 3e-2 is 1.4x that, and still 3x below the 1e-1 a wrong scale, row or expert gives.
MAX_REL_TOL_GPU = 3e-2


def max_rel_tol(out) -> float:
    """The max-relative bound for a kernel output (on a GPU, the tensor cores' FP8 sums: above)."""
    return MAX_REL_TOL_GPU if out.device.type == "cuda" else MAX_REL_TOL
# MOEKIT_FP8_ACCUMULATION=fast on a GPU, for the schemes the mode changes: the tensor cores' own
# FP8 accumulator makes GEMM1's sums less exact, and more intermediate values cross an FP8
# rounding boundary. Measured on an H200 (BENCHMARKS.md, fifth session) against the reference of
# the mode's own intermediate rule at the preset shapes with 64+ row tiles: 1.49e-2 to 1.62e-2
# rel L2 (1.69e-2 against float64, `moekit check`, Mixtral-8x7B). FAST_REL_L2_TOL = 3e-2 is ~1.85x
# the worst of those (moekit check's `kernel-fast` class) and 3x below what a wrong scale or row
# gives (1e-1).
FAST_REL_L2_TOL = 3e-2


def reference_for(x, w, tw, ids):
    # the intermediate quantized by the backend's declared rule: fp8-channel-token's per 1x128
    # group, or per row in fast accumulation mode (launch.py's docstring, the README)
    from moekit.check import intermediate_granularity

    return reference_moe(x, w, tw, ids, intermediate_granularity=intermediate_granularity("triton", w.scheme))


def check(x, w, tw, ids, **kw):
    return assert_matches_reference(moekit.fused_moe(x, w, tw, ids, backend="triton", **kw), x, w, tw, ids)


def assert_matches_reference(out, x, w, tw, ids):
    ref = reference_for(x, w, tw, ids)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) < REL_L2_TOL, rel_l2(out, ref)
    assert max_rel(out, ref) < max_rel_tol(out), max_rel(out, ref)
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(
    "E,H,N,M,K",
    [
        (3, 144, 128, 5, 2),  # hidden not a multiple of the 128 K-tile
        (5, 256, 128, 1, 1),  # M = 1, top-1
        (5, 128, 256, 3, 5),  # top-k = E
    ],
)
def test_matches_reference(scheme, E, H, N, M, K, device):
    w = random_weights(E, H, N, scheme, device=device, seed=E * M)
    tw, ids = random_routing(M, E, K, device=device, seed=M)
    check(random_x(M, H, device=device, seed=K), w, tw, ids)


@pytest.mark.parametrize("scheme", ["bf16", "fp8-channel-token", "fp8-tensor-dynamic"])
def test_intermediate_not_a_multiple_of_the_tiles(scheme, device):
    w = random_weights(3, 208, 96, scheme, device=device)  # N = 96: a partial 64-wide tile and 128-group
    tw, ids = random_routing(7, 3, 2, device=device)
    check(random_x(7, 208, device=device), w, tw, ids)


def test_fp16_activations(device):
    # "fp16", the README's name of the unquantized scheme for fp16 weights: the bf16 scheme (equal
    # to it; only the dtype quantize_weights casts to differs, spec.FP16)
    assert moekit.get_scheme("fp16") == moekit.get_scheme("bf16")
    w = random_weights(3, 128, 128, "fp16", dtype=torch.float16, device=device)
    assert w.w13.dtype == torch.float16
    tw, ids = random_routing(4, 3, 2, device=device)
    check(random_x(4, 128, dtype=torch.float16, device=device), w, tw, ids)


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "bf16"])
@pytest.mark.parametrize("M", [1, 5])
def test_fp16_activations_with_fp8_weights(scheme, M, device):
    """fp16 activations for every FP8 scheme (supports() accepts them) on the tiled path: the
    reference rounds its intermediate and output to fp16 as the kernels do; fp16's roundings are
    8x finer than bf16's, so the bf16-derived tolerances hold a fortiori. Hidden 144: a partial K
    tile; top-2 of 3 experts (the GEMV path: test_triton_gemv)."""
    w = random_weights(3, 144, 128, scheme, device=device, seed=M)
    tw, ids = random_routing(M, 3, 2, device=device, seed=M)
    x = random_x(M, 144, dtype=torch.float16, device=device, seed=M)
    cfg = KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1)
    assert not cfg.GEMV
    assert_matches_reference(moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg), x, w, tw, ids)


@pytest.mark.parametrize("scheme", ["fp8-channel-token", "fp8-block128"])
def test_experts_without_tokens_and_all_on_one_expert(scheme, device):
    w = random_weights(5, 128, 128, scheme, device=device)
    x = random_x(6, 128, device=device)
    tw, ids = random_routing(6, 5, 2, device=device, experts=[1, 3])  # experts 0, 2, 4 idle
    check(x, w, tw, ids)
    tw, ids = random_routing(6, 5, 1, device=device, experts=[4])  # every token on expert 4
    check(x, w, tw, ids)


def test_top8_many_pairs_uses_the_multi_program_alignment(device):
    # 20 tokens x top-8 = 160 pairs > 128: the count / scan / scatter kernels
    w = random_weights(9, 128, 128, "fp8-block128", device=device)
    tw, ids = random_routing(20, 9, 8, device=device)
    check(random_x(20, 128, device=device), w, tw, ids)


def test_m_zero_and_apply_on_input(device):
    w = random_weights(3, 128, 128, "fp8-channel-token", device=device)
    x = random_x(4, 128, device=device)
    tw, ids = random_routing(4, 3, 1, device=device)
    assert moekit.fused_moe(x[:0], w, tw[:0], ids[:0], backend="triton").shape == (0, 128)
    out = moekit.fused_moe(x, w, tw, ids, backend="triton", apply_router_weight_on_input=True)
    # the weight scales x (rounded back to x's dtype) and the experts' outputs are summed with
    # weight 1: the reference of the backend's own intermediate rule on that input, standard bounds
    scaled = (x.float() * tw.float()).to(x.dtype)
    assert_matches_reference(out, scaled, w, torch.ones_like(tw), ids)
    # and the weight really reached the input: applied after the experts instead, the result
    # differs (SiLU is not linear, so expert(t * x) != t * expert(x) for weights t in [0.1, 1.1))
    assert not torch.equal(out, moekit.fused_moe(x, w, tw, ids, backend="triton"))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("config", [None, KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128),
                                    KernelConfig(16, 64, 256, 1, 2, 1, GEMV=1)], ids=["default", "tiled", "gemv"])
def test_run_with_no_tokens(scheme, config, device):
    """The backend's run() itself with zero rows (fused_moe returns before it at M = 0), given
    what fused_moe gives it (validate_inputs: float32 weights, int32 ids), for every scheme it
    claims: the default config for M = 0, the tiled path and the GEMV path."""
    from moekit.api import validate_inputs
    from moekit.spec import MoEShape

    w = random_weights(3, 144, 128, scheme, device=device)
    x = random_x(0, 144, device=device)
    tw, ids = random_routing(0, 3, 2, device=device)
    backend = moekit.get_backend("triton")
    assert backend.supports(MoEShape(3, 144, 128, 2), w.scheme, x.device, x.dtype) == []
    tw, ids = validate_inputs(x, w, tw, ids, device_check=False)
    out = backend.run(x, w, tw, ids, config=config)
    assert out.shape == (0, 144) and out.dtype == x.dtype and out.device == x.device


@pytest.mark.parametrize("P,E,block_m", [(7, 3, 16), (128, 5, 16), (300, 7, 32), (129, 130, 16), (2000, 70, 16)])
def test_alignment_is_a_padded_stable_sort(P, E, block_m, device):
    g = torch.Generator().manual_seed(P)
    ids = torch.randint(0, E, (P,), generator=g, dtype=torch.int32)
    ids[: min(P, 3)] = 0  # never an empty problem
    al = align_pairs(ids.view(-1, 1).to(device), E, block_m)
    count, start = al.count.cpu(), al.start.cpu()
    assert torch.equal(count, torch.bincount(ids.long(), minlength=E).int())
    padded = (count + block_m - 1) // block_m * block_m
    assert torch.equal(start[1:] - start[:-1], padded)
    assert start[0] == 0 and start[-1] <= al.max_rows
    pairs = al.sorted_pairs.cpu()
    for e in range(E):
        got = pairs[start[e] : start[e] + count[e]]
        # the pairs of expert e, in increasing order: the same layout on every run
        assert torch.equal(got, torch.nonzero(ids == e).flatten().int())


def test_config_problems_are_reported():
    with pytest.raises(ValueError, match="BLOCK_K=64 must be 128"):
        w = random_weights(3, 128, 128, "fp8-block128")
        tw, ids = random_routing(2, 3, 1)
        backend = moekit.get_backend("triton")
        backend.run(random_x(2, 128), w, tw, ids, config=KernelConfig(BLOCK_K=64))
    assert "BLOCK_N=256 must divide 128" in " ".join(KernelConfig(BLOCK_N=256).problems(moekit.get_scheme("fp8-block128")))


@pytest.mark.parametrize("group_m", [0, -3])
def test_a_group_of_no_rows_is_refused(group_m):
    """GROUP_M divides the tile order (_kernels._tile_ids): 0 or below passed problems() and a
    config made by hand (TritonBackend.run(config=), the tuner's API) returned NaN or garbage."""
    w = random_weights(4, 128, 128, "bf16")
    tw, ids = random_routing(40, 4, 2)
    cfg = KernelConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=group_m)
    assert cfg.problems(w.scheme) == [f"GROUP_M={group_m} must be a positive integer"]
    with pytest.raises(ValueError, match=f"GROUP_M={group_m} must be a positive integer"):
        moekit.get_backend("triton").run(random_x(40, 128), w, tw, ids, config=cfg)
    assert KernelConfig(GEMV=1, BLOCK_N=32, BLOCK_K=128, GROUP_M=0).problems(w.scheme) == []  # no row tiles to group


@pytest.mark.parametrize("scheme", ["fp8-tensor-static", "fp8-tensor-dynamic"])
def test_fp8_tiles_need_k_steps_of_32(scheme):
    """Triton compiles 8-bit tensor-core dots with K >= 32 only: a table entry with BLOCK_K 16
    passed problems() for the per-tensor FP8 schemes (the others need 128) and would have failed
    to compile in a forward pass on a GPU. bf16 tiles may still step by 16."""
    problems = KernelConfig(BLOCK_K=16).problems(moekit.get_scheme(scheme))
    assert problems == ["BLOCK_K=16 must be at least 32 for FP8 tensor-core dots"]
    assert KernelConfig(BLOCK_K=32).problems(moekit.get_scheme(scheme)) == []
    assert KernelConfig(BLOCK_K=16).problems(moekit.get_scheme("bf16")) == []


def test_config_checks_are_remembered_per_config_and_scheme(monkeypatch):
    """launch._check_config runs on every layer call: its answer (and GEMM2's launch) is computed
    once per (config, scheme), so a config with a GEMM2 launch of its own costs no 40 µs of host
    time per call; a different scheme is checked afresh."""
    from moekit.backends.triton import launch

    cfg = KernelConfig(BLOCK_M=128, BLOCK_K=128).with_gemm2(BLOCK_N=64, num_stages=3)
    calls = []
    real = KernelConfig.problems
    monkeypatch.setattr(KernelConfig, "problems", lambda self, scheme: calls.append(scheme.name) or real(self, scheme))
    launch._config_problems.cache_clear()
    channel = types.SimpleNamespace(scheme=moekit.get_scheme("fp8-channel-token"), n=256)  # what it reads of weights
    for _ in range(3):
        launch._check_config(cfg, channel)
    assert calls == ["fp8-channel-token"]
    with pytest.raises(ValueError, match="must be 128"):
        launch._check_config(dataclasses.replace(cfg, BLOCK_K=64), types.SimpleNamespace(scheme=moekit.get_scheme("fp8-block128"), n=256))
    assert launch._gemm2_launch(cfg) == cfg.gemm2() and launch._gemm2_launch(cfg) is launch._gemm2_launch(cfg)


def test_supports_names_every_reason():
    from moekit.spec import MoEShape

    reasons = moekit.get_backend("triton").supports(
        MoEShape(4, 100, 40, 2), moekit.get_scheme("bf16"), torch.device("cpu"), torch.float32
    )
    text = " ".join(reasons)
    assert "float32" in text and "multiples of 16" in text


# ------------------------------------------------------------------------------------ GPU
PRESET_SHAPES = {  # the anchor shapes: (E, H, N, K, scheme)
    "glm-4.5v-fp8 tp2": (128, 4096, 704, 8, "fp8-channel-token"),
    "mixtral-8x7b": (8, 4096, 14336, 2, "fp8-channel-token"),
    "deepseek-v3 tp8": (256, 7168, 256, 8, "fp8-block128"),
    "qwen3-30b-a3b": (128, 2048, 768, 8, "fp8-block128"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(PRESET_SHAPES))
@pytest.mark.parametrize("M", [1, 7, 300])
def test_gpu_preset_shapes(name, M):
    E, H, N, K, scheme = PRESET_SHAPES[name]
    w = random_weights(E, H, N, scheme, device="cuda")
    tw, ids = random_routing(M, E, K, device="cuda", seed=M)
    check(random_x(M, H, device="cuda"), w, tw, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gpu_every_scheme_with_idle_experts(scheme):
    E, H, N, K = 64, 2048, 768, 8
    w = random_weights(E, H, N, scheme, device="cuda")
    tw, ids = random_routing(33, E, K, device="cuda", experts=list(range(0, E, 3)))
    check(random_x(33, H, device="cuda"), w, tw, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4, 1000])
def test_gpu_bitwise_deterministic(M):
    E, H, N, K = 128, 4096, 704, 8
    w = random_weights(E, H, N, "fp8-channel-token", device="cuda")
    tw, ids = random_routing(M, E, K, device="cuda")
    x = random_x(M, H, device="cuda")
    first = moekit.fused_moe(x, w, tw, ids, backend="triton")
    for _ in range(5):
        assert torch.equal(moekit.fused_moe(x, w, tw, ids, backend="triton"), first)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [2, 512])
def test_gpu_cuda_graph_replay_with_fresh_routing(M):
    E, H, N, K = 128, 4096, 704, 8
    w = random_weights(E, H, N, "fp8-channel-token", device="cuda")
    x = random_x(M, H, device="cuda")
    tw, ids = random_routing(M, E, K, device="cuda", seed=1)
    moekit.fused_moe(x, w, tw, ids, backend="triton")  # compile outside the capture
    assert_graph_replays_fresh_routing(lambda x, tw, ids: moekit.fused_moe(x, w, tw, ids, backend="triton"), x, tw, ids, E)


# MOEKIT_FP8_ACCUMULATION=fast: the tensor cores' own accumulator over the whole K (vLLM's and
# CUTLASS's way) instead of a float32 add after each BLOCK_K. On the CPU the interpreter sums
# exactly either way, so these tests check the switch and the code path, not the rounding.


def test_fp8_accumulation_switch(monkeypatch):
    from moekit.backends.triton import launch

    cfg = KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)
    monkeypatch.delenv("MOEKIT_FP8_ACCUMULATION", raising=False)
    assert launch.fp8_accumulation() == "precise" and launch.fp8_promote(cfg) == 128
    for value, promote in (("fast", 0), (" FAST ", 0), ("precise", 128), ("", 128)):
        monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", value)
        assert launch.fp8_promote(cfg) == promote, value
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "sloppy")
    with pytest.raises(ValueError, match=r"MOEKIT_FP8_ACCUMULATION='sloppy': expected one of precise, fast"):
        launch.fp8_promote(cfg)


@pytest.mark.parametrize("scheme", ["fp8-tensor-static", "fp8-channel-token"])
def test_fast_accumulation_runs_and_a_bad_mode_is_refused(scheme, device, monkeypatch):
    w = random_weights(3, 160, 96, scheme, device=device)
    tw, ids = random_routing(5, 3, 2, device=device)
    x = random_x(5, 160, device=device)
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    check(x, w, tw, ids)
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "sloppy")
    with pytest.raises(ValueError, match="MOEKIT_FP8_ACCUMULATION"):
        moekit.fused_moe(x, w, tw, ids, backend="triton")


@pytest.mark.parametrize("M,K,experts", [(0, 2, None), (1, 1, None), (9, 2, [0, 2, 4]), (6, 5, None)])
@pytest.mark.parametrize("join", [0, 1])
def test_fast_mode_quantizes_the_intermediate_per_row(M, K, experts, join, device, monkeypatch):
    """Fast mode hands GEMM2 a per-row FP8 intermediate (A_MODE 5, quantized in its own pass,
    real rows only): the reference's own rule, so the check is the standard one. N = 208 leaves
    a partial 64-wide tile; experts 1 and 3 receive no tokens in one case; M = 0 and 1; both
    GEMM1 tiles."""
    from moekit.backends.triton import launch

    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    E, H, N = 5, 160, 208
    w = random_weights(E, H, N, "fp8-channel-token", device=device, seed=M)
    tw, ids = random_routing(M, E, K, device=device, seed=K, experts=experts)
    x = random_x(M, H, device=device, seed=M + 1)
    assert moekit.get_backend("triton").intermediate_granularity(w.scheme) == "token"
    cfg = KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=2, JOIN=join)
    align = align_pairs(ids, E, cfg.BLOCK_M)
    a, a_scale = launch.quantize_input(x, w)
    act = launch.gemm1(a, a_scale, w, align, K, x.dtype, cfg)
    assert act.a_mode == 5 and act.values.dtype == torch.float8_e4m3fn and act.scale.shape == (align.max_rows,)
    out = moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)
    assert out.shape == (M, H)
    if M:
        ref = reference_moe(x, w, tw, ids)  # per-token intermediate: the scheme's own rule
        assert rel_l2(out, ref) < REL_L2_TOL and max_rel(out, ref) < max_rel_tol(out)


@pytest.mark.parametrize("scheme", ["fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token", "fp8-block128"])
@pytest.mark.parametrize("M", [1, 3])
def test_x_is_quantized_in_chunks_of_columns_as_the_scheme_defines(scheme, M, device, monkeypatch):
    """quantize_input and the decode prologue (align_and_quantize) give each program
    QUANTIZE_CHUNK columns of a row where the row's scale needs no more (1x128 groups, per-tensor
    scales; per-token scales keep the whole row). Chunks of 256 over 600 columns: three programs
    per row, the last partial, ending in a partial 128-group. Both must give moekit.quant's FP8
    values and scales exactly (the same rule, divisions correctly rounded), whatever the chunk."""
    from moekit.backends.triton import launch
    from moekit.quant import quantize_activation

    monkeypatch.setattr(launch, "QUANTIZE_CHUNK", 256)
    E, H = 4, 600
    w = random_weights(E, H, 128, scheme, device=device, seed=M)
    x = random_x(M, H, device=device, seed=M) * 3.0  # beyond +-1: scales other than their floor
    static = w.a13_scale if w.scheme.static_activation else None
    expected_q, expected_scale = quantize_activation(x, w.scheme.activation, static)
    _, ids = random_routing(M, E, 2, device=device, seed=M)
    q, scale = launch.quantize_input(x, w)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(scale.reshape(expected_scale.shape), expected_scale)
    if launch._row_quant_mode(w.scheme) is not None:  # the decode prologue: row-wise schemes only
        _, q2, scale2 = launch.align_and_quantize(x, w, ids, 16)
        assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale2, scale)
    monkeypatch.setattr(launch, "QUANTIZE_CHUNK", 0)  # a whole row per program
    q3, scale3 = launch.quantize_input(x, w)
    assert torch.equal(q3.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale3, scale)


def with_accumulation_modes(schemes):
    """(scheme, mode) pairs: both modes where the mode changes the scheme's kernels
    (moekit.accumulation.accumulation_matters), precise alone where it does not (bf16,
    fp8-block128: the same kernels run in either mode)."""
    return [(s, mode) for s in schemes for mode in ("precise", "fast")
            if mode == "precise" or accumulation_matters(moekit.get_scheme(s))]


@pytest.mark.parametrize("scheme,accumulation", with_accumulation_modes(["bf16", "fp8-tensor-static", "fp8-tensor-dynamic",
                                                                       "fp8-channel-token"]))
def test_joined_gemm1_tile(scheme, accumulation, device, monkeypatch):
    """JOIN=1 (gate and up interleaved in one wide tile) against the reference, every scheme that
    allows it, in both accumulation modes where the mode matters. N = 208: the last tile is
    partial (BLOCK_N 64 and 128, the latter fusing the 1x128 group quantization); experts 1 and 3
    receive no tokens."""
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", accumulation)
    w = random_weights(5, 160, 208, scheme, device=device)
    tw, ids = random_routing(9, 5, 2, device=device, experts=[0, 2, 4])
    x = random_x(9, 160, device=device)
    ref = reference_for(x, w, tw, ids)
    for block_n in (64, 128):
        cfg = KernelConfig(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=64 if scheme == "bf16" else 128, GROUP_M=2, JOIN=1)
        out = moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)
        assert rel_l2(out, ref) < REL_L2_TOL and max_rel(out, ref) < max_rel_tol(out), (block_n, rel_l2(out, ref))


def test_fast_mode_joins_wide_fp8_tiles(monkeypatch):
    from moekit.backends.triton import launch

    token, block = moekit.get_scheme("fp8-channel-token"), moekit.get_scheme("fp8-block128")
    wide, narrow = KernelConfig(BLOCK_M=64, BLOCK_N=128), KernelConfig(BLOCK_M=16, BLOCK_N=128)
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    assert launch._joined(token, wide) == 1 and launch._joined(token, narrow) == 0
    assert launch._joined(block, wide) == 0 and launch._joined(moekit.get_scheme("bf16"), wide) == 0
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "precise")
    assert launch._joined(token, wide) == 0 and launch._joined(token, KernelConfig(JOIN=1)) == 1


def test_joined_tile_refuses_per_k_step_scales():
    block = moekit.get_scheme("fp8-block128")
    assert "JOIN=1 cannot apply fp8-block128" in " ".join(KernelConfig(BLOCK_N=128, JOIN=1).problems(block))
    assert "JOIN=2 must be 0 or 1" in " ".join(KernelConfig(JOIN=2).problems(moekit.get_scheme("bf16")))
    assert not KernelConfig(BLOCK_N=128, JOIN=1).problems(moekit.get_scheme("fp8-channel-token"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["glm-4.5v-fp8 tp2", "mixtral-8x7b"])
@pytest.mark.parametrize("M", [7, 300])
def test_gpu_fast_accumulation_at_preset_shapes(name, M, monkeypatch):
    """Tolerance: FAST_REL_L2_TOL (derived at its definition): fast accumulation measured 1.49e-2
    to 1.62e-2 relative L2 at these shapes with 64+ row tiles (H200): GEMM1's less exact sums move
    the intermediate values that lie near an FP8 rounding boundary by one FP8 step (up to 2**-3 of
    themselves). 3e-2 is ~1.85x the worst measured and 3x below what a wrong scale or row gives (1e-1)."""
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    E, H, N, K, scheme = PRESET_SHAPES[name]
    w = random_weights(E, H, N, scheme, device="cuda")
    tw, ids = random_routing(M, E, K, device="cuda", seed=M)
    x = random_x(M, H, device="cuda")
    out = moekit.fused_moe(x, w, tw, ids, backend="triton")
    assert rel_l2(out, reference_for(x, w, tw, ids)) < FAST_REL_L2_TOL
    assert torch.equal(moekit.fused_moe(x, w, tw, ids, backend="triton"), out)  # still deterministic


@pytest.mark.parametrize("scheme", ["fp8-channel-token", "fp8-block128"])
def test_group_quantization_fused_into_gemm1(scheme, device):
    # BLOCK_N = 128: GEMM1's epilogue quantizes each 1x128 group, GEMM2 reads FP8 (A_MODE 4);
    # N = 384 for the block scheme, 208 (a partial last group) otherwise
    N = 384 if scheme == "fp8-block128" else 208
    w = random_weights(3, 256, N, scheme, device=device)
    tw, ids = random_routing(5, 3, 2, device=device)
    x = random_x(5, 256, device=device)
    cfg = KernelConfig(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=4)
    out = moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)
    ref = reference_for(x, w, tw, ids)
    assert rel_l2(out, ref) < REL_L2_TOL and max_rel(out, ref) < max_rel_tol(out)


def test_gemm2_reads_an_fp8_intermediate_with_one_scale_per_row(device):
    """A_MODE 5 (scripts/diag_prefill.py times it: a per-token intermediate, as vLLM hands it
    to its second GEMM): each row's scale applied once, after the K loop, against float64."""
    from moekit.backends.triton import launch
    from moekit.check import _expert_weights64

    E, H, N, M, K = 3, 256, 256, 5, 2
    w = random_weights(E, H, N, "fp8-channel-token", device=device)
    tw, ids = random_routing(M, E, K, device=device)
    cfg = KernelConfig(16, 128, 128, 1, 4, 2)
    align = align_pairs(ids, E, cfg.BLOCK_M)
    values = (random_x(align.max_rows, N, device=device).float() * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(align.max_rows, 1, device=device) + 0.5
    out = launch.gemm2(launch.Intermediate(values, scale, 5), w, align, tw.float(), torch.bfloat16, cfg)
    start, count = align.start.tolist(), align.count.tolist()
    for e in range(E):
        rows = torch.arange(start[e], start[e] + count[e], device=device)
        if not len(rows):
            continue
        pairs = align.sorted_pairs.long()[rows]
        _, w2 = _expert_weights64(w, e)
        want = (values[rows].double() * scale[rows].double()) @ w2.T * tw.reshape(-1)[pairs].double()[:, None]
        # float32 accumulation (~2**-24 * sqrt(N) relative), then one bf16 rounding: at most 2**-8
        # (3.9e-3) of every element, so of the L2 norm too (measured 1.5e-3 to 1.7e-3, the RMS of
        # one rounding); 4e-3 is that worst case, far below a wrong scale (1e-1)
        assert rel_l2(out[pairs].double(), want) < 4e-3


@pytest.mark.parametrize("scheme", ["fp8-channel-token", "fp8-block128"])
def test_grouped_tile_order_with_a_short_last_group(device, scheme):
    """20 tokens x top-8 over 9 experts, BLOCK_M 32, GROUP_M 8: the last group of row blocks is
    short, so some programs of the grid map to a column block past the end. They must do nothing
    (they once wrote a tiny scale over the next row's group scale: relative error 0.34)."""
    w = random_weights(9, 128, 128, scheme, device=device)
    tw, ids = random_routing(20, 9, 8, device=device)
    x = random_x(20, 128, device=device)
    out = moekit.get_backend("triton").run(x, w, tw.float(), ids, config=KernelConfig(32, 128, 128, 8, 4, 4))
    ref = reference_for(x, w, tw, ids)
    assert rel_l2(out, ref) < REL_L2_TOL and max_rel(out, ref) < max_rel_tol(out)


def test_tuned_config_of_the_nearest_batch_size_in_log_space():
    from moekit.backends.triton.config import nearest

    a, b, c = KernelConfig(16, 64), KernelConfig(32, 64), KernelConfig(64, 128)
    table = {1: a, 64: b, 1024: c}
    # 8 is as far (in ratio) from 1 as from 64: the tie goes to the smaller size
    assert [nearest(table, m) for m in (0, 1, 8, 9, 300, 512, 100_000)] == [a, a, a, b, c, c, c]
    # every geometric midpoint of sizes up to 50 goes to the smaller size (float logs sent 122 of
    # them to the larger one, 6 between 4 and 9 among them); no overflow for huge sizes
    for lo in range(1, 50):
        for hi in range(lo + 1, 50):
            for m in range(lo, hi + 1):
                want = lo if m * m <= lo * hi else hi
                assert nearest({lo: a, hi: b}, m) == (a if want == lo else b), (lo, hi, m)
    assert nearest({1: a, 10**400: b}, 10**300) == b


@pytest.mark.parametrize("scheme", ["bf16", "fp8-channel-token", "fp8-block128"])
@pytest.mark.parametrize("M", [5, 70])  # 10 pairs: the one-launch decode prologue in run(); 140: the multi-program alignment
def test_gemm_only_closure_computes_the_layers_gemm2_rows(scheme, M, device):
    """prepare_gemm_only is what `moekit bench --mode gemm` and the tuner time: its output (the
    weighted GEMM2 row of every (token, expert) pair), combined, is the layer's output bitwise,
    so the timed closure runs the layer's own two GEMMs on the layer's own inputs (bench's
    accuracy check runs the whole layer)."""
    from moekit.backends.triton.launch import combine

    E, K = 5, 2
    w = random_weights(E, 256, 128, scheme, device=device)
    x = random_x(M, 256, device=device, seed=M)
    tw, ids = random_routing(M, E, K, device=device, seed=M, experts=[0, 1, 3, 4])  # expert 2 idle
    backend = moekit.get_backend("triton")
    pairs = backend.prepare_gemm_only(x, w, tw, ids)()
    assert pairs.shape == (M * K, 256)
    assert torch.equal(combine(pairs, M, K), backend.run(x, w, tw, ids))
