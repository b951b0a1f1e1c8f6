"""How closely route()'s two paths agree: the routing kernel (fused.py, GPU logits) against the
torch ops (route_with_torch_ops, the reference). `moekit check` reports it per model; the tests
assert it.

Both paths compute the same float32 formulas; they differ in the order of the softmax and
renormalization sums and (on a GPU) in exp's last bit: a few float32 ulps of a score (~1e-7
relative). So:
  - weights agree to WEIGHT_RTOL = 1e-5 relative (100x that, far below any wrong expert or
    score), with WEIGHT_ATOL = 1e-7 for weights near 0;
  - ids agree exactly (same experts, same order) wherever no two candidates' choice values lie
    within TIE = 1e-5 (relative to the row's largest |choice|, at least 1) of each other where it
    matters (near_ties). There another pick can be right: such a row counts as a near-tie if its
    experts are distinct and in range, its weights the rule's for them (float64), and its choice
    values the reference's position by position within TIE (or, where groups tie, its experts in
    at most topk_groups groups); otherwise as wrong.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _RENORM_EPS, RoutingConfig, _check_rule, route_with_torch_ops

TIE = 1e-5
WEIGHT_RTOL = 1e-5
WEIGHT_ATOL = 1e-7


def _choice64(logits: torch.Tensor, config: RoutingConfig, bias: torch.Tensor | None):
    """The rule's first steps in float64: (choice [M, E] before any group mask, scores [M, E], the
    row's tie scale [M, 1] = max(|choice|, 1))."""
    x = logits.double()
    scores = torch.softmax(x, -1) if config.scoring == "softmax" else torch.sigmoid(x)
    if bias is not None:
        choice = scores + bias.double().to(x.device)
    elif config.scoring == "sigmoid" and config.num_groups is None:
        choice = x
    else:
        choice = scores
    return choice, scores, choice.abs().amax(-1, keepdim=True).clamp_min(1.0)


def _grouped(config: RoutingConfig) -> bool:
    return config.num_groups is not None and config.topk_groups < config.num_groups


def _group_scores(choice: torch.Tensor, config: RoutingConfig) -> torch.Tensor:
    """[M, groups]: each group's score, the sum of its two best choice values."""
    return choice.view(choice.shape[0], config.num_groups, -1).topk(2, -1).values.sum(-1)


def _rule64(logits: torch.Tensor, config: RoutingConfig, bias: torch.Tensor | None):
    """The rule in float64: (choice [M, E] with the unkept groups at -inf, scores [M, E], the
    row's tie scale [M, 1] = max(|choice|, 1), group_tie [M], expert_tie [M]) (near_ties)."""
    choice, scores, scale = _choice64(logits, config, bias)
    group_tie = torch.zeros(choice.shape[0], dtype=torch.bool, device=choice.device)
    if _grouped(config):
        group_scores = _group_scores(choice, config)
        ordered = group_scores.sort(-1, descending=True).values
        kept = config.topk_groups
        group_tie = (ordered[:, kept - 1] - ordered[:, kept]).abs() < TIE * scale[:, 0]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_scores.topk(kept, -1).indices, True)
        choice = choice.view(choice.shape[0], config.num_groups, -1).masked_fill(~keep.unsqueeze(-1), float("-inf"))
        choice = choice.view_as(scores)
    ordered = choice.sort(-1, descending=True).values[:, : config.top_k + 1]
    expert_tie = ((ordered[:, :-1] - ordered[:, 1:]) < TIE * scale).any(-1)
    return choice, scores, scale, group_tie, expert_tie


def near_ties(logits: torch.Tensor, config: RoutingConfig, bias: torch.Tensor | None) -> torch.Tensor:
    """bool [M]: rows whose choice values (float64, by the rule) have two candidates within TIE
    (relative to the row's largest |choice|, at least 1) where it matters: among the top k + 1
    (the order of the k, and the k-th against the next), or the topk_groups-th group score against
    the next."""
    _, _, _, group_tie, expert_tie = _rule64(logits, config, bias)
    return group_tie | expert_tie


def _rule_weights64(scores: torch.Tensor, ids: torch.Tensor, config: RoutingConfig) -> torch.Tensor:
    """The weights the rule gives experts `ids` [R, k] (float64)."""
    weights = scores.gather(1, ids)
    if config.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + _RENORM_EPS)
    return weights * config.routed_scaling_factor


def _group_pick_right(choice: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, config: RoutingConfig) -> torch.Tensor:
    """bool [R]: on rows where groups tie, whether experts `ids` [R, k] (in range) are the top-k of
    some right set of kept groups. choice [R, E] float64 before any group mask.

    With b the topk_groups-th best group score and t the tie tolerance, the groups above b + t
    must be kept, those within t of b may be, the others not. The pick is right when its groups
    are allowed ones, these together with the must-keep groups are at most topk_groups, its choice
    values are (within t, position by position) the top-k of those groups' experts, and enough
    other tied groups are left to fill the kept set whose experts would not beat its k-th value
    (within t): such a kept set then has this pick as its top-k."""
    R, E = choice.shape
    kept, per = config.topk_groups, E // config.num_groups
    tol = TIE * scale  # [R, 1]
    group_scores = _group_scores(choice, config)
    boundary = group_scores.sort(-1, descending=True).values[:, kept - 1 : kept]
    must = group_scores > boundary + tol
    tied = (group_scores >= boundary - tol) & ~must
    used = torch.zeros_like(must).scatter_(1, ids // per, True)
    base = must | used
    ok = (~used | must | tied).all(-1) & (base.sum(-1) <= kept)
    mine = choice.gather(1, ids).sort(-1, descending=True).values
    grouped = choice.view(R, config.num_groups, per)
    best_of_base = grouped.masked_fill(~base.unsqueeze(-1), float("-inf")).view(R, E).topk(ids.shape[1], -1).values
    ok &= ((best_of_base - mine).abs() <= tol).all(-1)
    quiet = grouped.amax(-1) <= mine[:, -1:] + tol  # groups whose experts would not beat the pick
    ok &= (tied & ~base & quiet).sum(-1) >= kept - base.sum(-1)
    return ok


def _tie_rows_right(w, ids, ids_ref, logits, config, bias, rows: torch.Tensor) -> torch.Tensor:
    """bool over `rows` (near-tie rows where the ids differ): each is a correct pick all the same.
    Its ids are distinct experts in [0, E); its weights are the rule's for those experts (float64,
    WEIGHT_RTOL); where only experts tie (not groups), its choice values match the reference's
    position by position within TIE; where groups tie, its experts are the top-k of a right set
    of kept groups (_group_pick_right)."""
    choice, scores, scale, group_tie, _ = _rule64(logits[rows], config, bias)
    ids, ids_ref, w = ids[rows].long(), ids_ref[rows].long(), w[rows].double()
    num_experts = logits.shape[1]
    ok = ((ids >= 0) & (ids < num_experts)).all(-1) & (ids.sort(-1).values.diff(dim=-1) != 0).all(-1)
    safe = ids.clamp(0, num_experts - 1)
    expected = _rule_weights64(scores, safe, config)
    ok &= ((w - expected).abs() <= WEIGHT_ATOL + WEIGHT_RTOL * expected.abs()).all(-1)
    close = ((choice.gather(1, safe) - choice.gather(1, ids_ref)).abs() <= TIE * scale).all(-1)
    if _grouped(config):
        raw = _choice64(logits[rows], config, bias)[0]
        close = torch.where(group_tie, _group_pick_right(raw, scale, safe, config), close)
    return ok & close


def tie_picks_right(w: torch.Tensor, ids: torch.Tensor, ids_ref: torch.Tensor, logits: torch.Tensor,
                    config: RoutingConfig, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """bool over `rows`: compare()'s verdict on near-tie rows whose picks differ (the module
    docstring), for a reference `ids_ref` in any order (transformers' DeepSeek-V3 router returns
    its top-k unsorted): it is put in decreasing order of choice first. `w` float32 or wider."""
    choice = _choice64(logits, config, bias)[0]  # the reference's experts are in kept groups: no mask needed
    ids_ref = ids_ref.long()
    ids_ref = ids_ref.gather(1, choice.gather(1, ids_ref).argsort(dim=-1, descending=True, stable=True))
    return _tie_rows_right(w, ids, ids_ref, logits, config, bias, rows)


@dataclasses.dataclass(frozen=True)
class Agreement:
    """The routing kernel against the torch ops on the same logits."""

    tokens: int
    same: int  # rows choosing the same experts in the same order
    near_ties: int  # rows choosing otherwise where two candidates are within TIE: either is right
    disagree: int  # rows choosing otherwise with no near-tie: a wrong expert
    # over the `same` rows: max |w - w_ref| / (|w_ref| + WEIGHT_ATOL / WEIGHT_RTOL); None with none
    worst_weight_rel: float | None

    @property
    def passed(self) -> bool:
        return self.disagree == 0 and (self.worst_weight_rel or 0.0) <= WEIGHT_RTOL

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "passed": self.passed,
                "tolerances": {"tie": TIE, "weight_rtol": WEIGHT_RTOL, "weight_atol": WEIGHT_ATOL}}


def compare(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
            logits: torch.Tensor, config: RoutingConfig, bias: torch.Tensor | None) -> Agreement:
    """`got` (weights, ids) against `want`, the torch ops' on the same logits (module docstring)."""
    (w, ids), (w_ref, ids_ref) = got, want
    if ids.shape != ids_ref.shape or w.shape != w_ref.shape:
        raise ValueError(f"shapes differ: {tuple(ids.shape)} against {tuple(ids_ref.shape)}")
    same = (ids.long() == ids_ref.long()).all(-1)
    ties = near_ties(logits, config, bias) & ~same
    if bool(ties.any()):  # a near-tie excuses another pick, not a wrong one (_tie_rows_right)
        ties[ties.clone()] = _tie_rows_right(w, ids, ids_ref, logits, config, bias, ties)
    rel = (w[same].double() - w_ref[same].double()).abs() / (w_ref[same].double().abs() + WEIGHT_ATOL / WEIGHT_RTOL)
    worst = float(rel.max()) if rel.numel() else None
    if worst is not None and worst != worst:  # NaN weights: never within tolerance
        worst = float("inf")
    return Agreement(
        tokens=ids.shape[0], same=int(same.sum()), near_ties=int(ties.sum()),
        disagree=int((~same & ~ties).sum()), worst_weight_rel=worst,
    )


def check_route_kernel(config: RoutingConfig, num_experts: int, tokens: int, device: torch.device,
                       seed: int = 0) -> Agreement:
    """The routing kernel and the torch ops on the same random logits (normal, std 1.5, float32)
    and, where the rule has one, a random correction bias in [-0.05, 0.05): what `moekit check`
    runs on a GPU (or in the interpreter)."""
    from .fused import route_fused

    _check_rule(config.top_k, num_experts, config.scoring, config.num_groups, config.topk_groups,
                config.routed_scaling_factor)
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, num_experts, generator=g) * 1.5).to(device)
    bias = (torch.rand(num_experts, generator=g) * 0.1 - 0.05).to(device) if config.use_correction_bias else None
    rule = dict(scoring=config.scoring, renormalize=config.renormalize, num_groups=config.num_groups,
                topk_groups=config.topk_groups, bias=bias, routed_scaling_factor=config.routed_scaling_factor)
    got = route_fused(logits, config.top_k, **rule)
    want = route_with_torch_ops(logits, config.top_k, **rule)
    return compare(got, want, logits, config, bias)
