"""Routing: turning router logits into each token's top-k experts and their weights.

The rule and its checks live here, with the torch ops that compute it; _kernels.py holds the same
rule as one Triton kernel, which fused.py launches for GPU logits.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import env


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """The routing rule of a model family.

    scoring: "softmax" (Mixtral, Qwen, OLMoE) or "sigmoid" (DeepSeek-V3, Kimi-K2, GLM-4.5, Llama-4).
    renormalize: divide the k chosen weights by their sum.
    num_groups / topk_groups: grouped top-k (DeepSeek-V3: 8 groups, 4 kept); None = no grouping.
    use_correction_bias: a learned per-expert bias is added to the scores to choose the experts
        (not to weigh them): DeepSeek-V3's e_score_correction_bias.
    routed_scaling_factor: multiplies the final weights (DeepSeek-V3 2.5, Kimi-K2 2.827).
    apply_on_input: the weight multiplies the expert's input instead of its output (Llama-4, top-1).
    """

    top_k: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True
    num_groups: int | None = None
    topk_groups: int | None = None
    use_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    apply_on_input: bool = False

    def __post_init__(self):
        """What needs no logits to check (route() checks the rest against E): a rule that could
        not run was accepted and failed at the first forward (apply_on_input at top-k 2)."""
        for name in ("top_k", "num_groups", "topk_groups"):  # NumPy integers as Python ones
            object.__setattr__(self, name, as_int(getattr(self, name), f"RoutingConfig.{name}"))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"RoutingConfig.top_k must be a positive integer, got {self.top_k!r}")
        if self.scoring not in _SCORINGS:
            raise ValueError(f"RoutingConfig.scoring {self.scoring!r}: expected one of {_SCORINGS}")
        for name in ("renormalize", "use_correction_bias", "apply_on_input"):
            object.__setattr__(self, name, check_flag(f"RoutingConfig.{name}", getattr(self, name)))
        object.__setattr__(self, "routed_scaling_factor",
                           as_float(self.routed_scaling_factor, "RoutingConfig.routed_scaling_factor"))
        if not _is_scale(self.routed_scaling_factor):
            raise ValueError(f"RoutingConfig.routed_scaling_factor must be {_SCALE_RANGE}, "
                             f"got {self.routed_scaling_factor!r}")
        if (self.num_groups is None) != (self.topk_groups is None):
            raise ValueError(f"RoutingConfig.num_groups and topk_groups go together, got {self.num_groups!r} "
                             f"and {self.topk_groups!r}")
        _check_groups(self.num_groups, self.topk_groups, "RoutingConfig.")  # the rest needs E: check_fits
        if self.apply_on_input and self.top_k != 1:
            raise ValueError(f"RoutingConfig.apply_on_input (the weight scales the expert's input, Llama-4) "
                             f"needs top_k=1, got top_k={self.top_k}")
        if self.apply_on_input and self.renormalize:
            # one weight divided by itself is 1: x would be scaled by 1, unlike the model, silently
            raise ValueError("RoutingConfig.apply_on_input with renormalize=True: a renormalized top-1 weight is "
                             "always 1, so the input would not be scaled at all; pass renormalize=False, as "
                             "Llama-4 does (its input is scaled by sigmoid of the chosen logit)")


def check_flag(name: str, value) -> bool:
    """`value` as a Python bool; ValueError naming `name` unless it is True or False (NumPy's
    bool too: it can only be one of the two). Anything else was taken by its truthiness, so
    renormalize="false" or apply_router_weight_on_input="no" turned the rule on, and None off.
    One check for RoutingConfig, route() and fused_moe's flags."""
    if not isinstance(value, (bool, np.bool_)):
        _refuse_traced_numpy(name, value, "bool")
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def as_int(value, name: str):
    """An integer (NumPy's too) as a Python int, so that the range checks, and torch and Triton
    after them, see one type; anything else unchanged, for those checks to refuse showing what
    was passed. A bool is not a count: left as it is, for the checks to refuse."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    _refuse_traced_numpy(name, value, "int")
    return value


def as_float(value, name: str):
    """A real number (NumPy's too) as a Python float, as as_int does for counts: a NumPy scalar
    kept in a RoutingConfig is traced by torch.compile as an array, and stopped a fullgraph trace.
    torch.compile's symbolic numbers and anything else unchanged, for the range check to judge."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, torch.SymInt, torch.SymFloat)):
        return float(value)
    _refuse_traced_numpy(name, value, "float")
    return value


def _refuse_traced_numpy(name: str, value, python_type: str) -> None:
    """Inside torch.compile, dynamo traces a NumPy scalar as a 0-d array whose value is data, not
    a constant: it cannot be read as a flag or a count there, and the checks' repr() of it stops
    the trace with dynamo's own "repr() on tensor". A ValueError naming the argument instead."""
    if torch.compiler.is_compiling() and isinstance(value, (np.ndarray, np.generic)):
        raise ValueError(f"{name}: a NumPy scalar inside torch.compile, which traces it as an array, not a "
                         f"constant; convert it to a Python {python_type} outside the compiled function")


# routed_scaling_factor multiplies float32 weights: outside float32's normal range it made every
# weight inf (1e39) or 0 (1e-46) without a word
_SCALE_MIN, _SCALE_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
_SCALE_RANGE = f"a number > 0 that float32 holds, in [{_SCALE_MIN:.3g}, {_SCALE_MAX:.3g}]"


def _is_scale(value) -> bool:
    """A number > 0 within float32's normal range (NumPy's too, and torch.compile's symbolic
    numbers: compared, never passed to math.isfinite, which dynamic shapes cannot trace; NaN
    fails both comparisons)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.SymInt, torch.SymFloat)):
        return False
    return _SCALE_MIN <= value <= _SCALE_MAX


class _Default:
    """route()'s default of a rule keyword: told apart from the same value passed explicitly, so
    that a keyword given beside `config` is refused even when it equals the default."""

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def _given(value):
    return value.value if isinstance(value, _Default) else value


_SCORINGS = ("softmax", "sigmoid")
# Added to the denominator when renormalizing, as DeepSeek-V3's HF code does: sigmoid weights can
# all underflow to 0 for very negative logits, and 0 / 1e-20 = 0 beats 0 / 0 = NaN. Against a
# softmax top-k sum (>= 1/E) it is far below float32 resolution, so one rule serves every family.
_RENORM_EPS = 1e-20


def route(
    router_logits: torch.Tensor,
    top_k: int | None = None,
    *,
    renormalize: bool = _Default(True),
    scoring: str = _Default("softmax"),
    num_groups: int | None = None,
    topk_groups: int | None = None,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = _Default(1.0),
    config: RoutingConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose each token's top-k experts and their weights.

    router_logits: [M, E], any float dtype and device; the math runs in float32.
    Returns (topk_weights float32 [M, k], topk_ids int32 [M, k]) on the logits' device, each row
    ordered by decreasing choice score.

    The rule, in the order the Hugging Face modelling code applies it:
      1. scores = softmax(logits) over all E (Mixtral, Qwen2/3-MoE, OLMoE) or sigmoid(logits)
         (DeepSeek-V3, Kimi-K2, GLM-4.5, Llama-4).
      2. choice = scores + correction_bias (DeepSeek-V3's e_score_correction_bias), if given.
      3. grouped top-k (num_groups/topk_groups): a group's score is the sum of its 2 best choice
         values; only experts of the topk_groups best groups may be chosen.
      4. ids = top-k of choice; weights = the UNBIASED scores of those experts.
      5. renormalize: weights /= (sum + 1e-20); then weights *= routed_scaling_factor.
    Llama-4 is sigmoid, top-1, renormalize=False: its weight sigmoid(chosen logit) is what the
    model multiplies the expert's input by (`RoutingConfig.apply_on_input`; not route()'s job).

    With `config`, its fields give the rule and the other rule keywords must not be given (not
    even at their defaults); `correction_bias` is still passed here, since it is a tensor of the
    checkpoint.

    On a GPU, outside torch.compile and unless the weights need a gradient, the rule runs as one
    Triton kernel (fused.py), which also asserts the logits finite; elsewhere as the torch ops
    below, its reference (on exact ties of choice values the kernel takes the lowest expert id,
    torch.topk any of them).
    """
    if config is not None:
        if not isinstance(config, RoutingConfig):
            raise ValueError(f"route(): config must be a moekit.RoutingConfig, got {type(config).__name__}")
        overridden = [  # given explicitly, even at the default's value
            name
            for name, value in (
                ("top_k", top_k), ("renormalize", renormalize), ("scoring", scoring), ("num_groups", num_groups),
                ("topk_groups", topk_groups), ("routed_scaling_factor", routed_scaling_factor),
            )
            if value is not None and not isinstance(value, _Default)
        ]
        if overridden:
            raise ValueError(
                f"route(): pass either config or the keywords {overridden}, not both "
                f"(config already sets top_k={config.top_k}, scoring={config.scoring!r}, ...)"
            )
        if config.use_correction_bias and correction_bias is None:
            raise ValueError(
                "route(): config.use_correction_bias is True but no correction_bias tensor was "
                "given (pass the checkpoint's e_score_correction_bias, shape [E])"
            )
        if not config.use_correction_bias and correction_bias is not None:
            raise ValueError(
                "route(): correction_bias was given but config.use_correction_bias is False"
            )
        top_k, renormalize, scoring = config.top_k, config.renormalize, config.scoring
        num_groups, topk_groups = config.num_groups, config.topk_groups
        routed_scaling_factor = config.routed_scaling_factor
    renormalize, scoring, routed_scaling_factor = _given(renormalize), _given(scoring), _given(routed_scaling_factor)
    # checked as RoutingConfig checks its fields (the same helpers), so the two ways of giving a
    # rule accept the same values
    renormalize = check_flag("renormalize", renormalize)
    routed_scaling_factor = as_float(routed_scaling_factor, "routed_scaling_factor")
    top_k, num_groups, topk_groups = as_int(top_k, "top_k"), as_int(num_groups, "num_groups"), as_int(
        topk_groups, "topk_groups")

    _check_logits_form(router_logits)
    num_tokens, num_experts = router_logits.shape
    _check_rule(top_k, num_experts, scoring, num_groups, topk_groups, routed_scaling_factor)
    bias = _check_bias(correction_bias, num_experts, router_logits.device)

    if num_tokens == 0:
        return (
            torch.empty(0, top_k, dtype=torch.float32, device=router_logits.device),
            torch.empty(0, top_k, dtype=torch.int32, device=router_logits.device),
        )
    if _use_kernel(router_logits):
        from .fused import route_fused  # imported here: it compiles nothing until a GPU call

        return route_fused(router_logits, top_k, scoring=scoring, renormalize=renormalize,
                           num_groups=num_groups, topk_groups=topk_groups, bias=bias,
                           routed_scaling_factor=routed_scaling_factor)

    return route_with_torch_ops(_check_logits_values(router_logits), top_k, scoring=scoring,
                                renormalize=renormalize, num_groups=num_groups, topk_groups=topk_groups,
                                bias=bias, routed_scaling_factor=routed_scaling_factor)


def route_with_torch_ops(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str,
    renormalize: bool,
    num_groups: int | None,
    topk_groups: int | None,
    bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """route()'s rule as torch ops: the reference of the routing kernel (fused.route_fused, same
    arguments), its path on the CPU and under torch.compile. logits: [M, E] float32, checked; bias:
    float32 [E] or None; the rule validated (route() does all of it)."""
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    if bias is not None:
        choice = scores + bias
    elif scoring == "sigmoid" and num_groups is None:
        # sigmoid is monotonic, so choosing on the raw logits picks the same experts, and keeps
        # apart large logits whose float32 sigmoids both round to 1.0 (Llama-4 picks on logits).
        choice = logits
    else:
        choice = scores

    # topk_groups == num_groups keeps every group (GLM-4.5 and Kimi-K2 ship n_group=topk_group=1).
    if num_groups is not None and topk_groups < num_groups:
        choice = _mask_unkept_groups(choice, num_groups, topk_groups)

    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _RENORM_EPS)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


def _mask_unkept_groups(choice: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Set to -inf the choice scores of experts outside each row's topk_groups best groups.

    -inf follows DeepSeek's own inference code, and the DeepseekV3 / Glm4Moe routers of the
    transformers 5.25 the tests run with. Earlier HF code filled 0.0 instead, which is the same
    while every kept choice score is positive, but once correction_bias pushes kept scores below 0
    it lets experts of dropped groups win.
    """
    num_tokens, num_experts = choice.shape
    grouped = choice.reshape(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [M, G]
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
    masked = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf"))
    return masked.reshape(num_tokens, num_experts)


def _check_on_device(device: torch.device) -> bool:
    """Whether route()'s value checks run as device-side assertions (no host sync, so routing
    can be captured in a CUDA graph) rather than as host-side checks with a counted message.
    Also while torch.compile traces: a host check reads a value, which a graph cannot; the
    assertion is part of the graph (on the CPU a compiled graph raises it when it runs)."""
    return device.type == "cuda" or torch.compiler.is_compiling()


def _use_kernel(logits: torch.Tensor) -> bool:
    """Whether route() runs as one Triton kernel (fused.py) rather than torch ops: on a GPU,
    outside torch.compile (which traces the torch ops below and fuses them itself), and where no
    gradient is asked of the weights (the kernel has no backward: a router trained through its
    weights, an auxiliary loss, keeps the torch ops' autograd), and unless TRITON_INTERPRET was
    turned on after import (env.interpreter_set_late: the kernel could not run, the torch ops can)."""
    return (logits.device.type == "cuda" and not torch.compiler.is_compiling()
            and not (logits.requires_grad and torch.is_grad_enabled())
            and env.interpreter_set_late() is None)


def _check_logits_form(router_logits) -> None:
    if not isinstance(router_logits, torch.Tensor):
        raise ValueError(
            f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}"
        )
    if router_logits.dim() != 2:
        raise ValueError(
            f"router_logits must be 2-D [tokens, experts], got {router_logits.dim()}-D "
            f"with shape {tuple(router_logits.shape)}"
        )
    if not router_logits.is_floating_point():
        raise ValueError(
            f"router_logits must be a floating point tensor, got {router_logits.dtype}"
        )
    if router_logits.shape[1] == 0:
        raise ValueError("router_logits has 0 experts (shape [M, 0]); expected E >= 1")


def _check_logits_values(router_logits: torch.Tensor) -> torch.Tensor:
    """The logits as float32, checked finite: non-finite logits would route silently to
    arbitrary experts. On a GPU the check is a device-side assertion: it never makes the host
    wait, so routing can be graph-captured (the routing kernel asserts it itself)."""
    logits = router_logits.float()
    finite = torch.isfinite(logits)
    if _check_on_device(logits.device):
        torch._assert_async(finite.all(), "moekit.route: " + _NOT_FINITE)
    elif not bool(finite.all()):
        bad = int((~finite).sum())
        overflowed = int((torch.isfinite(router_logits) & ~finite).sum())  # float64 beyond float32's range
        if overflowed:
            raise ValueError(
                f"router_logits has {overflowed} {router_logits.dtype} value(s) beyond float32's range "
                f"(|x| > {torch.finfo(torch.float32).max:.3g}) out of {logits.numel()}; routing computes in "
                "float32: expected logits float32 holds"
            )
        raise ValueError(
            f"router_logits has {bad} non-finite value(s) (NaN or inf) out of {logits.numel()}; "
            "expected all finite"
        )
    return logits


# the device-side assertions' message (here and in _kernels.py): a float64 logit beyond float32's
# range becomes inf when routing reads it as float32, which the host check tells apart
_NOT_FINITE = "router_logits has NaN or inf values (or float64 values beyond float32's range)"


def _check_rule(top_k, num_experts, scoring, num_groups, topk_groups, routed_scaling_factor):
    if top_k is None:
        raise ValueError("route(): top_k is required (or pass config=RoutingConfig(...))")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an integer in [1, E={num_experts}], got {top_k!r}")
    if scoring not in _SCORINGS:
        raise ValueError(f"unknown scoring {scoring!r}; expected one of {_SCORINGS}")
    if not _is_scale(routed_scaling_factor):  # torch.compile(dynamic=True): a symbolic float
        raise ValueError(f"routed_scaling_factor must be {_SCALE_RANGE}, got {routed_scaling_factor!r}")
    if (num_groups is None) != (topk_groups is None):
        raise ValueError(
            f"num_groups and topk_groups go together, got num_groups={num_groups!r}, "
            f"topk_groups={topk_groups!r}"
        )
    _check_groups(num_groups, topk_groups)
    if num_groups is None:
        return
    if num_experts % num_groups:
        raise ValueError(
            f"num_groups must be a positive integer dividing E={num_experts}, got {num_groups!r}"
        )
    group_size = num_experts // num_groups
    if top_k > topk_groups * group_size:
        raise ValueError(
            f"top_k={top_k} exceeds the experts in the kept groups: topk_groups={topk_groups} "
            f"* (E/num_groups={group_size}) = {topk_groups * group_size}"
        )
    if topk_groups < num_groups and group_size < 2:
        raise ValueError(
            f"grouped routing scores a group by its 2 best experts, so E/num_groups must be >= 2, "
            f"got E={num_experts}, num_groups={num_groups}"
        )


def _check_groups(num_groups, topk_groups, prefix: str = "") -> None:
    """The grouping's own form, which needs no E (RoutingConfig checks it when made; `prefix`
    names it there), for a grouping given (both, or neither: its callers check that first):
    positive integers, topk_groups at most num_groups."""
    if num_groups is None and topk_groups is None:
        return
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"{prefix}num_groups must be a positive integer, got {num_groups!r}")
    if isinstance(topk_groups, bool) or not isinstance(topk_groups, int) or not 1 <= topk_groups <= num_groups:
        raise ValueError(
            f"{prefix}topk_groups must be an integer in [1, num_groups={num_groups}], got {topk_groups!r}"
        )


def check_fits(config: RoutingConfig, num_experts: int) -> None:
    """route()'s check of `config`'s rule against E experts (top_k <= E, num_groups dividing E,
    top_k within the kept groups): what a RoutingConfig cannot check without E, for MoELayer,
    which knows E when it is made rather than at its first forward. ValueError as route's."""
    _check_rule(config.top_k, num_experts, config.scoring, config.num_groups, config.topk_groups,
                config.routed_scaling_factor)


def _check_bias(correction_bias, num_experts, device) -> torch.Tensor | None:
    if correction_bias is None:
        return None
    if not isinstance(correction_bias, torch.Tensor) or not correction_bias.is_floating_point():
        got = correction_bias.dtype if isinstance(correction_bias, torch.Tensor) else type(correction_bias).__name__
        raise ValueError(f"correction_bias must be a floating point torch.Tensor of shape [E={num_experts}], got {got}")
    if tuple(correction_bias.shape) != (num_experts,):
        raise ValueError(
            f"correction_bias shape {tuple(correction_bias.shape)} does not match the router "
            f"logits: expected ({num_experts},)"
        )
    if correction_bias.device != device:
        # copied over on every call otherwise: a blocking host-to-device copy per layer, and a
        # CUDA error inside a graph capture; torch's own `scores + bias` refuses it too
        raise ValueError(f"correction_bias is on {correction_bias.device}, router_logits on {device}: "
                         "expected both on one device (move the bias once, with its model)")
    bias = correction_bias.to(device=device, dtype=torch.float32)
    if _check_on_device(bias.device):  # every call of a MoELayer with a bias comes here: no host sync
        # once per bias and version: a layer's bias is constant, and the check is 3 launches
        # inside every captured layer (an inference tensor keeps no version: checked every call)
        # (while compiling: in the graph, checked every call; the remembered versions are host state)
        compiling = torch.compiler.is_compiling()
        version = None if compiling or correction_bias.is_inference() else correction_bias._version
        if version is None or _checked_biases.get(correction_bias) != version:
            torch._assert_async(torch.isfinite(bias).all(), "moekit.route: correction_bias has NaN or inf values")
            if version is not None:
                _checked_biases[correction_bias] = version
    elif not bool(torch.isfinite(bias).all()):
        raise ValueError("correction_bias has non-finite values (NaN or inf); expected all finite")
    return bias


# the correction biases checked on the device -> the version checked (by identity; an entry goes
# with its tensor)
_checked_biases = WeakIdKeyDictionary()
