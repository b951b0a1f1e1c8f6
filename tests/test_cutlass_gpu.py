"""The `cutlass` backend on a Hopper GPU, at real preset shapes, against `reference`.

Tolerances (see also test_glue.py, where the same pipeline runs on the CPU with an emulated GEMM):
  - against `reference` (float32 on the same quantized inputs): the pipeline rounds GEMM1's
    output to bf16 before the SiLU, which moves the FP8 rounding of a few percent of the
    intermediate by one e4m3 step (and, per tensor, can move the dynamic amax and so every
    element's rounding). Emulated exactly at GLM/Mixtral-like shapes: rel_l2 1.3e-2..2.5e-2,
    max_rel <= 3.1e-2. Bounds: CUTLASS_TOL_L2 = 4e-2, CUTLASS_TOL_MAX = 8e-2.
  - against that emulation (the same glue, the GEMM done in float32 per group, rounded to bf16):
    only the GPU's FP8 accumulation (its order, its precision) differs. Modelled as 1e-4 relative
    noise on every GEMM output, the emulation moved by <= 6.3e-3 (L2) and <= 2.2e-2 (max): bound
    1.5e-2 (L2). Per-tensor dynamic schemes get 3e-2: there one flipped bf16 unit of the
    intermediate's largest element moves the scale of all of it (~2e-2 in L2).
"""

import zlib

import pytest
import torch

import moekit
from moekit.backends import cutlass
from moekit.backends.glue import ops
from moekit.backends.reference import _exact_fp32_matmul, reference_moe

from helpers import capture_graph, max_rel, random_routing, random_x, rel_l2
from test_glue import CUTLASS_TOL_L2, CUTLASS_TOL_MAX, bits, check_layout, emulated_scaled_grouped_mm
from test_torch_backend import gpu_weights

pytestmark = pytest.mark.gpu

# E, H, N (per GPU), top-k
PRESETS = {"glm-4.5v-tp2": (128, 4096, 704, 8), "mixtral": (8, 4096, 14336, 2)}
SCHEMES = ["fp8-tensor-static", "fp8-tensor-dynamic", "fp8-channel-token"]
EMULATION_TOL = {"fp8-tensor-dynamic": 3e-2}  # others: 1.5e-2


@pytest.fixture(scope="module")
def weights():
    cache = {}

    def get(preset, scheme):
        if (preset, scheme) not in cache:
            E, H, N, _ = PRESETS[preset]
            # the seed names the case, so a test's weights do not depend on which tests ran before
            seed = zlib.crc32(f"{preset}/{scheme}".encode())
            cache[(preset, scheme)] = gpu_weights(E, H, N, scheme, seed=seed)
        return cache[(preset, scheme)]

    yield get
    cache.clear()
    torch.cuda.empty_cache()


def emulated(x, w, tw, ids):
    with _exact_fp32_matmul():
        return cutlass.run_cutlass(x, w, tw, ids, gemm=emulated_scaled_grouped_mm)


def check(out, x, w, tw, ids):
    assert out.shape == x.shape and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    ref = reference_moe(x, w, tw, ids)
    assert rel_l2(out, ref) < CUTLASS_TOL_L2, rel_l2(out, ref)
    assert max_rel(out, ref) < CUTLASS_TOL_MAX, max_rel(out, ref)
    emu = emulated(x, w, tw, ids)
    assert rel_l2(out, emu) < EMULATION_TOL.get(w.scheme.name, 1.5e-2), rel_l2(out, emu)


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M", [1, 200])
def test_matches_reference(weights, preset, scheme, M):
    E, H, N, K = PRESETS[preset]
    w = weights(preset, scheme)
    x = random_x(M, H, device="cuda", seed=M)
    tw, ids = random_routing(M, E, K, device="cuda", seed=M)
    out = moekit.fused_moe(x, w, tw, ids, backend="cutlass")
    check(out, x, w, tw, ids)
    for _ in range(2):  # bitwise deterministic
        assert torch.equal(out, moekit.fused_moe(x, w, tw, ids, backend="cutlass"))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_experts_without_tokens(weights, preset):
    E, H, N, K = PRESETS[preset]
    w = weights(preset, "fp8-channel-token")
    experts = list(range(1, E, 4))[: max(K, E // 4)]  # most experts idle
    for M in (1, 3, 37):
        x = random_x(M, H, device="cuda", seed=M)
        tw, ids = random_routing(M, E, K, device="cuda", seed=M, experts=experts)
        check(moekit.fused_moe(x, w, tw, ids, backend="cutlass"), x, w, tw, ids)


def test_all_tokens_on_one_expert(weights):
    E, H, N, _ = PRESETS["glm-4.5v-tp2"]
    w = weights("glm-4.5v-tp2", "fp8-tensor-dynamic")
    x = random_x(50, H, device="cuda")
    tw, ids = random_routing(50, E, 1, device="cuda", experts=[77])
    check(moekit.fused_moe(x, w, tw, ids, backend="cutlass"), x, w, tw, ids)


def test_empty_batch(weights):
    E, H, N, K = PRESETS["glm-4.5v-tp2"]
    w = weights("glm-4.5v-tp2", "fp8-channel-token")
    x = random_x(0, H, device="cuda")
    tw, ids = random_routing(0, E, K, device="cuda")
    out = moekit.fused_moe(x, w, tw, ids, backend="cutlass")
    assert out.shape == (0, H) and out.device.type == "cuda"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_run_with_no_tokens(weights, scheme):
    """The backend's run() itself with zero rows (fused_moe returns before it at M = 0), given
    what fused_moe gives it (validate_inputs: float32 weights, int32 ids), for every scheme it
    claims."""
    from moekit.api import validate_inputs

    E, H, _, K = PRESETS["glm-4.5v-tp2"]
    w = weights("glm-4.5v-tp2", scheme)
    backend = moekit.get_backend("cutlass")
    x = random_x(0, H, device="cuda")
    assert backend.supports(w.shape(K), w.scheme, x.device, x.dtype) == []
    tw, ids = validate_inputs(x, w, *random_routing(0, E, K, device="cuda"), device_check=False)
    out = backend.run(x, w, tw, ids)
    torch.cuda.synchronize()
    assert out.shape == (0, H) and out.dtype == torch.bfloat16 and out.device.type == "cuda"


@pytest.mark.parametrize("scheme", ["fp8-channel-token", "fp8-tensor-dynamic", "fp8-tensor-static"])
def test_cuda_graph_replay_matches_eager(weights, scheme):
    E, H, N, K = PRESETS["glm-4.5v-tp2"]
    w = weights("glm-4.5v-tp2", scheme)
    M = 48
    sx = random_x(M, H, device="cuda")
    stw, sids = random_routing(M, E, K, device="cuda")
    # the warm-up covers preparation, the GEMM choice and Triton compilation
    graph, sout = capture_graph(lambda: moekit.fused_moe(sx, w, stw, sids, backend="cutlass"))
    for seed in (1, 2, 3):  # fresh routing and activations, same M; seed 3: a few experts only
        experts = list(range(0, E, 16)) if seed == 3 else None
        tw, ids = random_routing(M, E, K, device="cuda", seed=seed, experts=experts)
        x = random_x(M, H, device="cuda", seed=seed)
        sx.copy_(x)
        stw.copy_(tw)
        sids.copy_(ids)
        graph.replay()
        torch.cuda.synchronize()
        eager = moekit.fused_moe(x, w, tw, ids, backend="cutlass")
        assert torch.equal(sout, eager)
    check(sout, x, w, tw, ids)


def test_supports_on_this_gpu():
    b = moekit.get_backend("cutlass")
    dev = torch.device("cuda")
    cap = torch.cuda.get_device_capability()
    shape = moekit.MoEShape(128, 4096, 1408, 8, tp=2)  # GLM-4.5V at tp2: N = 704
    for scheme in SCHEMES:
        reasons = b.supports(shape, moekit.get_scheme(scheme), dev)
        assert reasons == ([] if cap == (9, 0) else [f"needs SM90 (Hopper), found sm_{cap[0]}{cap[1]}"])
    block = b.supports(moekit.MoEShape(8, 4096, 14336, 2), moekit.get_scheme("fp8-block128"), dev)
    assert any("128x128 block weights are not supported" in r for r in block)
    assert any("`torch` backend" in r for r in b.supports(shape, moekit.get_scheme("bf16"), dev))


def test_gemm_choice_and_apis_agree():
    name, fn = cutlass.gemm_for(torch.device("cuda"))
    candidates = cutlass.gemm_candidates()
    assert name in [n for n, _ in candidates]
    g = torch.Generator(device="cuda").manual_seed(0)
    E, R, K, N = 6, 512, 1024, 768
    a = torch.randn(R, K, device="cuda", generator=g).to(torch.float8_e4m3fn)
    wt = torch.randn(E, N, K, device="cuda", generator=g).to(torch.float8_e4m3fn)
    sa = torch.rand(R, device="cuda", generator=g) + 0.5
    sb = torch.rand(E, N, device="cuda", generator=g) + 0.5
    offs = torch.tensor([0, 96, 96, 208, 400, 512], dtype=torch.int32, device="cuda")  # an empty group
    outs = [f(a, wt.transpose(1, 2), sa, sb, offs) for _, f in candidates]
    want = emulated_scaled_grouped_mm(a, wt.transpose(1, 2), sa, sb, offs)
    # bf16 output rounding: at most 2**-8 = 3.9e-3 of every element (bf16 keeps 8 significant
    # bits), so of the L2 norm too; random roundings give ~1.7e-3 RMS. The GPU's FP8 accumulation
    # (~1e-4 relative, see the header) adds little before that rounding: 4e-3.
    for out in outs:
        assert rel_l2(out, want) < 4e-3
    # two APIs over the same kernel round alike; two different kernels would differ by two
    # independent roundings, ~sqrt(2) x 1.7e-3 = 2.4e-3 RMS: 4e-3
    for out in outs[1:]:
        assert rel_l2(out, outs[0]) < 4e-3


def test_route_at_scale():
    """The route kernels at a prefill size (many chunks, many scan tiles) against the torch twin."""
    M, E, K = 4096, 256, 8
    tw, ids = random_routing(M, E, K, device="cuda", seed=9)
    x = random_x(M, 512, device="cuda")
    a, s, layout = ops.permute(x, ids, E, quant="token")
    a_twin, s_twin, twin = ops.permute(x, ids, E, quant="token", impl="torch")
    assert torch.equal(layout.row_of_pair, twin.row_of_pair) and torch.equal(layout.offs, twin.offs)
    rows = layout.row_of_pair.long()
    assert torch.equal(s[rows], s_twin[rows])
    differ = (bits(a[rows]) != bits(a_twin[rows])).nonzero()
    # on failure, show the first few values that differ with what produced them (pair p = token p // K)
    detail = [
        (float(x[p // K, c]), float(s_twin[rows[p]]), float(x[p // K, c].float() / s_twin[rows[p]]),
         float(a[rows[p], c].float()), float(a_twin[rows[p], c].float()))
        for p, c in differ[:5].tolist()
    ]
    assert len(differ) == 0, f"{len(differ)} FP8 values differ; (x, scale, x/scale, glue, torch): {detail}"
    small = ops.permute(x[:300], ids[:300], E)[2]
    check_layout(small, ids[:300], E, ops.ALIGN_M)


def test_gemm_only_closure_computes_the_layers_gemm2_rows(weights):
    """`prepare_gemm_only` times the same two GEMMs the layer runs: combining its output gives
    the layer's output bitwise (same kernels, same inputs, the same deterministic combine)."""
    w = weights("glm-4.5v-tp2", "fp8-channel-token")
    x = random_x(37, w.hidden, device="cuda", seed=5)
    tw, ids = random_routing(37, w.num_experts, 8, device="cuda", seed=5)
    y = moekit.get_backend("cutlass").prepare_gemm_only(x, w, tw, ids)()
    _, _, layout = ops.permute(x, ids, w.num_experts, align=ops.ALIGN_M, quant="token")
    combined = ops.combine(y, layout, tw, out_dtype=x.dtype)
    assert torch.equal(bits(combined), bits(moekit.fused_moe(x, w, tw, ids, backend="cutlass")))
