"""The triton backend's GEMV path (KernelConfig.GEMV = 1 or 2, backends/triton/gemv.py) against
`reference`: under TRITON_INTERPRET=1 on the CPU (small shapes), and at the preset shapes on a
GPU (marked `gpu`). The tolerances are test_triton_backend's (derived there): the GEMV path sums
the same quantized values in float32 (in another order) and rounds each pair's output to the
activations' dtype before the combine, as the tiled path does."""

import dataclasses

import pytest
import torch

import moekit
from moekit.backends.reference import reference_moe
from moekit.backends.triton import KernelConfig
from moekit.backends.triton.gemv import gemm2_groups, run_gemv

from helpers import assert_graph_replays_fresh_routing, max_rel, random_routing, random_weights, random_x, rel_l2
from test_triton_backend import (PRESET_SHAPES, REL_L2_TOL, SCHEMES, assert_matches_reference, max_rel_tol, reference_for,
                                 with_accumulation_modes)


def gemv(block_n=32, block_k=256, warps=2, late=False):
    # the interpreter runs one program at a time: CPU tests use wide column blocks, except where a
    # narrow one is the point (the GPU tests use the narrow blocks the tuner picks). late: GEMM1
    # reduces once after its K loop (GEMV=2) rather than each step
    return KernelConfig(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=1, num_warps=warps, num_stages=1,
                        GEMV=2 if late else 1)


def run(x, w, tw, ids, cfg):
    return moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)


def check(x, w, tw, ids, cfg):
    return assert_matches_reference(run(x, w, tw, ids, cfg), x, w, tw, ids)


@pytest.mark.parametrize("late", [False, True], ids=["step", "late"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(
    "E,H,N,M,K,cfg",
    [
        (3, 144, 128, 5, 2, gemv(64, 256)),  # hidden not a multiple of 128: a partial group in the one K step
        (5, 256, 128, 1, 1, gemv(4, 128)),  # M = 1, top-1, one group per K step
        (5, 128, 256, 3, 5, gemv(64, 512, 4)),  # top-k = E; a K step wider than the whole K
        (3, 384, 256, 4, 2, gemv(64, 256)),  # two K steps, the second half masked
        (3, 1152, 384, 2, 2, gemv(16, 1024)),  # steps of 1024: the second 1/8 full; GEMM2 one step, 3/8 full
    ],
)
def test_matches_reference(scheme, E, H, N, M, K, cfg, late, device):
    cfg = dataclasses.replace(cfg, GEMV=2 if late else 1)
    w = random_weights(E, H, N, scheme, device=device, seed=E * M)
    tw, ids = random_routing(M, E, K, device=device, seed=M)
    check(random_x(M, H, device=device, seed=K), w, tw, ids, cfg)


def test_late_reduction_adds_each_k_column_across_steps_before_reducing(device):
    """What GEMV=2 is, not only that it is right: GEMM1's products are added per K column across
    the K steps and reduced once (GEMV=1 reduces each step first). bf16 weights all 1, one row of
    x with 2**24 at k = 0, 1 at k = 1 and -2**24 at k = 128, K steps of 128: reduced per step,
    2**24 + 1 rounds to 2**24 in float32 and the gate and up sums are 0; added per column first,
    2**24 - 2**24 is exactly 0 and the sums are 1, whatever the order of either reduction."""
    from moekit.backends.triton import gemv as gemv_module

    w = random_weights(2, 256, 128, "bf16", device=device)
    w.w13.fill_(1.0)
    x = torch.zeros(1, 256, dtype=torch.bfloat16, device=device)
    x[0, 0], x[0, 1], x[0, 128] = 2.0**24, 1.0, -(2.0**24)
    ids = torch.zeros(1, 1, dtype=torch.int32, device=device)

    def act(cfg):  # SiLU(gate) * up of the one pair
        return gemv_module.gemv1(x, None, w, ids, torch.bfloat16, cfg, False)[0].float()

    assert torch.equal(act(gemv(32, 128)), torch.zeros(1, 128, device=device))
    one = torch.nn.functional.silu(torch.ones(1, 128, device=device)).to(torch.bfloat16).float()
    assert torch.equal(act(gemv(32, 128, late=True)), one)


@pytest.mark.parametrize("late", [False, True], ids=["step", "late"])
def test_masked_k_lanes_read_no_scale_past_their_row(late, device):
    """A K step of 512 over a hidden size of 256: the step's masked half must gather no 1x128
    group scale past the token's own (in a wider buffer here, NaN guards) nor a 128x128 block
    scale past the block row's own (the next row's: NaN in the rows of columns 128-255, so
    columns 0-127 must come out as with finite scales there)."""
    from moekit.backends.triton import gemv as gemv_module

    E, H, N, M, K = 3, 256, 256, 3, 2
    w = random_weights(E, H, N, "fp8-block128", device=device)
    tw, ids = random_routing(M, E, K, device=device)
    a, a_scale = gemv_module.quantize_input(random_x(M, H, device=device), w)
    cfg = gemv(64, 512, late=late)

    def act(a_scale):
        return gemv_module.gemv1(a, a_scale, w, ids, torch.bfloat16, cfg, False)[0]

    expected = act(a_scale)
    guarded = torch.full((M, 8), float("nan"), device=device)
    guarded[:, :2] = a_scale
    assert torch.equal(act(guarded[:, :2]), expected)
    w.w13_scale[:, 1::2] = float("nan")  # block rows 1 (gate) and 3 (up): columns 128-255
    out = act(a_scale)
    assert out[:, 128:].isnan().all() and torch.equal(out[:, :128], expected[:, :128])


@pytest.mark.parametrize("late", [False, True], ids=["step", "late"])
@pytest.mark.parametrize("scheme", ["bf16", "fp8-channel-token", "fp8-tensor-dynamic", "fp8-tensor-static"])
def test_intermediate_not_a_multiple_of_the_column_block(scheme, late, device):
    w = random_weights(3, 208, 96, scheme, device=device)  # N = 96 in column blocks of 64, hidden 208
    tw, ids = random_routing(7, 3, 2, device=device)
    check(random_x(7, 208, device=device), w, tw, ids, gemv(64, 256, late=late))


@pytest.mark.parametrize("late", [False, True], ids=["step", "late"])
@pytest.mark.parametrize("scheme", ["fp8-channel-token", "fp8-block128"])
def test_experts_without_tokens_and_all_on_one_expert(scheme, late, device):
    w = random_weights(5, 128, 128, scheme, device=device)
    x = random_x(6, 128, device=device)
    tw, ids = random_routing(6, 5, 2, device=device, experts=[1, 3])  # experts 0, 2, 4 idle
    check(x, w, tw, ids, gemv(64, late=late))
    tw, ids = random_routing(6, 5, 1, device=device, experts=[4])  # every token on expert 4
    check(x, w, tw, ids, gemv(64, late=late))


@pytest.mark.parametrize("late", [False, True], ids=["step", "late"])
def test_fp16_activations(late, device):
    w = random_weights(3, 128, 128, "bf16", dtype=torch.float16, device=device)
    tw, ids = random_routing(4, 3, 2, device=device)
    check(random_x(4, 128, dtype=torch.float16, device=device), w, tw, ids, gemv(late=late))


@pytest.mark.parametrize("late", [False, True], ids=["step", "late"])
@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "bf16"])
@pytest.mark.parametrize("M", [1, 5])
def test_fp16_activations_with_fp8_weights(scheme, M, late, device):
    """fp16 activations for every FP8 scheme on the GEMV path (the tiled path: test_triton_backend):
    hidden 144 (a partial group in the one K step), top-2 of 3 experts. fp16 rounds 8x finer than
    bf16, so the bf16-derived tolerances hold a fortiori."""
    w = random_weights(3, 144, 128, scheme, device=device, seed=M)
    tw, ids = random_routing(M, 3, 2, device=device, seed=M)
    check(random_x(M, 144, dtype=torch.float16, device=device, seed=M), w, tw, ids, gemv(64, 256, late=late))


@pytest.mark.parametrize("late", [False, True], ids=["step", "late"])
def test_m_zero_launches_nothing_and_returns_an_empty_output(late, device):
    w = random_weights(3, 128, 128, "fp8-channel-token", device=device)
    tw, ids = random_routing(0, 3, 2, device=device)
    out = run(random_x(0, 128, device=device), w, tw, ids, gemv(late=late))
    assert out.shape == (0, 128) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("M,K,experts", [(1, 1, None), (9, 2, [0, 2, 4]), (6, 5, None)])
def test_fast_mode_quantizes_the_intermediate_per_row(M, K, experts, device, monkeypatch):
    """In fast mode the backend declares the per-row rule for fp8-channel-token; the GEMV path's
    GEMM2 then finds each row's scale itself (A_MODE 5). N = 208 over K steps of 128: two steps,
    the second partial; the reference of the same rule is the scheme's own."""
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", "fast")
    E, H, N = 5, 160, 208
    w = random_weights(E, H, N, "fp8-channel-token", device=device, seed=M)
    tw, ids = random_routing(M, E, K, device=device, seed=K, experts=experts)
    x = random_x(M, H, device=device, seed=M + 1)
    out = run(x, w, tw, ids, gemv(64, 128))
    ref = reference_moe(x, w, tw, ids)  # per-token intermediate
    assert rel_l2(out, ref) < REL_L2_TOL and max_rel(out, ref) < max_rel_tol(out)
    # and the mode reached the kernel: out lies nearer the per-row reference than the per-group one
    # (precise mode's rule). The two references differ by 9e-3 to 2.3e-2 here, out's own error is
    # <= 2.8e-3: a kernel that quantized per group would lie nearer the group reference and fail.
    group = reference_moe(x, w, tw, ids, intermediate_granularity="group")
    assert rel_l2(out, ref) < rel_l2(out, group), (rel_l2(out, ref), rel_l2(out, group))


@pytest.mark.parametrize("scheme,accumulation", with_accumulation_modes(SCHEMES))
@pytest.mark.parametrize("K,groups", [(3, 2), (1, 8)])
def test_gemm2_reads_several_groups_per_pair(scheme, accumulation, K, groups, device, monkeypatch):
    """GEMM2 reads the token's pairs side by side, several 128-groups of N each per step
    (gemv.gemm2_groups: 2 x 4 groups of a 512 step over top-3 padded to 4 pairs, 8 for top-1),
    under both intermediate rules (both accumulation modes, where the mode matters). N = 336 (384
    for fp8-block128, whose N must be whole 128-row blocks): top-3 reads two steps, the second
    with one partial group (a whole one) and one past N; top-1 one step with a partial group (a
    whole one) and 5 of its 8 groups past N. Experts 0 and 4 idle in the first routing."""
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", accumulation)
    cfg = gemv(64, 512)
    assert gemm2_groups(cfg, K) == groups
    w = random_weights(5, 128, 384 if scheme == "fp8-block128" else 336, scheme, device=device, seed=3)
    x = random_x(4, 128, device=device)
    for experts in ([1, 2, 3], None):
        tw, ids = random_routing(4, 5, K, device=device, experts=experts)
        out = run(x, w, tw, ids, cfg)
        ref = reference_for(x, w, tw, ids)
        assert rel_l2(out, ref) < REL_L2_TOL and max_rel(out, ref) < max_rel_tol(out), (rel_l2(out, ref), max_rel(out, ref))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(
    "E,H,N,M,K,cfg",
    [
        # GEMM2 narrower than GEMM1, hidden 144 not a multiple of its 32 columns: a partial last block
        (3, 144, 128, 5, 2, gemv(64, 256).with_gemm2(BLOCK_N=32, num_warps=4)),
        # GEMM2 wider than GEMM1, on one warp; M = 1, top-1
        (5, 256, 128, 1, 1, gemv(4, 128).with_gemm2(BLOCK_N=64, num_warps=1)),
    ],
)
def test_gemm2_on_a_launch_of_its_own(scheme, E, H, N, M, K, cfg, device, monkeypatch):
    """GEMM2 of the GEMV path on its own column block and warps (BLOCK_N2, num_warps2): the same
    layer within the tolerances; the launch is GEMM2's, not GEMM1's (a GEMM2 launched with
    GEMM1's block would still be right, so the launch itself is checked)."""
    from moekit.backends.triton import gemv as gemv_module

    launches = []
    real = gemv_module._launch

    def recording(kernel, grid, *args, **kw):
        launches.append((kernel, grid, kw["BLOCK_N"], kw["num_warps"]))
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(gemv_module, "_launch", recording)
    w = random_weights(E, H, N, scheme, device=device, seed=E * M)
    tw, ids = random_routing(M, E, K, device=device, seed=M)
    check(random_x(M, H, device=device, seed=K), w, tw, ids, cfg)
    g2 = cfg.gemm2()
    assert (g2.BLOCK_N, g2.num_warps) == (cfg.BLOCK_N2, cfg.num_warps2) != (cfg.BLOCK_N, cfg.num_warps)
    by_kernel = {kernel: rest for kernel, *rest in launches}
    assert by_kernel[gemv_module.gk.gemv1_kernel] == [(M * K, -(-N // cfg.BLOCK_N)), cfg.BLOCK_N, cfg.num_warps]
    assert by_kernel[gemv_module.gk.gemv2_kernel] == [(M, -(-H // g2.BLOCK_N)), g2.BLOCK_N, g2.num_warps]


def test_gemm2_takes_a_k_step_of_its_own_where_asked(device, monkeypatch):
    """gemv.gemv2(groups=g) reads g 128-groups per pair and step instead of gemm2_groups' (what
    scripts/diag_gemv_gemm2_steps.py times), on any column block down to 1: the same products,
    summed across groups in another order, so the output within one bf16 step (2**-7 relative)."""
    from moekit.backends.triton import gemv as gemv_module

    asked = []
    real = gemv_module._launch
    monkeypatch.setattr(gemv_module, "_launch", lambda kernel, grid, *a, **kw: (
        asked.append((kw["GROUPS"], kw["BLOCK_N"])), real(kernel, grid, *a, **kw))[1])
    E, H, N, M, K = 6, 256, 384, 2, 4
    w = random_weights(E, H, N, "fp8-block128", device=device)
    tw, ids = random_routing(M, E, K, device=device)
    cfg = gemv(8, 256)
    a, a_scale = gemv_module.quantize_input(random_x(M, H, device=device), w)
    act, act_scale, a_mode = gemv_module.gemv1(a, a_scale, w, ids, torch.bfloat16, cfg, False)
    expected = gemv_module.gemv2(act, act_scale, a_mode, w, tw.float(), ids, torch.bfloat16, cfg)
    for block_n, groups in [(1, 4), (2, 2), (8, 1)]:
        launch = cfg.with_gemm2(BLOCK_N=block_n, num_warps=2, num_stages=1)
        out = gemv_module.gemv2(act, act_scale, a_mode, w, tw.float(), ids, torch.bfloat16, launch, groups=groups)
        assert asked[-1] == (groups, block_n)
        torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-6)


def test_config_rules_of_gemm2_on_the_gemv_path():
    token, block = moekit.get_scheme("fp8-channel-token"), moekit.get_scheme("fp8-block128")
    own = gemv(8, 512, 4).with_gemm2(BLOCK_N=16, num_warps=2)
    assert not own.problems(token) and own.has_gemm2
    assert own.gemm1() == gemv(8, 512, 4) and own.gemm2() == gemv(16, 512, 2)
    assert own.with_gemm2(BLOCK_N=8, num_warps=4) == gemv(8, 512, 4)  # GEMM1's launch again: unset
    assert own.with_gemm2(BLOCK_N=256).problems(block) == ["GEMM2: BLOCK_N=256 must divide 128 for 128x128 weight blocks"]
    assert own.with_gemm2(BLOCK_N=2).problems(token) == ["GEMM2: BLOCK_N=2 must be a power of two >= 4"]
    for tiled_only in ({"GROUP_M": 4}, {"N_TILES": 2}, {"OVERLAP": 1}):
        (name,) = tiled_only
        assert own.with_gemm2(**tiled_only).problems(token) == [
            f"{name}2 is for the tiled path; the GEMV path (GEMV=1) takes only BLOCK_N2, num_warps2 and num_stages2 "
            "of GEMM2's own"]
    assert not own.with_gemm2(num_stages=3).problems(token)  # GEMM2's own K-loop depth
    with pytest.raises(ValueError, match="GROUP_M2 is for the tiled path"):
        w = random_weights(3, 128, 128, "fp8-channel-token")
        tw, ids = random_routing(2, 3, 1)
        run(random_x(2, 128), w, tw, ids, own.with_gemm2(GROUP_M=2))


def test_run_gemv_is_what_the_backend_runs(device):
    w = random_weights(3, 128, 128, "fp8-channel-token", device=device)
    tw, ids = random_routing(2, 3, 2, device=device)
    x = random_x(2, 128, device=device)
    direct = run_gemv(x, w, tw.float(), ids, gemv(64), row_intermediate=False)
    assert torch.equal(direct, run(x, w, tw, ids, gemv(64)))
    # the closure `moekit bench --mode gemm` times: the same GEMMs on x quantized beforehand
    gemms = moekit.get_backend("triton").prepare_gemm_only(x, w, tw.float(), ids, config=gemv(64))
    assert torch.equal(gemms(), direct)


def test_config_rules_of_the_gemv_path():
    token = moekit.get_scheme("fp8-channel-token")
    assert not gemv(4, 512).problems(token)  # narrow columns and wide K steps are its point
    assert "BLOCK_N=4 must be a power of two >= 16" in KernelConfig(BLOCK_N=4).problems(token)  # not for tiles
    assert "BLOCK_K=64 must be a power of two >= 128 on the GEMV path (it reads K in whole groups of 128)" in \
        gemv(8, 64).problems(moekit.get_scheme("bf16"))
    assert not KernelConfig(BLOCK_M=1, BLOCK_N=8, BLOCK_K=256, GEMV=1).problems(token)  # it has no row tiles
    assert "BLOCK_N=12 must be a power of two >= 4" in gemv(12).problems(token)
    joined = KernelConfig(BLOCK_N=16, BLOCK_K=256, GEMV=1, JOIN=1).problems(token)
    assert any("the GEMV path (GEMV=1) has none" in p for p in joined)
    assert not gemv(4, 512, late=True).problems(token)  # GEMM1 reducing once after its K loop
    assert "GEMV=3 must be 0 (tiled), 1 or 2 (the GEMV path, GEMM1 reducing each K step or once)" in \
        KernelConfig(GEMV=3).problems(token)
    assert any("the GEMV path (GEMV=2) has none" in p for p in dataclasses.replace(gemv(16, 256, late=True), JOIN=1).problems(token))
    with pytest.raises(ValueError, match="must be a power of two >= 128"):
        w = random_weights(3, 128, 128, "fp8-channel-token")
        tw, ids = random_routing(2, 3, 1)
        run(random_x(2, 128), w, tw, ids, gemv(8, 64))


def test_vllm_export_says_why_it_skips_the_gemv_path():
    from moekit.tune.output import vllm_config, vllm_table

    cfg, why = vllm_config(gemv(), moekit.get_scheme("fp8-channel-token"))
    assert cfg is None and "no vLLM counterpart" in why
    tiled = KernelConfig(16, 64, 128, 1, 4, 3)
    journal = {  # the GEMV config fastest at M = 1: the export takes the tiled one and says so
        "problem": {"scheme": "fp8-channel-token", "num_experts": 8, "hidden": 256, "intermediate": 256, "top_k": 2},
        "fingerprint": {"device_name": "NVIDIA H200"}, "batch_size": 1,
        "configs": {"g": {"config": gemv().to_dict(), "us": 10.0}, "t": {"config": tiled.to_dict(), "us": 12.0}},
    }
    _, table, notes = vllm_table([journal])
    assert table["1"]["BLOCK_SIZE_N"] == 128
    assert notes == ["M=1: the table's config g not exported (the GEMV path (GEMV=1) has no vLLM counterpart)",
                     "M=1: exported t, the fastest that vLLM can take"]


def test_the_tiled_kernels_refuse_a_gemv_config(device):
    from moekit.backends.triton import launch

    w = random_weights(3, 128, 128, "fp8-channel-token", device=device)  # aligned for real: CUDA or the interpreter
    tw, ids = random_routing(2, 3, 1, device=device)
    align, a, a_scale = launch.align_and_quantize(random_x(2, 128, device=device), w, ids, 16)
    with pytest.raises(ValueError, match="config of the GEMV path"):
        launch.gemm1(a, a_scale, w, align, 1, torch.bfloat16, gemv())


def test_a_table_entry_of_the_gemv_path_stays_within_its_bound(monkeypatch):
    """A table tuned only at decode sizes: its GEMV entry runs at M = 1 and 2 (8 and 16 pairs on
    64 experts) but not at M = 8 (64 pairs > E / 2), where the nearest tiled entry runs, nor at
    prefill sizes of a table without a tiled entry, where the default runs."""
    from moekit import tables
    from moekit.backends.triton import config
    from moekit.spec import MoEShape

    shape, scheme = MoEShape(64, 1024, 256, 8), moekit.get_scheme("fp8-channel-token")
    tiled = KernelConfig(16, 64, 128, 1, 4, 3)
    monkeypatch.setattr(config, "tuned_configs", lambda *a: ({1: gemv(8, 512), 16: tiled}, None))
    assert config.get_config(shape, scheme, 1, "GPU") == gemv(8, 512)
    assert config.get_config(shape, scheme, 2, "GPU") == gemv(8, 512)
    assert config.get_config(shape, scheme, 8, "GPU") == tiled  # nearer to 1 in log space, yet tiled
    monkeypatch.setattr(config, "tuned_configs", lambda *a: ({1: gemv(8, 512)}, None))
    tables.clear_cache()  # another table: looked up afresh
    assert config.get_config(shape, scheme, 4096, "GPU") == config.default_config(shape, scheme, 4096)
    # an entry with GEMM2's own launch, read from its table's JSON: the same config, the same bound
    own = gemv(8, 512).with_gemm2(BLOCK_N=16, num_warps=4)
    entry = KernelConfig.from_table_entry({**own.to_dict(), "us": 40.0})
    assert entry == own and entry.gemm2() == gemv(16, 512, 4)
    monkeypatch.setattr(config, "tuned_configs", lambda *a: ({1: entry, 16: tiled}, None))
    tables.clear_cache()
    assert config.get_config(shape, scheme, 2, "GPU") == own
    assert config.get_config(shape, scheme, 8, "GPU") == tiled


@pytest.mark.parametrize("cfg", [gemv(64), gemv(64, late=True), KernelConfig(16, 64, 64, 1, 4, 2)],
                         ids=["gemv", "gemv-late", "tiled"])
def test_non_contiguous_activations(cfg, device):
    """Rows of x with a stride (a view of a wider buffer): both paths read x with unit stride."""
    w = random_weights(3, 128, 128, "bf16", device=device)
    tw, ids = random_routing(3, 3, 2, device=device)
    wide = random_x(3, 256, device=device)
    x = wide[:, ::2]
    assert not x.is_contiguous()
    out = run(x, w, tw, ids, cfg)
    assert torch.equal(out, run(x.contiguous(), w, tw, ids, cfg))
    assert rel_l2(out, reference_for(x.contiguous(), w, tw, ids)) < REL_L2_TOL


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.parametrize("late", [False, True], ids=["step", "late"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("stages", [2, 3])
def test_pipelined_k_loops_give_the_same_bits(scheme, stages, late, device, monkeypatch):
    """num_stages > 1 pipelines both GEMV kernels' K loops (tl.range(num_stages=...)): loads move
    ahead, the sums and their order do not, so the output is bitwise that of the unpipelined loops
    (and so within the reference's tolerances). Hidden 640 and N 256 give GEMM1 three steps of 256
    (the last half masked) and GEMM2 two of one 128-group per pair at top-4.
    The launch is checked too: each kernel gets its config's depth (GEMM2 its own launch's,
    num_stages2, where set), since the interpreter runs a pipelined loop as a plain one, and GEMM1
    its config's reduction (LATE for GEMV=2)."""
    from moekit.backends.triton import gemv as gemv_module

    depths, lates = {}, []
    real = gemv_module._launch

    def recording(kernel, grid, *args, **kw):
        depths[kernel] = (kw["STAGES"], kw["num_stages"])
        if "LATE" in kw:
            lates.append(kw["LATE"])
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(gemv_module, "_launch", recording)
    E, H, N, M, K = 6, 640, 256, 3, 4
    w = random_weights(E, H, N, scheme, device=device, seed=stages)
    tw, ids = random_routing(M, E, K, device=device, seed=stages)
    x = random_x(M, H, device=device, seed=stages)
    plain = gemv(64, 256, late=late)
    pipelined = dataclasses.replace(plain, num_stages=stages)
    expected = run(x, w, tw, ids, plain)
    assert torch.equal(check(x, w, tw, ids, pipelined), expected)
    assert depths == {gemv_module.gk.gemv1_kernel: (stages, stages), gemv_module.gk.gemv2_kernel: (stages, stages)}
    # GEMM2 on a depth of its own (num_stages2), GEMM1 unpipelined
    assert torch.equal(run(x, w, tw, ids, plain.with_gemm2(num_stages=stages)), expected)
    assert depths == {gemv_module.gk.gemv1_kernel: (1, 1), gemv_module.gk.gemv2_kernel: (stages, stages)}
    assert lates == [late] * 3  # GEMM1 launched three times, each with the config's reduction


_COMPILE_PIPELINED = """
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moekit.backends.triton import _gemv_kernels as g

POINTERS = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "out_ptr": "*bf16", "ids_ptr": "*i32"}
GEMV1 = {"A_SCALE": 2, "B_SCALE": 2, "OUT_MODE": 0, "ACT_DTYPE": tl.bfloat16, "BLOCK_N": 8, "GROUPS": 4}
CONSTANTS = {  # fp8 per-channel weights; GEMM1 in steps of 512 (reducing each step, then once), GEMM2 one 128-group per pair at top-8
    "gemv1_kernel": ("gemv1_kernel", {**GEMV1, "LATE": False}),
    "gemv1_kernel late": ("gemv1_kernel", {**GEMV1, "LATE": True}),
    "gemv2_kernel": ("gemv2_kernel", {"A_MODE": 1, "B_SCALE": 2, "K_TOP": 8, "K_POW2": 8, "BLOCK_N": 8, "GROUPS": 1}),
}
found = {}
for name, (kernel_name, constants) in CONSTANTS.items():
    kernel = getattr(g, kernel_name)
    for stages in (1, 3):
        signature, consts, attrs = {}, {}, {}
        for i, param in enumerate(kernel.params):
            n = param.name
            if param.is_constexpr:
                signature[n] = "constexpr"
                consts[(i,)] = {**constants, "STAGES": stages, "INTERPRET": False, "CHECK_IDS": False, "PDL": False}[n]
            else:
                signature[n] = POINTERS.get(n, "*fp32") if n.endswith("_ptr") else "i32"
                attrs[(i,)] = [["tt.divisibility", 16]]  # as a launch on aligned tensors and strides specializes
        compiled = triton.compile(ASTSource(kernel, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 2, "num_stages": stages})
        found[f"{name} {stages}"] = [compiled.asm["ttgir"].count("async_copy_global_to_local"), compiled.metadata.shared]
json.dump(found, sys.stdout)
"""


def test_pipelined_k_loops_compile_to_async_copies_for_hopper():
    """What the interpreter cannot show: compiled for sm_90 (without a GPU, in a process of its
    own), STAGES > 1 turns both kernels' K-loop loads (GEMM1 reducing each step or late) into cp.async copies into shared memory,
    holding at least the pipeline's tiles (space.gemv_shared_memory_bytes: GEMM1 2 x (512 + 2 x 8
    x 512) bytes, GEMM2 2 x 8 rows x 128 x (1 + 8)), and STAGES = 1 copies nothing."""
    import json

    from moekit.tune.space import gemv_shared_memory_bytes

    from helpers import compile_in_child

    found = json.loads(compile_in_child(["-c", _COMPILE_PIPELINED]))
    for name in ("gemv1_kernel", "gemv1_kernel late", "gemv2_kernel"):
        assert found[f"{name} 1"][0] == 0 and found[f"{name} 3"][0] > 0, found
    static = moekit.get_scheme("fp8-tensor-static")  # GEMM2's input fp8, as A_MODE 1
    gemm1_only = KernelConfig(16, 8, 512, 1, 2, 3, GEMV=1).with_gemm2(num_stages=1)
    gemm2_only = KernelConfig(16, 8, 512, 1, 2, 1, GEMV=1).with_gemm2(num_stages=3)
    for name in ("gemv1_kernel", "gemv1_kernel late"):  # the same tiles loaded either way
        assert found[f"{name} 3"][1] >= gemv_shared_memory_bytes(gemm1_only, static, 8) == 2 * (512 + 2 * 8 * 512)
    assert found["gemv2_kernel 3"][1] >= gemv_shared_memory_bytes(gemm2_only, static, 8) == 2 * 8 * 128 * (1 + 8)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(PRESET_SHAPES))
@pytest.mark.parametrize("M", [1, 3])
def test_gpu_preset_shapes(name, M):
    E, H, N, K, scheme = PRESET_SHAPES[name]
    w = random_weights(E, H, N, scheme, device="cuda")
    tw, ids = random_routing(M, E, K, device="cuda", seed=M)
    # the narrowest and widest blocks of the search space, GEMM1 reducing each step, then once
    for cfg in (gemv(4, 512), gemv(16, 256, 4), gemv(4, 512, late=True), gemv(8, 1024, 4, late=True)):
        check(random_x(M, H, device="cuda"), w, tw, ids, cfg)


@pytest.mark.gpu
def test_gpu_bitwise_deterministic_and_graph_replay_with_fresh_routing():
    E, H, N, K, scheme = PRESET_SHAPES["deepseek-v3 tp8"]
    M = 2
    w = random_weights(E, H, N, scheme, device="cuda")
    x = random_x(M, H, device="cuda")
    tw, ids = random_routing(M, E, K, device="cuda", seed=1)
    for cfg in (gemv(8, 512), gemv(8, 512, late=True)):
        first = run(x, w, tw, ids, cfg)
        for _ in range(5):
            assert torch.equal(run(x, w, tw, ids, cfg), first)
        assert_graph_replays_fresh_routing(lambda x, tw, ids, cfg=cfg: run(x, w, tw, ids, cfg), x, tw, ids, E)
