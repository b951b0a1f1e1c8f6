"""Saving a model with moekit experts as a compressed-tensors checkpoint (vLLM, SGLang,
transformers and moekit load it).

What is written:
- the experts, per expert, under the names the family's checkpoints use (transformers' own
  renamings reversed: Mixtral `block_sparse_moe.experts.{e}.w1|w3|w2`, the others
  `mlp.experts.{e}.gate_proj|up_proj|down_proj`, Llama-4 `feed_forward.experts.{e}...`):
  `.weight` FP8 e4m3fn [out, in], `.weight_scale` float32 (tensor [1], channel [out, 1],
  block [out/128, in/128]) and, for fp8-tensor-static, `.input_scale` [1] (gate and up carry
  the layer's a13, down its a2);
- everything else as the model holds it (bf16 stays bf16; layers that transformers kept in FP8
  keep their FP8 weight and scales), under transformers' checkpoint names, except that the scales
  of quant_method "fp8" layers (FP8Linear: `weight_scale_inv`, `activation_scale`) take
  compressed-tensors' names (`weight_scale`, `input_scale`); such a layer must have the experts'
  scheme, the one scheme the config describes;
- config.json with a compressed-tensors `quantization_config`: one config group targeting
  "Linear" with the scheme's weights and input_activations, format "float-quantized", status
  "compressed", and `ignore` listing every non-expert Linear whose weight is not FP8 (so the
  attention, routers, shared experts and lm_head stay unquantized for every loader).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from torch import nn

from ..spec import BLOCK, FP8_MAX, QuantScheme
from .experts import experts_modules
from .families import UnsupportedModelError, family_of
from .load import prefix_of_module

DEFAULT_SHARD_BYTES = 5 * 1024**3


def quantization_config(scheme: QuantScheme, ignore: list[str]) -> dict:
    """The compressed-tensors quantization_config of a moekit FP8 scheme."""
    def args(strategy, dynamic, **extra):
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
                "group_size": None, "block_structure": None, "actorder": None, "observer": None,
                "observer_kwargs": {}, **extra}

    if scheme.weight == "tensor":
        weights = args("tensor", False, observer="minmax")
        inputs = args("tensor", not scheme.static_activation, observer=None if not scheme.static_activation else "minmax")
    elif scheme.weight == "channel":
        weights = args("channel", False, observer="minmax")
        inputs = args("token", True)
    elif scheme.weight == "block":
        weights = args("block", False, block_structure=[BLOCK, BLOCK], observer="minmax")
        inputs = args("group", True, group_size=BLOCK)
    else:
        raise ValueError(f"scheme {scheme.name} is not an FP8 scheme")
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                        "output_activations": None, "format": "float-quantized"},
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
    }


def _expert_tensors(module, prefix: str, projections, transposed: bool = False) -> dict[str, torch.Tensor]:
    w = module.moe_weights()
    s = w.scheme
    N, E = w.n, w.num_experts
    if transposed and not s.is_fp8:
        # unquantized Llama-4 checkpoints hold the experts fused, and transformers reads only
        # that (per-expert names would load as missing, the experts newly initialized)
        return {f"{prefix}.gate_up_proj": w.w13.transpose(1, 2), f"{prefix}.down_proj": w.w2.transpose(1, 2)}
    gate, up, down = projections
    out: dict[str, torch.Tensor] = {}
    for e in range(E):
        mats = {gate: w.w13[e, :N], up: w.w13[e, N:], down: w.w2[e]}
        for proj, mat in mats.items():
            out[f"{prefix}.{e}.{proj}.weight"] = mat
        if not s.is_fp8:
            continue
        if s.weight == "tensor":
            scales = {gate: w.w13_scale[e].reshape(1), up: w.w13_scale[e].reshape(1), down: w.w2_scale[e].reshape(1)}
        elif s.weight == "channel":
            scales = {gate: w.w13_scale[e, :N, None], up: w.w13_scale[e, N:, None], down: w.w2_scale[e, :, None]}
        else:
            nb = N // BLOCK
            scales = {gate: w.w13_scale[e, :nb], up: w.w13_scale[e, nb:], down: w.w2_scale[e]}
        for proj, sc in scales.items():
            out[f"{prefix}.{e}.{proj}.weight_scale"] = sc.clone()
        if s.static_activation:
            for proj, a in ((gate, w.a13_scale), (up, w.a13_scale), (down, w.a2_scale)):
                out[f"{prefix}.{e}.{proj}.input_scale"] = a.reshape(1).clone()
    return out


def _fp8_linear_names(model: nn.Module, state: dict[str, torch.Tensor], scheme: QuantScheme) -> None:
    """Give the dense FP8 layers that transformers' quant_method "fp8" keeps (FP8Linear, on a GPU)
    compressed-tensors' tensor names, in place: their scales are `weight_scale_inv` (a multiplier,
    like compressed-tensors' `weight_scale`) and `activation_scale` (static: compressed-tensors'
    `input_scale`), and a loader of the written compressed-tensors config looks only for the latter
    names (the layers would load with missing scales). The config has one scheme for every Linear,
    the experts': a dense layer of another scheme is refused."""
    from ..models import parse_quantization_config

    for name, module in model.named_modules():
        weight, scale = getattr(module, "weight", None), getattr(module, "weight_scale_inv", None)
        at = f"{name}." if name else ""
        if (not isinstance(scale, torch.Tensor) or not isinstance(weight, torch.Tensor)
                or weight.dtype != torch.float8_e4m3fn or f"{at}weight_scale_inv" not in state):
            continue
        block, act = getattr(module, "block_size", None), getattr(module, "activation_scheme", "dynamic")
        fp8_config = {"quant_method": "fp8", "activation_scheme": act, "weight_block_size": block}
        try:
            dense = parse_quantization_config(fp8_config)
        except ValueError as e:
            raise UnsupportedModelError(f"cannot save {name} ({type(module).__name__}, block_size={block!r}, "
                                        f"activation_scheme={act!r}): {e}") from None
        if dense != scheme:
            raise UnsupportedModelError(
                f"cannot save {name} ({type(module).__name__}): it is an FP8 layer of scheme {dense.name} but "
                f"the experts are {scheme.name}, and a compressed-tensors quantization_config written by "
                "moekit has one scheme for every Linear"
            )
        # float8_e8m0 (ue8m0) scales are powers of two: exact in float32, what compressed-tensors reads
        scale = state.pop(f"{at}weight_scale_inv").float()
        state[f"{at}weight_scale"] = scale.reshape(1) if dense.weight == "tensor" else scale
        activation = state.pop(f"{at}activation_scale", None)
        if activation is not None:
            state[f"{at}input_scale"] = activation.float().reshape(1)


def _full_scale(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """A dense layer's weight_scale broadcast over its [out, in] weight: per tensor ([1] or []),
    per output channel ([out, 1]) or per 128x128 block ([ceil(out/128), ceil(in/128)]); None for
    another shape."""
    out_f, in_f = shape
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    if tuple(scale.shape) in ((out_f, 1), (out_f,)):
        return scale.reshape(out_f, 1)
    if tuple(scale.shape) == (-(-out_f // BLOCK), -(-in_f // BLOCK)):
        return scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:out_f, :in_f]
    return None


def _compress_decompressed(state: dict[str, torch.Tensor]) -> None:
    """The dense FP8 layers that compressed-tensors decompressed, back to FP8, in place.

    At a model's first forward compressed-tensors decompresses its dense FP8 layers: `weight`
    becomes the dequantized bf16 weight, `weight_scale` stays, and the layer still quantizes its
    input. Saved so, the checkpoint had bf16 weights with stale scales, listed in `ignore`: the
    reloaded layers ran unquantized. Each such weight is quantized again with its own scale; it
    must come back within its dtype's rounding (the FP8 weight times the scale, rounded once),
    else it changed since it was loaded and saving it as FP8 would lose that: refused, by name."""
    for key in [k for k in state if k.endswith(".weight_scale")]:
        name = key[: -len(".weight_scale")]
        weight = state.get(f"{name}.weight")
        if weight is None or weight.dim() != 2 or not weight.is_floating_point() or weight.dtype == torch.float8_e4m3fn:
            continue
        full = _full_scale(state[key], weight.shape)
        if full is None:
            raise UnsupportedModelError(f"cannot save {name}: its weight_scale has shape {tuple(state[key].shape)}, not that of "
                              f"a per-tensor, per-channel or 128x128-block scale of a {tuple(weight.shape)} weight")
        fp8 = (weight.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        # the product rounded to bf16 once is within 2^-8 of it, relatively (2^-7 allows a second
        # rounding, of the scale); FP8's own spacing is 2^-3 to 2^-4, so the FP8 value found is
        # the one stored, and a weight changed since (by more than a rounding) shows
        err = (fp8.float() * full - weight.float()).abs()
        if not bool((err <= fp8.float().abs() * full * 2.0**-7 + torch.finfo(weight.dtype).tiny).all()):
            raise UnsupportedModelError(
                f"cannot save {name}: its weight is {weight.dtype} beside an FP8 weight_scale (compressed-tensors "
                "decompressed it at the first forward), but it is no longer the FP8 weight times that scale: it "
                "changed after loading, and an FP8 checkpoint would lose the change"
            )
        state[f"{name}.weight"] = fp8


def _non_expert_state(model: nn.Module, expert_names: list[str], scheme: QuantScheme
                      ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The rest of the model under its checkpoint names (tied copies dropped), and the names of
    the tied copies dropped (a tied lm_head is a Linear the quantization config must ignore)."""
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    inside = tuple(f"{n}." for n in expert_names)
    state = {k: v for k, v in state.items() if not k.startswith(inside)}
    if scheme.is_fp8:
        _fp8_linear_names(model, state, scheme)
        _compress_decompressed(state)
    seen: dict[tuple, str] = {}
    tied = []
    for k in list(state):  # tied weights (embeddings / lm_head) are stored once
        v = state[k]
        ident = (v.device, v.data_ptr(), v.dtype, tuple(v.shape), tuple(v.stride()))
        if v.numel() and ident in seen:
            if k.endswith(".weight") and v.dim() == 2 and v.dtype != torch.float8_e4m3fn:
                tied.append(k)
            del state[k]
        else:
            seen[ident] = k
    return revert_weight_conversion(model, state), tied


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """The tensor on the CPU, holding only its own elements (safetensors writes whole storages)."""
    t = t.detach().to("cpu")
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():  # a view (one expert of w13)
        t = t.clone()
    return t.contiguous()  # a transposed view (Llama-4's fused unquantized experts): safetensors takes rows


def _write_shards(tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int) -> None:
    """Write the tensors in shards of at most max_shard_bytes (a larger tensor alone), one shard at
    a time: the shards are planned from the tensors' sizes, and only one shard's tensors are ever
    copied to host memory (not the whole model)."""
    from safetensors.torch import save_file

    shards: list[list[str]] = [[]]
    size = 0
    for k in sorted(tensors):
        nbytes = tensors[k].numel() * tensors[k].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nbytes
    for old in folder.glob("model*.safetensors"):
        old.unlink()
    index = folder / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    weight_map, total = {}, 0
    for i, keys in enumerate(shards, 1):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        shard = {k: _host_copy(tensors[k]) for k in keys}
        save_file(shard, folder / name, metadata={"format": "pt"})
        for k, t in shard.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
        del shard  # this shard's host copies go before the next shard's are made
    if len(shards) > 1:
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def save_pretrained(model: nn.Module, path: str | os.PathLike, *, max_shard_size: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write `model` (loaded or patched by moekit) to `path` as a compressed-tensors checkpoint:
    config.json (+ generation_config.json) and safetensors shards. Returns the folder.
    The tokenizer is not part of the model: save it alongside with tokenizer.save_pretrained(path)."""
    modules = experts_modules(model)
    if not modules:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no moekit experts: load it with moekit.hf.from_pretrained or "
            "call moekit.hf.patch_model(model, scheme=...) first"
        )
    schemes = {m.scheme for m in modules.values()}
    if len(schemes) != 1 or None in schemes:
        raise UnsupportedModelError(f"the experts of one model must share one loaded scheme, found {schemes}")
    scheme = schemes.pop()
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)

    tensors, tied = _non_expert_state(model, list(modules), scheme)
    for name, m in modules.items():
        family = family_of(m.family)
        projections = family.projections if family else ("gate_proj", "up_proj", "down_proj")
        prefix = prefix_of_module(model, name, family) if family else name
        tensors.update(_expert_tensors(m, prefix, projections, transposed=bool(family and family.transposed)))

    dense_fp8 = [k for k, t in tensors.items() if k.endswith(".weight") and t.dtype == torch.float8_e4m3fn
                 and ".experts." not in k]
    config = copy.deepcopy(model.config)
    if scheme.is_fp8:
        ignore = sorted({k[: -len(".weight")] for k, t in tensors.items()
                         if k.endswith(".weight") and t.dim() == 2 and t.dtype != torch.float8_e4m3fn}
                        | {k[: -len(".weight")] for k in tied})  # a tied lm_head is a bf16 Linear too
        config.quantization_config = quantization_config(scheme, ignore)
    elif dense_fp8:
        raise UnsupportedModelError(
            f"bf16 experts next to FP8 dense layers ({dense_fp8[0]}, ...) have no single quantization_config"
        )
    elif hasattr(config, "quantization_config"):
        del config.quantization_config
    for sub in ("text_config",):
        sub_config = getattr(config, sub, None)
        if sub_config is not None and hasattr(sub_config, "quantization_config"):
            del sub_config.quantization_config
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(folder)
    _write_shards(tensors, folder, max_shard_size)
    return folder
