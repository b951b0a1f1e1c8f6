"""Tests for moekit.routing.route().

Every model family is checked against a deliberately naive re-implementation below: float64,
plain Python per row, written from the Hugging Face modelling code of that family (no torch.topk,
no masking tricks), so that a shared bug between route() and its reference is unlikely.
"""

from __future__ import annotations

import math

import pytest
import torch

from moekit.routing import RoutingConfig, route


def take_the_kernel(monkeypatch) -> None:
    """route() takes the routing kernel (routing/fused.py, the path of GPU logits) for CPU tensors,
    in Triton's interpreter with its device_assert on; skips the test outside the interpreter."""
    import moekit.env
    import moekit.routing as routing
    from helpers import interpreter_asserts_on

    if not moekit.env.interpreting():
        pytest.skip("the routing kernel runs on CPU tensors only under TRITON_INTERPRET=1")
    interpreter_asserts_on(monkeypatch)
    monkeypatch.setattr(routing, "_use_kernel", lambda logits: True)


@pytest.fixture(params=["torch", "kernel"])
def route_path(request, monkeypatch):
    """Runs a test on each of route()'s two paths: the torch ops (CPU logits, torch.compile) and
    the routing kernel (take_the_kernel). The test's reference is the same for both."""
    if request.param == "kernel":
        take_the_kernel(monkeypatch)
    return request.param

# ----------------------------------------------------------------------------------------------
# Naive float64 references, one token (row) at a time.
# ----------------------------------------------------------------------------------------------


def _top(values: list[float], k: int, allowed: list[int] | None = None) -> list[int]:
    """Indices of the k largest values (restricted to `allowed`), best first."""
    candidates = range(len(values)) if allowed is None else allowed
    return sorted(candidates, key=lambda i: -values[i])[:k]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def ref_softmax_topk(logits: torch.Tensor, k: int, renormalize: bool):
    """Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE: softmax over all E, top-k, optional renorm."""
    rows = []
    for row in logits.double().tolist():
        peak = max(row)
        exps = [math.exp(x - peak) for x in row]
        total = sum(exps)
        probs = [e / total for e in exps]
        ids = _top(probs, k)
        weights = [probs[i] for i in ids]
        if renormalize:
            s = sum(weights)
            weights = [w / s for w in weights]
        rows.append((ids, weights))
    return rows


def ref_deepseek(logits, k, bias, num_groups, topk_groups, renormalize, scale, hf_zero_fill=False):
    """DeepSeek-V3 / Kimi-K2 / GLM-4.5 (DeepseekV3TopkRouter, Glm4MoeTopkRouter).

    hf_zero_fill=True reproduces earlier HF code's masked_fill(..., 0.0) of dropped groups exactly;
    False restricts the choice to the kept groups (DeepSeek's own inference code, -inf fill).
    """
    num_experts = logits.shape[1]
    bias = [0.0] * num_experts if bias is None else bias.double().tolist()
    size = num_experts // num_groups
    rows = []
    for row in logits.double().tolist():
        scores = [_sigmoid(x) for x in row]
        choice = [s + b for s, b in zip(scores, bias)]
        group_scores = []
        for g in range(num_groups):
            members = sorted(choice[g * size : (g + 1) * size], reverse=True)
            group_scores.append(members[0] + members[1])
        kept = _top(group_scores, topk_groups)
        allowed = [e for e in range(num_experts) if e // size in kept]
        if hf_zero_fill:
            masked = [choice[e] if e // size in kept else 0.0 for e in range(num_experts)]
            ids = _top(masked, k)
        else:
            ids = _top(choice, k, allowed)
        weights = [scores[i] for i in ids]
        if renormalize:
            s = sum(weights) + 1e-20
            weights = [w / s for w in weights]
        rows.append((ids, [w * scale for w in weights]))
    return rows


def ref_llama4(logits):
    """Llama4Router: top-1 over the raw logits, weight = sigmoid(that logit), no renorm."""
    rows = []
    for row in logits.double().tolist():
        best = _top(row, 1)
        rows.append((best, [_sigmoid(row[best[0]])]))
    return rows


def assert_matches(weights, ids, reference, atol=1e-6):
    """Compare route() output with a reference, as sets of (expert, weight) per row."""
    assert weights.shape[0] == len(reference)
    for r, (ref_ids, ref_weights) in enumerate(reference):
        got = sorted(zip(ids[r].tolist(), weights[r].tolist()))
        want = sorted(zip(ref_ids, ref_weights))
        assert [e for e, _ in got] == [e for e, _ in want], f"row {r}: experts differ"
        for (e, w), (_, rw) in zip(got, want):
            assert w == pytest.approx(rw, abs=atol, rel=1e-5), f"row {r} expert {e}"


def make_logits(m, e, seed, dtype=torch.float32, scale=1.5):
    """Random, never-zero router logits (a constant shift keeps exact zeros out)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, e, generator=g, dtype=torch.float64) * scale + 0.05).to(dtype)


def make_bias(e, seed, low=-0.05, high=0.05):
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.rand(e, generator=g, dtype=torch.float64).mul(high - low).add(low).float()


# ----------------------------------------------------------------------------------------------
# Model families: (config, E) as the published checkpoints set them.
# ----------------------------------------------------------------------------------------------

FAMILIES = {
    "mixtral": (RoutingConfig(top_k=2), 8),
    "qwen3_moe": (RoutingConfig(top_k=8), 128),  # norm_topk_prob=True
    "qwen2_moe": (RoutingConfig(top_k=4, renormalize=False), 60),  # norm_topk_prob=False
    "olmoe": (RoutingConfig(top_k=8, renormalize=False), 64),
    "deepseek_v3": (
        RoutingConfig(top_k=8, scoring="sigmoid", num_groups=8, topk_groups=4,
                      use_correction_bias=True, routed_scaling_factor=2.5),
        256,
    ),
    "kimi_k2": (
        RoutingConfig(top_k=8, scoring="sigmoid", num_groups=1, topk_groups=1,
                      use_correction_bias=True, routed_scaling_factor=2.827),
        384,
    ),
    "glm4_moe": (
        RoutingConfig(top_k=8, scoring="sigmoid", num_groups=1, topk_groups=1,
                      use_correction_bias=True, routed_scaling_factor=2.5),
        160,
    ),
    "llama4": (
        RoutingConfig(top_k=1, scoring="sigmoid", renormalize=False, apply_on_input=True),
        16,
    ),
}


def reference_for(cfg: RoutingConfig, logits, bias, hf_zero_fill=False):
    if cfg.scoring == "softmax":
        assert cfg.num_groups is None and not cfg.use_correction_bias
        return ref_softmax_topk(logits, cfg.top_k, cfg.renormalize)
    if cfg.apply_on_input:
        return ref_llama4(logits)
    return ref_deepseek(logits, cfg.top_k, bias, cfg.num_groups or 1, cfg.topk_groups or 1,
                        cfg.renormalize, cfg.routed_scaling_factor, hf_zero_fill)


def run_family(cfg, logits, seed):
    bias = make_bias(logits.shape[1], seed) if cfg.use_correction_bias else None
    weights, ids = route(logits, config=cfg, correction_bias=bias)
    return weights, ids, bias


@pytest.mark.usefixtures("route_path")
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("m", [1, 5, 33])
def test_family_matches_reference(family, m):
    cfg, e = FAMILIES[family]
    seed = 7 * m + len(family)
    logits = make_logits(m, e, seed)
    weights, ids, bias = run_family(cfg, logits, seed)
    assert_matches(weights, ids, reference_for(cfg, logits, bias))


@pytest.mark.usefixtures("route_path")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_bf16_logits(family):
    """bf16 logits: route() computes in float32 on the bf16 values, just as the reference does."""
    cfg, e = FAMILIES[family]
    logits = make_logits(6, e, seed=11, dtype=torch.bfloat16)
    weights, ids, bias = run_family(cfg, logits, 11)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert_matches(weights, ids, reference_for(cfg, logits.double(), bias))


@pytest.mark.usefixtures("route_path")
@pytest.mark.parametrize(
    "cfg,e",
    [
        (RoutingConfig(top_k=3), 7),  # odd E, softmax, renorm
        (RoutingConfig(top_k=7, renormalize=False), 7),  # k == E
        (RoutingConfig(top_k=1, renormalize=False), 1),  # a single expert
        (RoutingConfig(top_k=3, scoring="sigmoid", num_groups=5, topk_groups=2,
                       use_correction_bias=True, routed_scaling_factor=1.7), 15),
        (RoutingConfig(top_k=4, scoring="sigmoid", num_groups=3, topk_groups=2), 9),  # no bias
        (RoutingConfig(top_k=2, scoring="sigmoid", num_groups=7, topk_groups=1,
                       use_correction_bias=True), 14),  # k == kept experts
    ],
)
def test_odd_sizes_match_reference(cfg, e):
    logits = make_logits(5, e, seed=e)
    weights, ids, bias = run_family(cfg, logits, e)
    assert_matches(weights, ids, reference_for(cfg, logits, bias))


@pytest.mark.usefixtures("route_path")
def test_keywords_equal_config():
    cfg, e = FAMILIES["deepseek_v3"]
    logits = make_logits(9, e, seed=3)
    bias = make_bias(e, 3)
    via_config = route(logits, config=cfg, correction_bias=bias)
    via_keywords = route(logits, 8, scoring="sigmoid", num_groups=8, topk_groups=4,
                         correction_bias=bias, routed_scaling_factor=2.5)
    assert torch.equal(via_config[0], via_keywords[0])
    assert torch.equal(via_config[1], via_keywords[1])


# ----------------------------------------------------------------------------------------------
# Invariants.
# ----------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("route_path")
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_invariants(family, dtype):
    cfg, e = FAMILIES[family]
    m = 17
    logits = make_logits(m, e, seed=5, dtype=dtype, scale=3.0)
    weights, ids, _ = run_family(cfg, logits, 5)
    k = cfg.top_k
    assert weights.shape == (m, k) and ids.shape == (m, k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.device == logits.device and ids.device == logits.device
    assert bool((weights >= 0).all()) and bool(torch.isfinite(weights).all())
    assert bool((ids >= 0).all()) and bool((ids < e).all())
    for row in ids.tolist():
        assert len(set(row)) == k, "an expert was chosen twice for one token"
    sums = weights.double().sum(dim=-1)
    if cfg.renormalize:
        expected = torch.full_like(sums, cfg.routed_scaling_factor)
        torch.testing.assert_close(sums, expected, atol=1e-5, rtol=1e-5)
    elif cfg.scoring == "softmax":
        assert bool((sums <= 1 + 1e-6).all()), "un-renormalized softmax top-k weights exceed 1"
    if cfg.num_groups is not None and cfg.topk_groups < cfg.num_groups:
        size = e // cfg.num_groups
        for row in ids.tolist():
            assert len({i // size for i in row}) <= cfg.topk_groups


@pytest.mark.usefixtures("route_path")
def test_rows_are_ordered_best_first():
    logits = make_logits(8, 32, seed=2)
    weights, ids = route(logits, 6, renormalize=False)
    assert bool((weights[:, :-1] >= weights[:, 1:]).all())
    # ... and the first expert is the argmax of the logits
    assert torch.equal(ids[:, 0].long(), logits.argmax(dim=-1))


@pytest.mark.usefixtures("route_path")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_zero_tokens(family):
    cfg, e = FAMILIES[family]
    logits = torch.empty(0, e, dtype=torch.bfloat16)
    weights, ids, _ = run_family(cfg, logits, 0)
    assert weights.shape == (0, cfg.top_k) and weights.dtype == torch.float32
    assert ids.shape == (0, cfg.top_k) and ids.dtype == torch.int32


@pytest.mark.usefixtures("route_path")
def test_one_token_each_family_consistent_with_batch():
    """A token's routing does not depend on the other tokens of the batch."""
    for family, (cfg, e) in FAMILIES.items():
        logits = make_logits(4, e, seed=9)
        bias = make_bias(e, 9) if cfg.use_correction_bias else None
        w_all, i_all = route(logits, config=cfg, correction_bias=bias)
        for r in range(4):
            w_one, i_one = route(logits[r : r + 1], config=cfg, correction_bias=bias)
            assert torch.equal(i_one[0], i_all[r]), family
            torch.testing.assert_close(w_one[0], w_all[r])


@pytest.mark.usefixtures("route_path")
def test_non_contiguous_logits():
    logits = make_logits(12, 10, seed=4).t().contiguous().t()  # [12, 10] with swapped strides
    assert not logits.is_contiguous()
    weights, ids = route(logits, 3, scoring="sigmoid", num_groups=5, topk_groups=2,
                         correction_bias=make_bias(10, 4))
    assert_matches(weights, ids, ref_deepseek(logits, 3, make_bias(10, 4), 5, 2, True, 1.0))


# ----------------------------------------------------------------------------------------------
# Details where the families differ.
# ----------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("route_path")
def test_bias_chooses_but_does_not_weigh():
    """DeepSeek-V3: a large bias on expert 0 makes it chosen, but its weight stays sigmoid(logit)."""
    logits = torch.tensor([[-2.0, 1.0, 0.5, 0.3]])
    bias = torch.tensor([5.0, 0.0, 0.0, 0.0])
    weights, ids = route(logits, 2, scoring="sigmoid", renormalize=False, correction_bias=bias)
    assert sorted(ids[0].tolist()) == [0, 1]
    got = dict(zip(ids[0].tolist(), weights[0].tolist()))
    assert got[0] == pytest.approx(_sigmoid(-2.0), rel=1e-6)
    assert got[1] == pytest.approx(_sigmoid(1.0), rel=1e-6)


@pytest.mark.usefixtures("route_path")
def test_grouping_picks_by_top2_sum_not_max():
    """Group 0 has the single best expert, group 1 the best top-2 sum: group 1 wins."""
    s = [0.95, 0.01, 0.01, 0.90, 0.90, 0.01]  # target sigmoid scores, 3 experts per group
    logits = torch.tensor([[math.log(p / (1 - p)) for p in s]])
    weights, ids = route(logits, 2, scoring="sigmoid", num_groups=2, topk_groups=1,
                         renormalize=False)
    assert sorted(ids[0].tolist()) == [3, 4]
    torch.testing.assert_close(weights[0], torch.tensor([0.90, 0.90]))


@pytest.mark.usefixtures("route_path")
def test_llama4_chooses_on_logits_beyond_sigmoid_saturation():
    """Llama-4 takes top-k of the raw logits; in float32 sigmoid(20) == sigmoid(25) == 1.0."""
    # all four logits saturate; the largest sits at a different position in each row, so
    # whatever way torch.topk breaks ties among equal sigmoids, choosing on them fails somewhere
    logits = torch.tensor([[20.0, 21.0, 22.0, 23.0]]).repeat(4, 1)
    for r in range(4):
        logits[r, r] = 30.0
    assert bool((torch.sigmoid(logits) == 1.0).all())
    cfg, _ = FAMILIES["llama4"]
    weights, ids = route(logits, config=cfg)
    assert ids.tolist() == [[0], [1], [2], [3]]
    assert weights.tolist() == [[1.0]] * 4  # sigmoid(30), not renormalized


@pytest.mark.usefixtures("route_path")
def test_llama4_weight_is_not_renormalized():
    logits = make_logits(10, 16, seed=21)
    weights, _ = route(logits, config=FAMILIES["llama4"][0])
    torch.testing.assert_close(weights[:, 0], torch.sigmoid(logits.max(dim=-1).values))
    assert bool((weights < 1).all())


@pytest.mark.usefixtures("route_path")
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy: exp(200) = inf, meant
def test_renormalize_with_underflowed_sigmoid_gives_zero_not_nan():
    """All sigmoid weights underflow to 0: the 1e-20 in the denominator keeps them 0 (HF does too)."""
    logits = torch.full((2, 6), -200.0)
    logits[0, 0] = -201.0
    weights, ids = route(logits, 2, scoring="sigmoid", routed_scaling_factor=2.5)
    assert bool(torch.isfinite(weights).all()) and bool((weights == 0).all())
    assert ids.shape == (2, 2)


@pytest.mark.usefixtures("route_path")
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_softmax_of_large_logits(family):
    """Logits past 88, where exp overflows float32: the softmax subtracts each row's max first."""
    cfg, e = FAMILIES[family]
    logits = make_logits(6, e, seed=4, scale=8.0) + 110.0
    weights, ids, bias = run_family(cfg, logits, 4)
    assert bool(torch.isfinite(weights).all())
    assert_matches(weights, ids, reference_for(cfg, logits, bias))


@pytest.mark.usefixtures("route_path")
def test_softmax_is_over_all_experts_before_topk():
    """Mixtral softmaxes over all E, then takes top-k: without renorm the weights are the full
    softmax probabilities, not a softmax over the k chosen logits."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, renormalize=False)
    full = torch.softmax(logits, dim=-1)[0]
    torch.testing.assert_close(weights[0], full[:2])
    assert weights[0].sum().item() < 0.99


@pytest.mark.usefixtures("route_path")
def test_grouped_bias_agrees_with_hf_zero_fill_when_scores_positive():
    """With positive biased scores, DeepSeek's -inf fill and earlier HF code's 0.0 fill choose the same."""
    logits = make_logits(20, 64, seed=31)
    bias = make_bias(64, 31, low=0.0, high=0.1)
    weights, ids = route(logits, 6, scoring="sigmoid", num_groups=8, topk_groups=3,
                         correction_bias=bias, routed_scaling_factor=2.5)
    hf = ref_deepseek(logits, 6, bias, 8, 3, True, 2.5, hf_zero_fill=True)
    assert_matches(weights, ids, hf)


@pytest.mark.usefixtures("route_path")
def test_negative_biased_scores_never_leave_the_kept_groups():
    """Where earlier HF code's 0.0 fill and DeepSeek's -inf fill part: biased scores below 0.

    Group 0 is kept (top-2 sum -0.6 beats group 1's -3.4), but its third-best expert scores
    below 0, so HF's 0.0-filled dropped experts would beat it. route() stays in the kept group.
    """
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.0, 0.0, 0.0]])
    bias = torch.tensor([-1.0, -1.0, -1.0, -2.2, -2.2, -2.2])
    weights, ids = route(logits, 3, scoring="sigmoid", num_groups=2, topk_groups=1,
                         correction_bias=bias)
    assert sorted(ids[0].tolist()) == [0, 1, 2]
    assert_matches(weights, ids, ref_deepseek(logits, 3, bias, 2, 1, True, 1.0))
    hf_ids = ref_deepseek(logits, 3, bias, 2, 1, True, 1.0, hf_zero_fill=True)[0][0]
    assert any(i >= 3 for i in hf_ids), "the example no longer shows the HF difference"


# ----------------------------------------------------------------------------------------------
# Errors.
# ----------------------------------------------------------------------------------------------

L = make_logits(4, 8, seed=1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(router_logits=L[0], top_k=2), r"2-D .* got 1-D"),
        (dict(router_logits=L.view(2, 2, 8), top_k=2), r"2-D .* got 3-D"),
        (dict(router_logits=torch.ones(4, 8, dtype=torch.int64), top_k=2), r"floating point.*int64"),
        (dict(router_logits=torch.empty(4, 0), top_k=1), r"0 experts"),
        (dict(router_logits=L), r"top_k is required"),
        (dict(router_logits=L, top_k=0), r"top_k must be an integer in \[1, E=8\], got 0"),
        (dict(router_logits=L, top_k=9), r"top_k must be an integer in \[1, E=8\], got 9"),
        (dict(router_logits=L, top_k=2.0), r"top_k must be an integer"),
        (dict(router_logits=L, top_k=2, scoring="sparsemax"), r"unknown scoring 'sparsemax'"),
        (dict(router_logits=L, top_k=2, num_groups=3, topk_groups=1), r"dividing E=8, got 3"),
        (dict(router_logits=L, top_k=2, num_groups=4), r"num_groups and topk_groups go together"),
        (dict(router_logits=L, top_k=2, num_groups=4, topk_groups=5),
         r"topk_groups must be an integer in \[1, num_groups=4\], got 5"),
        (dict(router_logits=L, top_k=5, num_groups=4, topk_groups=2),
         r"top_k=5 exceeds .* topk_groups=2 \* \(E/num_groups=2\) = 4"),
        (dict(router_logits=L, top_k=2, num_groups=8, topk_groups=2), r"E/num_groups must be >= 2"),
        (dict(router_logits=L, top_k=2, correction_bias=torch.zeros(7)),
         r"correction_bias shape \(7,\) .* expected \(8,\)"),
        (dict(router_logits=L, top_k=2, correction_bias=torch.zeros(1, 8)),
         r"correction_bias shape \(1, 8\)"),
        (dict(router_logits=L, top_k=2, correction_bias=torch.zeros(8, dtype=torch.int32)),
         r"correction_bias must be a floating point torch.Tensor"),
        (dict(router_logits=L, top_k=2, correction_bias=torch.full((8,), float("nan"))),
         r"correction_bias has non-finite"),
        (dict(router_logits=L, top_k=2, routed_scaling_factor=0.0), r"routed_scaling_factor must be"),
        (dict(router_logits=L, top_k=2, routed_scaling_factor=float("nan")),
         r"routed_scaling_factor must be"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        route(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_logits_are_counted(dtype):
    logits = make_logits(4, 8, seed=1, dtype=dtype)
    logits[0, 1] = float("nan")
    logits[2, 3] = float("inf")
    logits[3, 0] = float("-inf")
    with pytest.raises(ValueError, match=r"3 non-finite value\(s\) \(NaN or inf\) out of 32"):
        route(logits, 2)


def test_config_and_keywords_conflict():
    cfg = RoutingConfig(top_k=2)
    with pytest.raises(ValueError, match=r"either config or the keywords \['top_k'\]"):
        route(L, 2, config=cfg)
    with pytest.raises(ValueError, match=r"\['scoring', 'routed_scaling_factor'\]"):
        route(L, config=cfg, scoring="sigmoid", routed_scaling_factor=2.0)


def test_config_bias_required_and_forbidden():
    needs_bias = FAMILIES["deepseek_v3"][0]
    with pytest.raises(ValueError, match=r"use_correction_bias is True but no correction_bias"):
        route(make_logits(2, 256, seed=1), config=needs_bias)
    with pytest.raises(ValueError, match=r"correction_bias was given but config.use_correction_bias"):
        route(L, config=RoutingConfig(top_k=2), correction_bias=torch.zeros(8))


def test_config_fields_are_validated_too():
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[1, E=8\], got 9"):
        route(L, config=RoutingConfig(top_k=9))
    with pytest.raises(ValueError, match=r"RoutingConfig.scoring 'relu'"):  # refused when made
        RoutingConfig(top_k=2, scoring="relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"apply_on_input .* needs top_k=1, got top_k=2"):
        RoutingConfig(top_k=2, scoring="sigmoid", apply_on_input=True)  # failed at the first forward
    for bad in ({"top_k": 0}, {"top_k": True}, {"top_k": 2, "renormalize": 1}):
        with pytest.raises(ValueError, match="RoutingConfig"):
            RoutingConfig(**bad)


def test_a_grouping_that_cannot_run_on_any_experts_is_refused_when_the_config_is_made():
    """topk_groups=3 of 2 groups, or 0, was accepted and failed at the first forward, although
    no expert count is needed to see it (what needs E is MoELayer's check: test_layer)."""
    np = pytest.importorskip("numpy")
    for groups, kept, match in ((2, 3, r"topk_groups must be an integer in \[1, num_groups=2\], got 3"),
                                (2, 0, r"topk_groups must be an integer in \[1, num_groups=2\], got 0"),
                                (0, 1, r"num_groups must be a positive integer, got 0"),
                                (True, 1, r"num_groups must be a positive integer, got True"),
                                (4, 2.0, r"topk_groups must be an integer in \[1, num_groups=4\], got 2.0")):
        with pytest.raises(ValueError, match="RoutingConfig." + match):
            RoutingConfig(top_k=2, num_groups=groups, topk_groups=kept)
    cfg = RoutingConfig(top_k=2, scoring="sigmoid", num_groups=np.int64(4), topk_groups=np.int64(2))
    assert (cfg.num_groups, cfg.topk_groups) == (4, 2) and type(cfg.num_groups) is int
    assert route(L, config=cfg)[1].shape == (4, 2)  # route's own check took the NumPy integers too


def test_apply_on_input_with_renormalize_is_refused():
    """Renormalized, a top-1 weight is its own score divided by itself: 1. Applied on the input it
    scaled nothing, silently unlike Llama-4, whose input is scaled by sigmoid(chosen logit)."""
    weights, _ = route(L, 1, scoring="sigmoid")  # renormalize's default: True
    assert weights.tolist() == [[1.0]] * 4
    with pytest.raises(ValueError, match=r"apply_on_input with renormalize=True: a renormalized top-1 weight is "
                                         r"always 1.*pass renormalize=False, as Llama-4 does"):
        RoutingConfig(top_k=1, scoring="sigmoid", apply_on_input=True)
    llama4 = RoutingConfig(top_k=1, scoring="sigmoid", renormalize=False, apply_on_input=True)
    assert llama4 == FAMILIES["llama4"][0] and bool((route(L, config=llama4)[0] < 1).all())


def test_a_keyword_beside_config_is_refused_even_at_its_default():
    """The conflict check compared each keyword with its default: renormalize=True beside a
    config saying False was dropped without a word."""
    cfg = RoutingConfig(top_k=2, renormalize=False)
    for kw in ({"renormalize": True}, {"scoring": "softmax"}, {"routed_scaling_factor": 1.0}):
        with pytest.raises(ValueError, match=r"pass either config or the keywords \['" + next(iter(kw))):
            route(L, config=cfg, **kw)
    with pytest.raises(ValueError, match="config must be a moekit.RoutingConfig, got dict"):
        route(L, config={"top_k": 2})
    for bad in ("2.5", None, float("nan"), True):
        with pytest.raises(ValueError, match="routed_scaling_factor must be a number > 0 that float32 holds"):
            route(L, 2, routed_scaling_factor=bad)


def test_route_traces_whole_under_dynamic_shapes():
    """torch.compile(dynamic=True) made routed_scaling_factor a symbolic float, which
    math.isfinite cannot trace: fullgraph failed (DeepSeek-V3's fused routers included)."""
    cfg = RoutingConfig(top_k=2, scoring="sigmoid", routed_scaling_factor=2.5)

    def fn(logits):
        return route(logits, config=cfg)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for m in (3, 5):
        logits = make_logits(m, 8, seed=m)
        got, want = compiled(logits), fn(logits)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_no_host_sync_where_checks_run_on_the_device(monkeypatch):
    """On a GPU, route() must not read a value back to the host (a MoELayer with a correction bias
    is captured in CUDA graphs): the bias check did `bool(isfinite(bias).all())` on every call.
    Simulated on the CPU: the device-side branch forced, and any host read of a tensor raises."""
    import moekit.routing as routing

    cfg, e = FAMILIES["deepseek_v3"]
    logits, bias = make_logits(5, e, seed=3), make_bias(e, 3)
    want = route(logits, config=cfg, correction_bias=bias)

    def host_read(*args, **kwargs):
        raise AssertionError("route() read a tensor's value on the host")

    monkeypatch.setattr(routing, "_check_on_device", lambda device: True)
    with monkeypatch.context() as m:
        for name in ("__bool__", "item", "tolist", "__int__", "__float__"):
            m.setattr(torch.Tensor, name, host_read)
        got = route(logits, config=cfg, correction_bias=bias)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the device-side assertion still refuses a non-finite bias (on a GPU: when the stream runs)
    with pytest.raises(RuntimeError):
        route(logits, config=cfg, correction_bias=torch.full((e,), float("nan")))


def test_a_constant_bias_is_checked_on_the_device_once_per_version(monkeypatch):
    """The device-side bias check is three launches; a MoELayer's bias is constant, so it runs at
    a bias's first call and again only after an in-place write (its version), not inside every
    captured layer. A new bias tensor is checked afresh."""
    import moekit.routing as routing

    cfg, e = FAMILIES["deepseek_v3"]
    logits, bias = make_logits(5, e, seed=3), make_bias(e, 3)
    checks = []
    real = torch._assert_async
    monkeypatch.setattr(routing, "_check_on_device", lambda device: True)
    monkeypatch.setattr(torch, "_assert_async", lambda *a: checks.append(a[-1]) or real(*a))
    for _ in range(3):
        route(logits, config=cfg, correction_bias=bias)
    bias_checks = lambda: sum("correction_bias" in m for m in checks)  # noqa: E731
    assert bias_checks() == 1 and len(checks) == 4  # the logits are checked every call
    bias.add_(0.01)
    route(logits, config=cfg, correction_bias=bias)
    assert bias_checks() == 2
    route(logits, config=cfg, correction_bias=bias.clone())
    assert bias_checks() == 3
    with pytest.raises(RuntimeError):  # a NaN written in place is seen
        bias[0] = float("nan")
        route(logits, config=cfg, correction_bias=bias)


def test_numpy_numbers_are_numbers():
    """The symbolic-safe checks turned away NumPy values the earlier ones took."""
    np = pytest.importorskip("numpy")
    cfg = RoutingConfig(top_k=np.int64(2), renormalize=np.True_, routed_scaling_factor=np.float32(2.5))
    assert cfg.top_k == 2 and type(cfg.top_k) is int and cfg.renormalize is True
    want = route(L, 2, routed_scaling_factor=2.5)
    got = route(L, 2, routed_scaling_factor=np.float32(2.5))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="RoutingConfig.routed_scaling_factor must be a number > 0 that float32 holds"):
        RoutingConfig(top_k=2, routed_scaling_factor=None)


@pytest.mark.parametrize("bad", ["false", "True", None, 0, 1, torch.tensor(True)])
def test_route_refuses_a_renormalize_that_is_not_a_bool_as_routing_config_does(bad):
    """route() took any object by its truthiness: renormalize="false" renormalized, None did not,
    while RoutingConfig refused both. One check (routing.check_flag) now serves the two."""
    with pytest.raises(ValueError, match=r"^RoutingConfig.renormalize must be True or False, got "):
        RoutingConfig(top_k=2, renormalize=bad)
    with pytest.raises(ValueError, match=r"^renormalize must be True or False, got "):
        route(L, 2, renormalize=bad)


def test_route_takes_numpy_values_as_routing_config_does():
    """route(L, np.int64(2)) was refused ("top_k must be an integer in [1, E=8], got
    np.int64(2)") where RoutingConfig(top_k=np.int64(2)) was accepted; NumPy's bool is a bool."""
    np = pytest.importorskip("numpy")
    for top_k in (np.int64(2), np.int32(2), np.uint8(2)):
        want = route(L, 2, renormalize=False)
        got = route(L, top_k, renormalize=np.False_)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(route(L, config=RoutingConfig(top_k=top_k))[0], route(L, 2)[0])
    want = route(L, 2, scoring="sigmoid", num_groups=4, topk_groups=2)
    got = route(L, np.int64(2), scoring="sigmoid", num_groups=np.int64(4), topk_groups=np.int32(2))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for bad in (True, np.True_, 2.0):  # a bool is no count, in either form
        with pytest.raises(ValueError, match=r"RoutingConfig.top_k must be a positive integer"):
            RoutingConfig(top_k=bad)
        with pytest.raises(ValueError, match=r"top_k must be an integer in \[1, E=8\]"):
            route(L, bad)


def test_scaling_factor_and_bias_edges_named():
    """A fresh-eyes review's edges: a routed_scaling_factor float32 cannot hold made every weight
    inf (1e39) or 0 (1e-46) without a word; a NumPy-array bias was reported as "got float32"; a
    bias on another device was copied over at every call (a CUDA error inside a graph capture);
    float64 logits beyond float32's range were reported as NaN or inf."""
    np = pytest.importorskip("numpy")
    for bad in (1e39, 1e-46, -1.0):
        with pytest.raises(ValueError, match=r"routed_scaling_factor must be a number > 0 that float32 holds, "
                                             r"in \[1\.18e-38, 3\.4e\+38\], got"):
            route(L, 2, routed_scaling_factor=bad)
        with pytest.raises(ValueError, match=r"RoutingConfig\.routed_scaling_factor must be a number > 0"):
            RoutingConfig(top_k=2, routed_scaling_factor=bad)
    weights, _ = route(L, 2, routed_scaling_factor=3e38 / 2)  # inside the range: finite weights
    assert bool(torch.isfinite(weights).all())
    with pytest.raises(ValueError, match=r"must be a floating point torch\.Tensor of shape \[E=8\], got ndarray"):
        route(L, 2, scoring="sigmoid", correction_bias=np.zeros(8, np.float32))
    with pytest.raises(ValueError, match=r"correction_bias is on meta, router_logits on cpu: expected both on one"):
        route(L, 2, scoring="sigmoid", correction_bias=torch.zeros(8, device="meta"))
    wide = L.double()
    wide[1, 2] = 1e39  # finite in float64
    with pytest.raises(ValueError, match=r"1 torch\.float64 value\(s\) beyond float32's range"):
        route(wide, 2)
    wide[1, 3] = float("nan")  # a real NaN beside it: named as such once nothing overflows
    wide[1, 2] = 0.0
    with pytest.raises(ValueError, match=r"1 non-finite value\(s\) \(NaN or inf\)"):
        route(wide, 2)


def test_a_numpy_scaling_factor_is_kept_as_a_python_float():
    """RoutingConfig kept a NumPy routed_scaling_factor as it was, and torch.compile(fullgraph=True)
    of route(config=...) stopped on dynamo's "repr() on tensor". It is a Python float now, and the
    compiled routing equals eager's."""
    np = pytest.importorskip("numpy")
    cfg = RoutingConfig(top_k=2, scoring="sigmoid", renormalize=True, routed_scaling_factor=np.float64(2.5))
    assert type(cfg.routed_scaling_factor) is float and cfg.routed_scaling_factor == 2.5
    torch._dynamo.reset()
    compiled = torch.compile(lambda logits: route(logits, config=cfg), backend="aot_eager", fullgraph=True)
    got, want = compiled(L), route(L, config=cfg)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])  # aot_eager runs eager's ops
    # given to route() inside the compiled function: refused naming it, as NumPy flags and counts are
    inside = torch.compile(lambda logits: route(logits, 2, routed_scaling_factor=np.float32(2.5)),
                           backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"routed_scaling_factor: a NumPy scalar inside torch\.compile"):
        inside(L)
    torch._dynamo.reset()
