"""The routing kernel (moekit/routing/fused.py): route()'s path for GPU logits, in one launch.

tests/test_routing.py runs its reference tests on both of route()'s paths (its `route_path`
fixture); here: that GPU logits take the kernel and only it, its finiteness assertion, several
programs of rows, its compilation for Hopper, and on a GPU its agreement with the torch path at
the families' real sizes, bitwise determinism and CUDA-graph replay.

Agreement of the two paths: moekit/routing/agreement.py derives the tolerances (weights to 1e-5
relative; ids exact except where two candidates are within 1e-5, a near-tie) and decides.
"""

from __future__ import annotations

import textwrap
import types

import pytest
import torch

import moekit.env
import moekit.routing as routing
from moekit.routing import RoutingConfig, agreement, fused, route

from helpers import assert_child_stops_with, compile_in_child
from test_routing import FAMILIES, make_bias, make_logits, take_the_kernel

interpreter_only = pytest.mark.skipif(not moekit.env.interpreting(),
                                      reason="the kernel runs on CPU tensors only under TRITON_INTERPRET=1")


@pytest.fixture
def kernel_path(monkeypatch):
    """route() takes the kernel for these CPU tensors (as for GPU ones), its assertion on."""
    take_the_kernel(monkeypatch)


def torch_path(logits, cfg, bias):
    """route() on its torch ops, whatever the device."""
    saved = routing._use_kernel
    routing._use_kernel = lambda logits: False
    try:
        return route(logits, config=cfg, correction_bias=bias)
    finally:
        routing._use_kernel = saved


def distinct_logits(m: int, e: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Each row a random permutation of E distinct values spaced 8 / E over [-4, 4): spaced wider
    than bf16's and fp16's resolution there (2**-6 below 4), so that even in those dtypes no two
    experts of a row tie (random bf16 logits tie often: 8 mantissa bits)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.stack([torch.randperm(e, generator=g) for _ in range(m)])
    return ((order.double() - e / 2) * (8.0 / e) + 0.01).to(dtype)


def assert_paths_agree(logits, cfg, bias, got, want):
    """routing.agreement's verdict (its docstring derives the tolerances), on data with few near-ties."""
    w, ids = got
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == want[1].shape
    assert agreement.near_ties(logits, cfg, bias).float().mean() <= 0.25, "too many near-ties to say much"
    result = agreement.compare(got, want, logits, cfg, bias)
    assert result.passed, result


# ----------------------------------------------------------------------------------------------
# routing.agreement: the verdict the GPU tests and `moekit check` rely on
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_agreement_passes_itself_and_catches_a_wrong_expert_or_weight(family):
    cfg, e = FAMILIES[family]
    logits = make_logits(40, e, seed=5)
    bias = make_bias(e, 5) if cfg.use_correction_bias else None
    weights, ids = torch_path(logits, cfg, bias)
    same = agreement.compare((weights, ids), (weights, ids), logits, cfg, bias)
    assert same.passed and same.same == 40 and same.worst_weight_rel == 0.0
    clear = int((~agreement.near_ties(logits, cfg, bias)).nonzero()[0])  # a row with no near-tie
    wrong_ids = ids.clone()
    wrong_ids[clear, 0] = (wrong_ids[clear, 0] + 1) % e
    verdict = agreement.compare((weights, wrong_ids), (weights, ids), logits, cfg, bias)
    assert not verdict.passed and verdict.disagree == 1 and verdict.same == 39
    off = weights.clone()
    off[clear, 0] *= 1 + 3 * agreement.WEIGHT_RTOL
    verdict = agreement.compare((off, ids), (weights, ids), logits, cfg, bias)
    assert not verdict.passed and verdict.disagree == 0 and verdict.worst_weight_rel > agreement.WEIGHT_RTOL


def test_agreement_counts_an_exact_tie_apart():
    """Two experts with the same logit: either path's order is right, so a swapped pair is a
    near-tie, not a wrong expert."""
    cfg = RoutingConfig(top_k=2, renormalize=False)
    logits = torch.tensor([[2.0, 1.0, 1.0, -1.0], [3.0, 0.5, -2.0, 1.5]])
    weights, ids = torch_path(logits, cfg, None)
    assert agreement.near_ties(logits, cfg, None).tolist() == [True, False]
    swapped = ids.clone()
    swapped[0, 1] = 3 - swapped[0, 1]  # expert 1 <-> expert 2, tied with it
    verdict = agreement.compare((weights, swapped), (weights, ids), logits, cfg, None)
    assert verdict.passed and verdict.near_ties == 1 and verdict.same == 1


def test_a_near_tie_excuses_another_right_pick_only():
    """On a tied row another pick passes only if it is one: distinct experts in range, the rule's
    weights for them, choice values matching the reference's position by position."""
    cfg = RoutingConfig(top_k=2, renormalize=False)
    logits = torch.tensor([[2.0, 1.0, 1.0, -1.0]])
    weights, ids = torch_path(logits, cfg, None)
    other = ids.clone()
    other[0, 1] = 3 - other[0, 1]  # the other tied expert: right
    assert agreement.compare((weights, other), (weights, ids), logits, cfg, None).passed
    for bad_ids, bad_weights in [
        (torch.tensor([[99, 99]], dtype=torch.int32), weights),  # out of range, repeated
        (torch.tensor([[0, 0]], dtype=torch.int32), weights),  # an expert twice
        (torch.tensor([[0, 3]], dtype=torch.int32), weights),  # not tied: a worse expert
        (other, weights * torch.tensor([[1.0, 1.01]])),  # a tied expert, a wrong weight
        (other, torch.full_like(weights, float("nan"))),
    ]:
        verdict = agreement.compare((bad_weights, bad_ids), (weights, ids), logits, cfg, None)
        assert not verdict.passed and verdict.disagree == 1, (bad_ids, bad_weights)


def test_a_group_tie_excuses_the_other_group_only_whole():
    """Two groups with the same top-2 sum (topk_groups = 1): the other group's experts are a right
    pick; experts from both groups are not."""
    cfg = RoutingConfig(top_k=2, scoring="sigmoid", renormalize=True, num_groups=2, topk_groups=1)
    logits = torch.tensor([[1.0, 0.0, 0.0, 1.0]])  # groups {0, 1} and {2, 3} tie
    weights, ids = torch_path(logits, cfg, None)
    assert agreement.near_ties(logits, cfg, None).tolist() == [True]
    other_group = torch.tensor([[3, 2]] if int(ids[0, 0]) < 2 else [[0, 1]], dtype=torch.int32)
    assert agreement.compare((weights, other_group), (weights, ids), logits, cfg, None).passed
    both = torch.tensor([[0, 3]], dtype=torch.int32)
    both_weights = torch.sigmoid(torch.tensor([[1.0, 1.0]])) / (2 * torch.sigmoid(torch.tensor(1.0)))
    verdict = agreement.compare((both_weights, both), (weights, ids), logits, cfg, None)
    assert not verdict.passed and verdict.disagree == 1


def test_a_group_tie_excuses_only_the_top_k_of_a_right_set_of_groups():
    """4 groups of 4, 2 kept, top-3. Group 0 is clearly kept; groups 1 and 2 tie for the second
    place (the same top-2 sum); group 3 is out. A right pick is experts 0 and 1 and the best of
    either tied group. Wrong: an expert of group 3; a third expert of group 0 when either tied
    group's best beats it (the kept set must hold one of them); the tied groups' experts
    without group 0's best ones."""
    cfg = RoutingConfig(top_k=3, scoring="sigmoid", renormalize=True, num_groups=4, topk_groups=2)
    logits = torch.tensor([[3.0, 2.9, -5.0, -5.0, 1.0, 0.5, -5.0, -5.0, 1.0, 0.5, -5.0, -5.0, -1.0, -1.0, -5.0, -5.0]])
    weights, ids = torch_path(logits, cfg, None)
    assert agreement.near_ties(logits, cfg, None).tolist() == [True]
    scores = torch.sigmoid(logits.double())

    def pick(*experts):
        chosen = torch.tensor([experts])
        w = scores.gather(1, chosen)
        return (w / w.sum(-1, keepdim=True)).float(), chosen.int()

    for right in [(0, 1, 4), (0, 1, 8)]:
        assert agreement.compare(pick(*right), (weights, ids), logits, cfg, None).passed, right
    for wrong in [(0, 1, 12), (0, 1, 2), (4, 8, 0), (4, 5, 0)]:
        verdict = agreement.compare(pick(*wrong), (weights, ids), logits, cfg, None)
        assert not verdict.passed and verdict.disagree == 1, wrong


@interpreter_only
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_check_route_kernel_passes_at_each_familys_size(family):
    """What `moekit check` runs, here in the interpreter, at each family's own E."""
    cfg, e = FAMILIES[family]
    result = agreement.check_route_kernel(cfg, e, 48, torch.device("cpu"), seed=3)
    assert result.passed and result.tokens == 48 and result.same + result.near_ties == 48, result


# ----------------------------------------------------------------------------------------------
# CPU: the interpreter
# ----------------------------------------------------------------------------------------------


def test_gpu_logits_take_the_kernel_outside_torch_compile_and_autograd(monkeypatch):
    gpu = types.SimpleNamespace(device=torch.device("cuda", 0), requires_grad=False)
    assert routing._use_kernel(gpu) and not routing._use_kernel(torch.zeros(1, 4))
    trained = types.SimpleNamespace(device=torch.device("cuda", 0), requires_grad=True)
    assert not routing._use_kernel(trained)  # the kernel has no backward: the torch ops keep autograd
    with torch.no_grad():
        assert routing._use_kernel(trained)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not routing._use_kernel(gpu)  # the compiler traces the torch ops and fuses them itself


@interpreter_only
@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_kernel_path_is_one_launch_and_no_torch_routing_ops(family, monkeypatch):
    """route() on the kernel path launches the kernel once and none of the torch path's ops."""
    cfg, e = FAMILIES[family]
    logits = distinct_logits(5, e, seed=2, dtype=torch.bfloat16)
    bias = make_bias(e, 2) if cfg.use_correction_bias else None
    launches = []
    monkeypatch.setattr(fused.k, "route_kernel", _Recording(fused.k.route_kernel, launches))

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel path ran a torch routing op")

    monkeypatch.setattr(routing, "_check_on_device", lambda device: True)  # the bias checked as on a GPU:
    route(logits, config=cfg, correction_bias=bias)  # at its first call only
    with monkeypatch.context() as m:
        for name in ("softmax", "sigmoid", "topk", "isfinite", "_assert_async"):
            m.setattr(torch, name, refuse)
        m.setattr(torch.Tensor, "float", refuse)
        weights, ids = route(logits, config=cfg, correction_bias=bias)
    programs = -(-5 // fused.block_m(e))
    assert launches == [(programs,), (programs,)]
    assert_paths_agree(logits, cfg, bias, (weights, ids), torch_path(logits, cfg, bias))


class _Recording:
    """A kernel whose launches are recorded (the grid) and then run."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("pdl", [True, False])
def test_the_launch_uses_programmatic_dependent_launch_where_the_backend_does(pdl, monkeypatch):
    """PDL (MOEKIT_PDL, Hopper and newer) as the triton backend's kernels take it: the kernel waits
    for its predecessor itself (PDL=True) and is launched to overlap it (launch_pdl)."""
    import moekit.backends.triton.launch as backend_launch
    from helpers import RecordingKernel

    calls = []
    monkeypatch.setattr(backend_launch, "pdl_enabled", lambda device: pdl)
    monkeypatch.setattr(fused.k, "route_kernel", RecordingKernel(fused.k.route_kernel.arg_names, calls))
    fused.route_fused(make_logits(3, 8, seed=1), 2, scoring="softmax", renormalize=True, num_groups=None,
                      topk_groups=None, bias=None, routed_scaling_factor=1.0)
    (kwargs,) = calls
    assert kwargs["PDL"] is pdl and kwargs.get("launch_pdl", False) is pdl


@interpreter_only
@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "kimi_k2"])
def test_several_programs_and_a_partial_last_one(family):
    """M over a program's rows (block_m: 64 rows at E = 8, 8 at 256, 4 at 384), the last program
    partly past M, in float32, bf16 and fp16 logits."""
    cfg, e = FAMILIES[family]
    rows = fused.block_m(e)
    assert rows == {8: 64, 256: 8, 384: 4}[e]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = distinct_logits(2 * rows + 3, e, seed=rows, dtype=dtype)
        bias = make_bias(e, rows) if cfg.use_correction_bias else None
        got = route(logits, config=cfg, correction_bias=bias)
        assert_paths_agree(logits, cfg, bias, got, torch_path(logits, cfg, bias))


@interpreter_only
@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_logit_fails_the_kernels_assertion(dtype, bad):
    """The kernel asserts what the torch path asserts with torch._assert_async; on a GPU the
    assertion ends the process's CUDA context (the GPU test below runs it in a child process)."""
    from triton.runtime.errors import InterpreterError

    logits = make_logits(70, 8, seed=3, dtype=dtype)  # two programs: the bad value in the second
    route(logits, 2)
    logits[67, 5] = bad
    with pytest.raises(InterpreterError, match="router_logits has NaN or inf values"):
        route(logits, 2)


@interpreter_only
@pytest.mark.usefixtures("kernel_path")
def test_padding_columns_are_never_chosen():
    """E = 5 pads to 8 columns: the padding (read as 0) is masked out of the choice, even where
    every real logit is very negative."""
    logits = torch.full((3, 5), -60.0)
    logits[:, 2] = -50.0
    weights, ids = route(logits, 5, scoring="sigmoid", renormalize=False)
    assert sorted(ids[0].tolist()) == [0, 1, 2, 3, 4] and ids[0, 0].item() == 2
    assert bool((weights >= 0).all()) and bool((weights < 1e-20).all())


_COMPILE_FOR_HOPPER = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDAOptions
from triton.compiler import ASTSource
from moekit.backends.triton_options import ASSERT_OPTIONS, compile_options
from moekit.routing import _kernels as k

options = {"num_warps": 4, **ASSERT_OPTIONS, **compile_options(False)}
if "launch_pdl" in CUDAOptions.__dataclass_fields__:
    options["launch_pdl"] = True
found = {}
rules = {  # (SOFTMAX, HAS_BIAS, CHOOSE_ON_LOGITS, GROUPED, RENORMALIZE, E)
    "softmax": (True, False, False, False, True, 8),
    "sigmoid on logits": (False, False, True, False, False, 16),
    "sigmoid + bias, grouped": (False, True, False, True, True, 256),
    "sigmoid + bias": (False, True, False, False, True, 384),
    "one expert": (True, False, False, False, False, 1),  # one-element tiles
}
for dtype in ("*bf16", "*fp32"):
    for name, (softmax, bias, on_logits, grouped, renorm, E) in rules.items():
        E_PAD = triton.next_power_of_2(E)
        constants = {"SOFTMAX": softmax, "HAS_BIAS": bias, "CHOOSE_ON_LOGITS": on_logits, "GROUPED": grouped,
                     "RENORMALIZE": renorm, "BLOCK_M": max(1, min(64, 2048 // E_PAD)), "E_PAD": E_PAD,
                     "K_PAD": min(8, E_PAD), "G_PAD": min(8, E_PAD), "RENORM_EPS": 1e-20,
                     "INTERPRET": False, "PDL": True}
        signature, consts = {}, {}
        for i, param in enumerate(k.route_kernel.params):
            n = param.name
            if param.is_constexpr:
                signature[n], consts[(i,)] = "constexpr", constants[n]
            elif n == "stride_e" and dtype == "*bf16":  # contiguous logits: a launch specializes it to 1
                signature[n], consts[(i,)] = "constexpr", 1
            elif n == "logits_ptr":
                signature[n] = dtype
            elif n.endswith("_ptr"):
                signature[n] = "*i32" if n == "ids_ptr" else "*fp32"
            else:
                signature[n] = "fp32" if n == "scaling" else "i32"
        compiled = triton.compile(ASTSource(k.route_kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                                  options=options)
        ptx = compiled.asm["ptx"]
        found[f"{name} {dtype}"] = "__assertfail" in ptx and "griddepcontrol.wait" in ptx
json.dump(found, sys.stdout)
"""


def test_the_kernel_compiles_for_hopper_with_its_assertion():
    """Every rule's variant, bf16 (contiguous) and float32 (any strides) logits, compiled for sm_90
    as fused.py launches it on Hopper (in a process of its own: under TRITON_INTERPRET Triton
    compiles nothing); each keeps the device-side assertion of finite logits and waits for its
    predecessor (PDL)."""
    import json

    found = json.loads(compile_in_child(["-c", _COMPILE_FOR_HOPPER]))
    assert len(found) == 10 and all(found.values()), found


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("m", [1, 7, 64, 1000])
def test_gpu_kernel_agrees_with_the_torch_path(family, m):
    cfg, e = FAMILIES[family]
    logits = make_logits(m, e, seed=m + e).cuda()
    bias = make_bias(e, m).cuda() if cfg.use_correction_bias else None
    got = route(logits, config=cfg, correction_bias=bias)
    assert_paths_agree(logits, cfg, bias, got, torch_path(logits, cfg, bias))
    for dtype in (torch.bfloat16, torch.float16):
        low = distinct_logits(m, e, seed=m, dtype=dtype).cuda()
        assert_paths_agree(low, cfg, bias, route(low, config=cfg, correction_bias=bias), torch_path(low, cfg, bias))
    transposed = logits.t().contiguous().t()  # strides (1, M)
    got = route(transposed, config=cfg, correction_bias=bias)
    assert_paths_agree(transposed, cfg, bias, got, torch_path(transposed, cfg, bias))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_gpu_kernel_is_deterministic_and_replays_in_a_cuda_graph(family):
    """Bitwise the same on every run, and a captured route() replays for fresh logits exactly as
    an eager call of them."""
    cfg, e = FAMILIES[family]
    bias = make_bias(e, 1).cuda() if cfg.use_correction_bias else None
    logits = make_logits(4096, e, seed=1).cuda()
    first = route(logits, config=cfg, correction_bias=bias)
    for _ in range(3):
        again = route(logits, config=cfg, correction_bias=bias)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    static = make_logits(64, e, seed=2).cuda()
    route(static, config=cfg, correction_bias=bias)  # compiled and the bias checked before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = route(static, config=cfg, correction_bias=bias)
    fresh = make_logits(64, e, seed=3).cuda()
    static.copy_(fresh)
    graph.replay()
    eager = route(fresh, config=cfg, correction_bias=bias)
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])


@pytest.mark.gpu
def test_gpu_a_non_finite_logit_stops_with_the_message():
    assert_child_stops_with(textwrap.dedent("""
        import torch, moekit
        logits = torch.randn(300, 128, device="cuda")
        logits[257, 3] = float("nan")
        moekit.route(logits, 8)
        torch.cuda.synchronize()
    """), "router_logits has NaN or inf values")


@interpreter_only
@pytest.mark.usefixtures("kernel_path")
def test_a_non_finite_bias_fails_the_kernels_assertion():
    """route() checks a bias once per version; a write through .data keeps the version, and the
    kernel then routed around the NaN expert without a word. It checks the bias it reads."""
    from triton.runtime.errors import InterpreterError

    cfg, e = FAMILIES["deepseek_v3"]
    logits, bias = make_logits(5, e, seed=4), make_bias(e, 4)
    rule = dict(scoring="sigmoid", renormalize=True, num_groups=cfg.num_groups, topk_groups=cfg.topk_groups,
                routed_scaling_factor=cfg.routed_scaling_factor)
    fused.route_fused(logits, cfg.top_k, bias=bias, **rule)
    bias.data[3] = float("nan")
    with pytest.raises(InterpreterError, match="correction_bias has NaN or inf values"):
        fused.route_fused(logits, cfg.top_k, bias=bias, **rule)
