"""moekit.hf.warmup: `moekit.warmup` for every experts module of a transformers model that runs
through moekit, and moekit.route's kernel for every fused router (moekit/compile_ahead.py says
what is compiled and why)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..compile_ahead import WarmupReport, batch_sizes_to_warm, warm_routing
from ..compile_ahead import warmup as warm_weights
from .experts import MoekitExperts, _hf_weights, on_moekit
from .routers import RULES, is_fused, routing_config


def warmup(
    model: nn.Module,
    max_batch_size: int | None = None,
    *,
    batch_sizes: Sequence[int] | None = None,
    top_k: int | None = None,
    dtype: torch.dtype | None = None,
    on_size: Callable[[int], object] | None = None,
) -> list[WarmupReport]:
    """Compile ahead the Triton kernels of `model`'s moekit experts at each batch size (tokens per
    forward: 1 ... max_batch_size, or `batch_sizes`), one `moekit.warmup` per distinct layer shape,
    scheme, device and backend (every layer of a shape shares its kernels), with int32 and int64
    ids; and route's kernel for each fused router. `top_k`: the model config's
    num_experts_per_tok unless given; `dtype`: the hidden states' (the model's dtype unless
    given). Returns the experts' reports; ValueError where the model has no experts module
    running through moekit."""
    sizes = batch_sizes_to_warm(max_batch_size, batch_sizes)
    config = getattr(model, "config", None)
    k = top_k if top_k is not None else getattr(config, "num_experts_per_tok", None)
    if k is None:
        raise ValueError("the model's config has no num_experts_per_tok: pass top_k, the experts per token")
    if dtype is None:
        dtype = getattr(model, "dtype", None)
        dtype = dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
    reports, done = [], set()
    for name, module in model.named_modules():
        found = _experts(name, module)
        if found is None:
            continue
        weights, backend, on_input = found
        per_call = 1 if on_input else k  # weight on the input: one top-1 call per slot (run_experts)
        key = (weights.shape(per_call), weights.scheme.name, str(weights.device), backend)
        if key in done:
            continue
        done.add(key)
        reports.append(warm_weights(weights, per_call, batch_sizes=sizes, dtype=dtype, backend=backend,
                                    allow_weight_copies=False, on_size=on_size))  # as experts.py's calls
    if not reports:
        raise ValueError("no experts module of this model runs through moekit: load it with moekit.hf.from_pretrained, "
                         "patch_model, or experts_implementation=\"moekit\" first")
    routed = set()
    for module in model.modules():
        if not is_fused(module):
            continue
        rule = RULES[module.moekit_family]
        logits_dtype = torch.float32 if rule.float32_logits else module.weight.dtype
        routing = routing_config(module, rule)
        bias = module.e_score_correction_bias if rule.grouped else None
        key = (routing, module.weight.shape[0], logits_dtype, str(module.weight.device))
        if key not in routed:
            routed.add(key)
            warm_routing(routing, module.weight.shape[0], sizes, module.weight.device, (logits_dtype,), bias)
    return reports


def _experts(name: str, module: nn.Module):
    """(MoEWeights, backend, weight on the input) of an experts module running through moekit:
    moekit's own, or transformers' with experts_implementation="moekit"; None for any other."""
    if isinstance(module, MoekitExperts):
        return (module.moe_weights(), module.backend, module.apply_on_input) if module.loaded else None
    if not on_moekit(module):
        return None
    label = getattr(module, "moekit_name", None) or name
    return _hf_weights(module, label), getattr(module, "moekit_backend", "auto"), False


__all__ = ["warmup"]
