"""transformers' routers run through `moekit.route`: on a GPU one Triton launch per layer instead
of the router's own 5-15 torch ops (softmax or sigmoid, top-k, group masks, gathers, divisions).

    moekit.hf.fuse_routers(model)      # or from_pretrained(..., fused_routing=True) / patch_model
    moekit.hf.unfuse_routers(model)    # transformers' own routers again

Opt-in: transformers' routers stay the default. Only beside moekit's experts (patch_model /
from_pretrained put them there): transformers' own read int64 ids. The fused router keeps each
router's logits, weights and their dtypes (so `output_router_logits` still records the logits);
what differs (docs/routing.md, "transformers' routers"):
  - expert ids are int32 (transformers': int64), ordered by decreasing choice;
  - Llama-4's router returns RoutedExperts in place of its dense scores (moekit's block takes it);
  - on an exact tie of choice values the lowest expert id wins (torch.topk: any of them), and
    weights may differ from transformers' in the last float32 bits (the order of the sums);
  - non-finite logits are refused, as route() refuses them.
Before a router is swapped, the two are run on the same random hidden states and compared
(`check_router`): a router that routes otherwise on them is refused with the reason, never
swapped.

The swap changes the router's class to a subclass (same parameters, same state dict, same
`isinstance`), so saving, hooks and `torch.compile` (where route() runs as its torch ops) see the
router they know; pickle finds the subclass by name (the module's __getattr__).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..routing import RoutingConfig, route
from ..routing.agreement import WEIGHT_ATOL, WEIGHT_RTOL, near_ties, tie_picks_right
from .families import FAMILIES, Family, UnsupportedModelError

CHECK_TOKENS = 64  # random tokens a router is checked on before it is swapped


@dataclasses.dataclass(frozen=True)
class RouterRule:
    """How a family's transformers router routes, in moekit.route's terms.

    scoring: "softmax" (Mixtral, Qwen2/3-MoE, OLMoE) or "sigmoid".
    renormalize: True (always, Mixtral), False (never, Llama-4), or the router attribute that says
        (Qwen/OLMoE's and DeepSeek's norm_topk_prob).
    grouped: DeepSeek-V3-style routing: correction bias, groups and scaling factor from the router.
    float32_logits: the router's linear runs in float32 (DeepSeek-V3, GLM-4.5).
    weights_in_logits_dtype: the router returns its weights in the logits' dtype (Qwen, OLMoE,
        Llama-4), else float32.
    dense_scores: Llama-4's router returns (scores [T, E], logits) rather than (logits, weights, ids).
    """

    scoring: str
    renormalize: bool | str = True
    grouped: bool = False
    float32_logits: bool = False
    weights_in_logits_dtype: bool = False
    dense_scores: bool = False


_SOFTMAX_TOPK = RouterRule("softmax", renormalize="norm_topk_prob", weights_in_logits_dtype=True)
_GROUPED_SIGMOID = RouterRule("sigmoid", renormalize="norm_topk_prob", grouped=True, float32_logits=True)
RULES: dict[str, RouterRule] = {
    "mixtral": RouterRule("softmax", renormalize=True),
    "qwen2_moe": _SOFTMAX_TOPK,
    "qwen3_moe": _SOFTMAX_TOPK,
    "olmoe": _SOFTMAX_TOPK,
    "deepseek_v3": _GROUPED_SIGMOID,
    "glm4_moe": _GROUPED_SIGMOID,
    "glm4v_moe": _GROUPED_SIGMOID,
    "llama4": RouterRule("sigmoid", renormalize=False, weights_in_logits_dtype=True, dense_scores=True),
}


class RoutedExperts(NamedTuple):
    """What a fused Llama-4 router returns in place of its dense scores: the MoE block moekit puts
    in Llama-4 models (load.llama4_block_class) takes it as it is."""

    weights: torch.Tensor  # [T, k], the logits' dtype
    ids: torch.Tensor  # [T, k] int32


def _attr(router: nn.Module, name: str):
    if not hasattr(router, name):
        raise UnsupportedModelError(
            f"{type(router).__name__} has no attribute {name!r}: this transformers version's router is not "
            "the one moekit's fused routing was written for; leave fused_routing off"
        )
    return getattr(router, name)


def routing_config(router: nn.Module, rule: RouterRule) -> RoutingConfig:
    """The router's rule as a RoutingConfig, read from the router's own attributes."""
    renormalize = rule.renormalize if isinstance(rule.renormalize, bool) else bool(_attr(router, rule.renormalize))
    top_k = int(_attr(router, "top_k"))
    if not rule.grouped:
        return RoutingConfig(top_k=top_k, scoring=rule.scoring, renormalize=renormalize)
    return RoutingConfig(
        top_k=top_k, scoring=rule.scoring, renormalize=renormalize,
        num_groups=int(_attr(router, "num_group")), topk_groups=int(_attr(router, "topk_group")),
        use_correction_bias=True, routed_scaling_factor=float(_attr(router, "routed_scaling_factor")),
    )


def _logits(router: nn.Module, hidden_states: torch.Tensor, rule: RouterRule) -> torch.Tensor:
    weight = router.weight
    hidden = hidden_states.reshape(-1, weight.shape[-1])
    if rule.float32_logits:
        return F.linear(hidden.float(), weight.float())
    return F.linear(hidden, weight, getattr(router, "bias", None))


def fused_forward(self: nn.Module, hidden_states: torch.Tensor):
    """The forward of a fused router: transformers' contract, moekit.route's rule."""
    if not is_fused(self):  # captured by a wrapper (compressed-tensors, accelerate) before unfuse_routers
        return type(self).forward(self, hidden_states)
    rule = RULES[self.moekit_family]
    logits, weights, ids = _route_core(self, rule, hidden_states)
    if rule.weights_in_logits_dtype:
        weights = weights.to(logits.dtype)
    if rule.dense_scores:
        return RoutedExperts(weights, ids), logits
    return logits, weights, ids


def _route_core(router: nn.Module, rule: RouterRule, hidden_states: torch.Tensor):
    """(logits, float32 weights, int32 ids): the router's linear, then moekit.route."""
    logits = _logits(router, hidden_states, rule)
    bias = router.e_score_correction_bias if rule.grouped else None
    weights, ids = route(logits, config=routing_config(router, rule), correction_bias=bias)
    return logits, weights, ids


def _original_topk(router: nn.Module, original: type, hidden: torch.Tensor, rule: RouterRule):
    """(logits, weights, ids) from transformers' own forward of the router."""
    out = original.forward(router, hidden)
    if rule.dense_scores:
        scores, logits = out
        ids = torch.topk(logits, int(router.top_k), dim=-1).indices
        return logits, scores.gather(-1, ids), ids
    return out


def _check_hidden_dtype(router: nn.Module, rule: RouterRule, dtype: torch.dtype) -> torch.dtype:
    """The hidden states' dtype the check runs in: the model's, or a router's own where it keeps
    its weight in another floating dtype (a float32 router in a bf16 model under autocast, say)
    and does not cast itself (DeepSeek-V3 / GLM-4.5 routers cast to float32)."""
    if rule.float32_logits or not router.weight.dtype.is_floating_point:
        return dtype
    return router.weight.dtype


def check_router(router: nn.Module, family: Family, dtype: torch.dtype, tokens: int = CHECK_TOKENS) -> str | None:
    """Run transformers' router and the fused one on the same random hidden states; None where
    they agree, else what differs.
    - logits: bitwise (the same linear);
    - experts: the same set per token (transformers' DeepSeek-V3 router does not sort them), or
      on a near-tie (routing.agreement) another pick that agreement.tie_picks_right finds right:
      distinct experts, the rule's float64 weights for them, choice values within the tie;
    - weights at the same experts: within 1e-5 relative in float32 (a few ulps of the sums' order,
      as routing.agreement allows), or one ulp of the narrower dtype transformers returns them in
      (both sides round the same float32 weight);
    - the weights' dtype: transformers'.
    The random tokens find a rule that differs on most tokens, not one that differs only on rare
    ones (such as a group fill that matters only once biased scores fall below 0)."""
    rule = RULES[family.name]
    original = family.original_class(family.router_class)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, router.weight.shape[-1], generator=g)
    hidden = hidden.to(router.weight.device, _check_hidden_dtype(router, rule, dtype))
    with torch.no_grad():
        logits_hf, w_hf, ids_hf = _original_topk(router, original, hidden, rule)
        logits, w32, ids = _route_core(router, rule, hidden)
    if not torch.equal(logits, logits_hf):
        return "its logits differ from transformers' router's"
    if ids.shape != ids_hf.shape:
        return f"ids of shape {tuple(ids.shape)}, transformers' {tuple(ids_hf.shape)}"
    w = w32.to(logits.dtype) if rule.weights_in_logits_dtype else w32
    if w.dtype != w_hf.dtype:
        return f"weights are {w.dtype}, transformers' {w_hf.dtype}"
    ids_sorted, order = ids.long().sort(-1)
    ids_hf_sorted, order_hf = ids_hf.long().sort(-1)
    same = (ids_sorted == ids_hf_sorted).all(-1)
    config = routing_config(router, rule)
    bias = router.e_score_correction_bias if rule.grouped else None
    wrong = ~same
    excused = wrong & near_ties(logits.float(), config, bias)
    if bool(excused.any()):  # another pick on a near-tie must still be a right one
        wrong[excused.clone()] = ~tie_picks_right(w32, ids, ids_hf, logits.float(), config, bias, excused)
    if bool(wrong.any()):
        return f"{int(wrong.sum())} of {tokens} random tokens chose other experts than transformers' router"
    w_sorted = w.gather(-1, order)[same].double()
    w_hf_sorted = w_hf.gather(-1, order_hf)[same].double()
    tol = WEIGHT_RTOL if w.dtype == torch.float32 else torch.finfo(w.dtype).eps
    diff = (w_sorted - w_hf_sorted).abs() / (w_hf_sorted.abs() + WEIGHT_ATOL / WEIGHT_RTOL)
    rel = diff.max() if diff.numel() else 0.0
    if not float(rel) <= tol:
        return f"weights differ from transformers' by {float(rel):.2e} relative (allowed {tol:.1e})"
    return None


def family_of_router(module: nn.Module) -> Family | None:
    """The family whose transformers router `module` is (fused or not)."""
    name = type(module).__name__
    for family in FAMILIES:
        if family.router_class is None or name not in (family.router_class, f"Fused{family.router_class}"):
            continue
        try:
            if isinstance(module, family.original_class(family.router_class)):
                return family
        except (ImportError, AttributeError):  # a transformers without this family
            continue
    return None


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(original: type, family: Family) -> type:
    if original not in _FUSED_CLASSES:
        name = f"Fused{original.__name__}"
        cls = type(name, (original,),
                   {"forward": fused_forward, "moekit_family": family.name, "moekit_original": original,
                    "__module__": __name__, "__qualname__": name,
                    "__doc__": f"{original.__name__} routed by moekit.route."})
        _FUSED_CLASSES[original] = cls
    return _FUSED_CLASSES[original]


def __getattr__(name: str):
    """`moekit.hf.routers.Fused<Router>`: the fused classes are made on demand, and pickle finds
    them here by name (torch.save of a whole model with fused routers, loaded in a new process)."""
    for family in FAMILIES:
        if family.router_class is not None and name == f"Fused{family.router_class}":
            return _fused_class(family.original_class(family.router_class), family)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_fused(router: nn.Module) -> bool:
    return type(router) in _FUSED_CLASSES.values()


def fuse_routers(model: nn.Module, *, check: bool = True, dtype: torch.dtype | None = None) -> int:
    """Run every router of a supported family in `model` through moekit.route. Returns how many
    routers were swapped (already fused ones are left as they are). The experts beside each
    router must be moekit's (`patch_model` / `from_pretrained` put them there): transformers' own
    experts read int64 ids, and its Llama-4 block dense scores. With `check` (the default), each
    router is first compared with transformers' own on random hidden states of `dtype` (the
    model's by default; a router that keeps its weight in another dtype and does not cast, such
    as a float32 Mixtral router in a bf16 model, gets hidden states of its own dtype). Anything
    refused raises UnsupportedModelError before any is swapped."""
    return swap_routers(routers_to_fuse(model, check=check, dtype=dtype), model)


def _parent(model: nn.Module, name: str) -> nn.Module:
    parent, _, _ = name.rpartition(".")
    return model.get_submodule(parent) if parent else model


def _reads_fused_output(block: nn.Module) -> bool:
    """Whether the MoE block around a router takes a fused router's output: moekit's experts
    (int32 ids) or, for Llama-4, moekit's block (RoutedExperts)."""
    from .experts import MoekitExperts

    return bool(getattr(block, "takes_routed_experts", False)) or isinstance(getattr(block, "experts", None), MoekitExperts)


def _own_forward_pinned(router: nn.Module) -> bool:
    """Whether the router's instance holds its class's own forward, bound (as compressed-tensors
    leaves each module of a checkpoint it loaded, once its offloading is removed): harmless, and
    dropped at the swap so that the class's forward, the fused one, runs."""
    f = vars(router).get("forward")
    return f is not None and getattr(f, "__self__", None) is router and getattr(f, "__func__", None) is type(router).forward


def _offload_wrapped(router: nn.Module) -> bool:
    """Whether the router's forward is compressed-tensors' offloading wrapper (which every module
    of a compressed-tensors checkpoint that transformers loads gets): an instance forward wrapping
    the class's, that calls `router._original_forward_func`. The swap points that at the fused
    forward (and unfuse_routers back), since the wrapper would not see the new class."""
    f = vars(router).get("forward")
    own = type(router).moekit_original.forward if is_fused(router) else type(router).forward
    wrapped = getattr(getattr(f, "__func__", None), "__wrapped__", None)
    return (f is not None and getattr(f, "__self__", None) is router and wrapped in (own, fused_forward)
            and getattr(router, "_original_forward_func", None) in (own, fused_forward))


def _refusal(router: nn.Module) -> str | None:
    """Why a router cannot be swapped for its fused class, whatever its routing."""
    pinned = _own_forward_pinned(router) or _offload_wrapped(router)
    if ("forward" in vars(router) and not pinned) or hasattr(router, "_hf_hook"):
        return ("its forward is wrapped by a hook of its own (accelerate's offloading, say), which would keep "
                "calling transformers' forward; fused routing needs the router on its device")
    if router.weight.device.type == "meta":
        return "its weights are not loaded (meta device)"
    return None


def routers_to_fuse(model: nn.Module, *, check: bool = True, dtype: torch.dtype | None = None,
                    experts_patched: bool = True) -> list:
    """fuse_routers' first half: the routers to swap, each checked (nothing is changed yet).
    experts_patched=False: the experts are not moekit's yet (patch_model asks before it puts them
    in place, and swaps after)."""
    routers = [(name, m, family_of_router(m)) for name, m in model.named_modules()]
    routers = [(name, m, f) for name, m, f in routers if f is not None and not is_fused(m)]
    if not routers and not any(is_fused(m) for m in model.modules()):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no router of a family moekit can route "
            f"({', '.join(f.name for f in FAMILIES)})"
        )
    if dtype is None:
        dtype = getattr(model, "dtype", None)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2):
            dtype = torch.bfloat16
    for name, router, family in routers:
        label = f"{name} ({type(router).__name__})"
        routing_config(router, RULES[family.name])  # the attributes it reads exist
        problem = _refusal(router)
        if problem is None and experts_patched and not _reads_fused_output(_parent(model, name)):
            raise UnsupportedModelError(f"{label}: {_beside_transformers_experts(family)}")
        if problem is None and check:
            try:
                problem = check_router(router, family, dtype)
            except Exception as e:  # a router that cannot even run on the check's input: named, not raw
                problem = f"running it on the check's random hidden states failed ({type(e).__name__}: {e})"
        if problem is not None:
            raise UnsupportedModelError(f"{label}: {problem}; leave fused_routing off")
    return routers


def _beside_transformers_experts(family: Family) -> str:
    """Why a router beside transformers' own experts is not fused, and the one way to fuse it
    (its own sentence: "leave fused_routing off", the other refusals' advice, would contradict it)."""
    reads = ("in transformers' MoE block, which reads the router's dense scores" if family.block_class
             else "which read int64 ids (a fused router gives int32)")
    return (f"the experts beside it are transformers' own, {reads}; run moekit.hf.patch_model(model, "
            "fused_routing=True) instead: it puts moekit's experts in place, then fuses the routers")


def swap_routers(routers: list, model: nn.Module) -> int:
    """fuse_routers' second half: swap the class of each router that routers_to_fuse returned,
    once every one of them has moekit's experts beside it (checked first: patch_model asks for
    the routers before the experts are in place)."""
    for name, router, _ in routers:
        if not _reads_fused_output(_parent(model, name)):
            raise UnsupportedModelError(
                f"{name} ({type(router).__name__}): the experts beside it are not moekit's, which read int32 "
                "ids; fused routing left off"
            )
    for _, router, family in routers:
        if _own_forward_pinned(router):
            del router.forward
        elif _offload_wrapped(router):
            router._original_forward_func = fused_forward
        router.__class__ = _fused_class(family.original_class(family.router_class), family)
    return len(routers)


def unfuse_routers(model: nn.Module) -> int:
    """transformers' own routers again. Returns how many were restored."""
    count = 0
    for m in model.modules():
        if is_fused(m):
            if _own_forward_pinned(m):
                del m.forward
            elif _offload_wrapped(m):
                m._original_forward_func = type(m).moekit_original.forward
            m.__class__ = type(m).moekit_original
            count += 1
    return count
