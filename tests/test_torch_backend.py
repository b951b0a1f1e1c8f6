"""The `torch` backend (grouped_mm / per-expert loop on unquantized weights) against `reference`.

Error budget, measured on the CPU (E=3..128, H=64..4096, N=45..1536, M=1..200; rel_l2 / max_rel).
bf16 keeps 8 significant bits: a round-to-nearest moves a value by at most 2**-8 of itself, and
random roundings by 1.66e-3 RMS (2**-7 * sqrt(0.541) / sqrt(12): uniform within half a unit, a unit
being 2**-7..2**-8 of the value over a binade).
  - unquantized: both GEMMs produce x's dtype (bf16) where the reference keeps float32. h (gate
    and up, reaching the intermediate through their product) and each pair's y are rounded, and
    the intermediate's and the output's roundings, which the reference makes too, fall on
    slightly different values: ~6 roundings, ~sqrt(6) x 1.66e-3 = 4.1e-3 RMS; measured
    4.4e-3..5.1e-3 / <= 7.8e-3. All six at their worst in one element would give
    6 x 2**-8 = 2.3e-2 (more only in SiLU's far negative tail, whose values are tiny).
  - FP8 schemes: the weights are dequantized to bf16 (<= 2**-8 per weight) and the activations are
    NOT quantized, so against `reference` on the very same bf16 weights (as an unquantized scheme)
    the budget above holds (3.5e-3..5.1e-3 / <= 7.8e-3), while against the FP8 reference the
    difference is the reference's activation quantization noise: an e4m3 rounding is ~2.7% RMS
    relative (half a step of 6.7..12.5%, uniform), once for x and once for the intermediate:
    measured 4.2e-2..4.7e-2 / <= 6.1e-2. (With static scales, activations beyond the calibrated
    range also saturate in the reference; the test data stays within the calibration here.)
"""

import pytest
import torch

import moekit
from moekit.backends import torch_backend
from moekit.backends.glue import ops
from moekit.backends.reference import reference_moe

from helpers import capture_graph, max_rel, random_routing, random_weights, random_x, rel_l2

SCHEMES = ["bf16", "fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token", "fp8-block128"]
# measured <= 5.1e-3 (L2), <= 7.8e-3 (max): 2x the worst L2 and 2.4x the RMS estimate; the max
# bound stays below the 2.3e-2 of six worst-case roundings in one element
UNQUANTIZED_TOL, UNQUANTIZED_TOL_MAX = 1e-2, 2e-2
ACTIVATION_NOISE_TOL, ACTIVATION_NOISE_TOL_MAX = 8e-2, 1.2e-1  # measured <= 4.7e-2, <= 6.1e-2


def dequantized_twin(w: moekit.MoEWeights, dtype=torch.bfloat16) -> moekit.MoEWeights:
    """The weights the torch backend really multiplies (bf16 or fp16), as an unquantized scheme."""
    w13, w2 = torch_backend.prepared_weights(w, dtype)
    return moekit.MoEWeights("bf16", w13, w2)


def check_against_reference(out, x, w, tw, ids):
    assert out.shape == x.shape and out.dtype == x.dtype
    if w.scheme.is_fp8:
        twin = reference_moe(x, dequantized_twin(w, x.dtype), tw, ids)
        assert rel_l2(out, twin) < UNQUANTIZED_TOL and max_rel(out, twin) < UNQUANTIZED_TOL_MAX
        ref = reference_moe(x, w, tw, ids)
        assert rel_l2(out, ref) < ACTIVATION_NOISE_TOL and max_rel(out, ref) < ACTIVATION_NOISE_TOL_MAX
    else:
        ref = reference_moe(x, w, tw, ids)
        assert rel_l2(out, ref) < UNQUANTIZED_TOL and max_rel(out, ref) < UNQUANTIZED_TOL_MAX


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("E,H,N,M,K", [(3, 200, 128, 5, 2), (7, 136, 256, 9, 3), (4, 64, 128, 1, 1)])
def test_matches_reference(scheme, E, H, N, M, K):
    w = random_weights(E, H, N, scheme, seed=E + M)
    x = random_x(M, H, seed=M)
    tw, ids = random_routing(M, E, K, seed=E)
    check_against_reference(moekit.fused_moe(x, w, tw, ids, backend="torch"), x, w, tw, ids)


@pytest.mark.parametrize("scheme", ["bf16", "fp8-channel-token", "fp8-tensor-dynamic", "fp8-tensor-static"])
def test_odd_sizes(scheme):
    w = random_weights(5, 97, 45, scheme)  # neither dimension a multiple of 8
    x = random_x(6, 97)
    tw, ids = random_routing(6, 5, 2)
    check_against_reference(moekit.fused_moe(x, w, tw, ids, backend="torch"), x, w, tw, ids)


@pytest.mark.parametrize("scheme", ["bf16", "fp8-block128"])
def test_experts_without_tokens_and_one_expert_for_all(scheme):
    w = random_weights(7, 128, 128, scheme)
    x = random_x(9, 128)
    for experts in ([1, 5], [3]):  # five experts idle; then every token on expert 3 (top-1)
        tw, ids = random_routing(9, 7, len(experts), experts=experts)
        check_against_reference(moekit.fused_moe(x, w, tw, ids, backend="torch"), x, w, tw, ids)


def test_empty_batch():
    w = random_weights(3, 64, 32, "fp8-channel-token")
    x = random_x(0, 64)
    tw, ids = random_routing(0, 3, 2)
    assert moekit.fused_moe(x, w, tw, ids, backend="torch").shape == (0, 64)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_run_with_no_tokens(scheme, dtype):
    """The backend's run() itself with zero rows (fused_moe returns before it at M = 0), given
    what fused_moe gives it (validate_inputs: float32 weights, int32 ids), for every scheme and
    activation dtype it claims."""
    from moekit.api import validate_inputs

    N = 128 if scheme == "fp8-block128" else 45  # 128x128 blocks need whole blocks of N
    w = random_weights(3, 97, N, scheme, dtype=torch.float16 if dtype == torch.float16 else torch.bfloat16)
    x = random_x(0, 97, dtype=dtype)
    tw, ids = random_routing(0, 3, 2)
    backend = moekit.get_backend("torch")
    assert backend.supports(w.shape(2), w.scheme, x.device, dtype) == []
    tw, ids = validate_inputs(x, w, tw, ids, device_check=False)
    out = backend.run(x, w, tw, ids)
    assert out.shape == (0, 97) and out.dtype == dtype and out.device == x.device


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_activation_dtypes(dtype):
    """fp16 and float32 activations: weights cast/dequantized once to that dtype."""
    x = random_x(5, 96, dtype=dtype)
    tw, ids = random_routing(5, 4, 2)
    w = random_weights(4, 96, 64, "bf16", dtype=torch.float16 if dtype == torch.float16 else torch.bfloat16)
    out = moekit.fused_moe(x, w, tw, ids, backend="torch")
    assert out.dtype == dtype
    # float32 computes in float32 throughout (only summation order differs); fp16 rounds h, the
    # intermediate and y to 2**-11 where bf16 rounds to 2**-8.
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel_l2(out, reference_moe(x, w, tw, ids)) < tol
    w8 = random_weights(4, 96, 64, "fp8-channel-token")
    out = moekit.fused_moe(x, w8, tw, ids, backend="torch")
    assert out.dtype == dtype and w8.prepared["torch"][dtype][0].dtype == dtype
    if dtype == torch.float16:
        assert rel_l2(out, reference_moe(x, dequantized_twin(w8, dtype), tw, ids)) < tol
    else:  # float32 weights exactly as the reference's; only the activation quantization differs
        ref = reference_moe(x, w8, tw, ids)
        assert rel_l2(out, ref) < ACTIVATION_NOISE_TOL and max_rel(out, ref) < ACTIVATION_NOISE_TOL_MAX


def test_weights_prepared_once():
    w = random_weights(3, 64, 32, "fp8-tensor-static")
    x = random_x(4, 64)
    tw, ids = random_routing(4, 3, 2)
    moekit.fused_moe(x, w, tw, ids, backend="torch")
    w13 = w.prepared["torch"][torch.bfloat16][0]
    assert w13.dtype == torch.bfloat16 and w13.shape == w.w13.shape
    moekit.fused_moe(x, w, tw, ids, backend="torch")
    assert w.prepared["torch"][torch.bfloat16][0] is w13
    # unquantized weights of the right dtype are used as they are, not copied
    wb = random_weights(3, 64, 32, "bf16")
    moekit.fused_moe(x, wb, tw, ids, backend="torch")
    from moekit.backends.torch_backend import prepared_weights

    assert prepared_weights(wb, torch.bfloat16)[0] is wb.w13 and "torch" not in wb.prepared


def test_deterministic():
    w = random_weights(5, 64, 48, "fp8-tensor-dynamic")
    x = random_x(11, 64)
    tw, ids = random_routing(11, 5, 3)
    first = moekit.fused_moe(x, w, tw, ids, backend="torch")
    assert torch.equal(first, moekit.fused_moe(x, w, tw, ids, backend="torch"))


def test_triton_glue_in_the_loop(monkeypatch):
    """The loop path with the Triton glue (as on a GPU without grouped_mm), in the interpreter."""
    if not ops.interpreting():
        pytest.skip("CPU tensors reach the Triton glue only under TRITON_INTERPRET=1")
    w = random_weights(4, 48, 32, "bf16")
    x = random_x(5, 48)
    tw, ids = random_routing(5, 4, 2, experts=[0, 2, 3])
    plain = moekit.fused_moe(x, w, tw, ids, backend="torch")
    monkeypatch.setattr(torch_backend, "_glue_impl", lambda device: "triton")
    out = moekit.fused_moe(x, w, tw, ids, backend="torch")
    # Same GEMMs on the same bf16 values; the two glues' SiLU may differ by one bf16 unit (<= 2**-7
    # of the value) in fewer than 1% of the intermediate's elements (test_glue's bound; none
    # measured on the CPU). No FP8 rounding amplifies it here: that moves the intermediate by
    # <= 2**-7 * sqrt(0.01) = 7.8e-4 in relative L2, which GEMM2 carries linearly; the roundings of
    # y and of the output then differ only where a value moved, adding at most as much again: 2e-3.
    assert rel_l2(out, plain) < 2e-3
    check_against_reference(out, x, w, tw, ids)


def test_grouped_path_wiring_on_cpu():
    """The grouped_mm path (SM90 on a GPU) through torch's CPU grouped_mm where this torch has
    one, with the Triton glue in the interpreter: padding of the groups, offs, transposed views."""
    gmm = torch_backend.grouped_mm_fn()
    a = torch.zeros(32, 16, dtype=torch.bfloat16)
    try:
        gmm(a, torch.zeros(2, 16, 16, dtype=torch.bfloat16), offs=torch.tensor([16, 32], dtype=torch.int32))
    except Exception:  # noqa: BLE001 - older torch: grouped_mm is CUDA only
        pytest.skip("this torch has no CPU grouped_mm")
    w = random_weights(5, 64, 48, "fp8-channel-token")
    x = random_x(6, 64)
    tw, ids = random_routing(6, 5, 2, experts=[0, 1, 4])
    w13, w2 = torch_backend.prepared_weights(w, torch.bfloat16)
    out = torch_backend._run_grouped(x, w13, w2, tw, ids, gmm)
    loop = moekit.fused_moe(x, w, tw, ids, backend="torch")
    # The same bf16 products; the paths differ in the glue (the Triton glue's SiLU: < 1% of the
    # intermediate off by one bf16 unit, as in test_triton_glue_in_the_loop) and possibly in the
    # order of the float32 sums (~2**-24 * sqrt(H) relative, which flips a bf16 rounding of h in
    # ~2**-24 * 8 / 2**-8 = 0.01% of its elements): each a unit (<= 2**-7) in a small fraction of
    # the elements, carried linearly (no FP8 rounding in this backend): <= 2e-3 as there.
    # Measured 0 on the CPU.
    assert rel_l2(out, loop) < 2e-3
    check_against_reference(out, x, w, tw, ids)


def test_supports():
    b = moekit.get_backend("torch")
    shape = moekit.MoEShape(8, 200, 45, 2)
    for scheme in SCHEMES:
        assert b.supports(shape, moekit.get_scheme(scheme), torch.device("cpu")) == []
    assert b.supports(shape, moekit.get_scheme("bf16"), torch.device("cpu"), torch.float32) == []
    assert "bfloat16, float16 or float32" in b.supports(shape, moekit.get_scheme("bf16"), torch.device("cpu"), torch.int8)[0]


# --------------------------------------------------------------------------------- GPU

# Real preset shapes: GLM-4.5V at tp2 (E=128, H=4096, N=704, top-8), Mixtral-8x7B (E=8,
# H=4096, N=14336, top-2).
PRESETS = {"glm-4.5v-tp2": (128, 4096, 704, 8), "mixtral": (8, 4096, 14336, 2)}


def gpu_weights(E, H, N, scheme, seed=0):
    """Random weights made and quantized on the GPU (Mixtral's float32 copy would be slow on the host)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(E, 2 * N, H, device="cuda", generator=g) / H**0.5
    w2 = torch.randn(E, H, N, device="cuda", generator=g) / N**0.5
    scheme = moekit.get_scheme(scheme)
    kw = {"calibration": torch.randn(64, H, device="cuda", generator=g)} if scheme.static_activation else {}
    if not scheme.is_fp8:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    return moekit.quantize_weights(w13, w2, scheme, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("scheme", ["bf16", "fp8-channel-token", "fp8-block128"])
def test_gpu_grouped_mm_at_preset_shapes(preset, scheme):
    E, H, N, K = PRESETS[preset]
    if scheme == "fp8-block128" and N % 128:
        pytest.skip(f"N={N} is not a multiple of 128")
    w = gpu_weights(E, H, N, scheme)
    for M, experts in ((1, None), (96, None), (40, list(range(0, E, 3))[: max(K, E // 3)])):
        tw, ids = random_routing(M, E, K, device="cuda", seed=M, experts=experts)
        x = random_x(M, H, device="cuda", seed=M)
        out = moekit.fused_moe(x, w, tw, ids, backend="torch")
        check_against_reference(out, x, w, tw, ids)
        assert torch.equal(out, moekit.fused_moe(x, w, tw, ids, backend="torch"))  # deterministic


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_matches_eager():
    E, H, N, K = PRESETS["glm-4.5v-tp2"]
    w = gpu_weights(E, H, N, "fp8-channel-token")
    M = 64
    x = random_x(M, H, device="cuda")
    tw, ids = random_routing(M, E, K, device="cuda")
    if not torch_backend._use_grouped_mm(x, w):
        pytest.skip("grouped_mm path not available on this GPU (the loop path syncs, no graphs)")
    sx, stw, sids = x.clone(), tw.clone(), ids.clone()
    graph, sout = capture_graph(lambda: moekit.fused_moe(sx, w, stw, sids, backend="torch"))
    for seed in (1, 2):  # fresh routing and activations, same M
        tw2, ids2 = random_routing(M, E, K, device="cuda", seed=seed)
        x2 = random_x(M, H, device="cuda", seed=seed)
        sx.copy_(x2), stw.copy_(tw2), sids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(sout, moekit.fused_moe(x2, w, tw2, ids2, backend="torch"))


@pytest.mark.gpu
def test_gpu_loop_path_fp16():
    """fp16 activations take the per-expert loop on the GPU (grouped_mm is bf16 only)."""
    w = gpu_weights(16, 1024, 256, "fp8-tensor-dynamic")
    x = random_x(33, 1024, dtype=torch.float16, device="cuda")
    tw, ids = random_routing(33, 16, 4, device="cuda", experts=list(range(10)))
    out = moekit.fused_moe(x, w, tw, ids, backend="torch")
    twin = reference_moe(x, dequantized_twin(w, torch.float16), tw, ids)
    # fp16 keeps 11 significant bits: each rounding <= 2**-11 relative. The six roundings of the
    # budget above (h's two, the intermediate's, y's, the two outputs') bound every element
    # (outside SiLU's far negative tail) by 6 * 2**-11 = 2.9e-3, hence the L2 too; random
    # roundings give ~sqrt(6) * 1.66e-3 / 8 = 5e-4 (4.6e-4 measured on the CPU, fp16 in
    # test_other_activation_dtypes).
    assert out.dtype == torch.float16 and rel_l2(out, twin) < 3e-3
