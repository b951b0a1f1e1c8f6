"""Real models: named presets, and reading a Hugging Face `config.json` into a `ModelSpec`.

A `ModelSpec` is what moekit needs to run one model's MoE layers: the layer's shape
(`MoEShape`, with `num_layers` = the number of MoE layers, not all decoder layers), the
checkpoint's quantization (`QuantScheme`) and the router's rule (`RoutingConfig`).

    get_model("deepseek-v3", tp=8)          # a preset, with tensor parallelism applied
    get_model("/models/GLM-4.5V-FP8")       # a folder holding config.json
    parse_config({"model_type": "mixtral", ...})

Presets were checked against the published config.json of each `hf_id`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping

from .routing import RoutingConfig
from .spec import (
    BF16,
    BLOCK,
    FP8_BLOCK128,
    FP8_CHANNEL_TOKEN,
    FP8_TENSOR_DYNAMIC,
    FP8_TENSOR_STATIC,
    MoEShape,
    QuantScheme,
)

__all__ = ["ModelSpec", "PRESETS", "get_model", "parse_config"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model's MoE layers: shape, quantization scheme and routing rule.

    name: a preset-like short name ("deepseek-v3"); model_type: the config's `model_type`
    ("deepseek_v3", "glm4v_moe", ...); hf_id: the Hugging Face repo, informational only.
    """

    name: str
    shape: MoEShape
    scheme: QuantScheme
    routing: RoutingConfig
    model_type: str
    hf_id: str | None = None

    def with_tp(self, tp: int) -> "ModelSpec":
        return dataclasses.replace(self, shape=self.shape.with_tp(tp))

    def describe(self) -> str:
        return (
            f"{self.name}: {self.shape.describe()} x{self.shape.num_layers} MoE layers, "
            f"{self.scheme}, {self.routing.scoring} routing"
        )


# --------------------------------------------------------------------------------------------
# Presets. Shapes: experts / hidden / moe intermediate / top-k / shared experts; num_layers
# counts MoE layers only. Sources (published config.json; the FP8 repos share their base
# model's text fields):
#   GLM-4.5V(-FP8)        text_config: 46 layers, first_k_dense_replace 1 -> 45;
#                         n_group 1, topk_group 1, routed_scaling_factor 1.0 (GLM-4.5-Air-like)
#   GLM-4.5-Air(-FP8)     46 layers, first_k_dense_replace 1 -> 45; routed_scaling_factor 1.0
#   GLM-4.5(-FP8)         92 layers, first_k_dense_replace 3 -> 89; routed_scaling_factor 2.5
#   Llama-4-Maverick      text_config: 48 layers, interleave_moe_layer_step 2 -> 24
#   Llama-4-Scout         text_config: 48 layers, interleave_moe_layer_step 1 -> 48
#   DeepSeek-V3           61 layers, first_k_dense_replace 3 -> 58 (the MTP layer is extra)
#   Kimi-K2               61 layers, first_k_dense_replace 1 -> 60 (model_type "kimi_k2")
#   Qwen3-30B-A3B         48 layers, decoder_sparse_step 1, mlp_only_layers [] -> 48
#   Qwen3-235B-A22B       94 layers, decoder_sparse_step 1, mlp_only_layers [] -> 94
#   Mixtral-8x7B          32 layers, every one MoE
#   OLMoE-1B-7B           16 layers, every one MoE
# --------------------------------------------------------------------------------------------


def _glm_routing(scaling: float) -> RoutingConfig:
    return RoutingConfig(
        top_k=8,
        scoring="sigmoid",
        renormalize=True,
        num_groups=1,
        topk_groups=1,
        use_correction_bias=True,
        routed_scaling_factor=scaling,
    )


_LLAMA4_ROUTING = RoutingConfig(top_k=1, scoring="sigmoid", renormalize=False, apply_on_input=True)


def _preset(name, shape, scheme, routing, model_type, hf_id) -> tuple[str, ModelSpec]:
    return name, ModelSpec(name, shape, scheme, routing, model_type, hf_id)


PRESETS: dict[str, ModelSpec] = dict(
    [
        _preset(
            "glm-4.5v-fp8",
            MoEShape(128, 4096, 1408, 8, num_layers=45, shared_experts=1),
            FP8_CHANNEL_TOKEN,
            _glm_routing(1.0),
            "glm4v_moe",
            "zai-org/GLM-4.5V-FP8",
        ),
        _preset(
            "glm-4.5-air-fp8",
            MoEShape(128, 4096, 1408, 8, num_layers=45, shared_experts=1),
            FP8_CHANNEL_TOKEN,
            _glm_routing(1.0),
            "glm4_moe",
            "zai-org/GLM-4.5-Air-FP8",
        ),
        _preset(
            "glm-4.5-fp8",
            MoEShape(160, 5120, 1536, 8, num_layers=89, shared_experts=1),
            FP8_CHANNEL_TOKEN,
            _glm_routing(2.5),
            "glm4_moe",
            "zai-org/GLM-4.5-FP8",
        ),
        _preset(
            "llama-4-maverick-fp8",
            MoEShape(128, 5120, 8192, 1, num_layers=24, shared_experts=1),
            FP8_CHANNEL_TOKEN,
            _LLAMA4_ROUTING,
            "llama4",
            "meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8",
        ),
        _preset(
            "llama-4-scout",
            MoEShape(16, 5120, 8192, 1, num_layers=48, shared_experts=1),
            BF16,
            _LLAMA4_ROUTING,
            "llama4",
            "meta-llama/Llama-4-Scout-17B-16E-Instruct",
        ),
        _preset(
            "deepseek-v3",
            MoEShape(256, 7168, 2048, 8, num_layers=58, shared_experts=1),
            FP8_BLOCK128,
            RoutingConfig(
                top_k=8,
                scoring="sigmoid",
                renormalize=True,
                num_groups=8,
                topk_groups=4,
                use_correction_bias=True,
                routed_scaling_factor=2.5,
            ),
            "deepseek_v3",
            "deepseek-ai/DeepSeek-V3",
        ),
        _preset(
            "kimi-k2",
            MoEShape(384, 7168, 2048, 8, num_layers=60, shared_experts=1),
            FP8_BLOCK128,
            RoutingConfig(
                top_k=8,
                scoring="sigmoid",
                renormalize=True,
                num_groups=1,
                topk_groups=1,
                use_correction_bias=True,
                routed_scaling_factor=2.827,
            ),
            "kimi_k2",
            "moonshotai/Kimi-K2-Instruct",
        ),
        _preset(
            "qwen3-30b-a3b-fp8",
            MoEShape(128, 2048, 768, 8, num_layers=48, shared_experts=0),
            FP8_BLOCK128,
            RoutingConfig(top_k=8, scoring="softmax", renormalize=True),
            "qwen3_moe",
            "Qwen/Qwen3-30B-A3B-FP8",
        ),
        _preset(
            "qwen3-235b-a22b-fp8",
            MoEShape(128, 4096, 1536, 8, num_layers=94, shared_experts=0),
            FP8_BLOCK128,
            RoutingConfig(top_k=8, scoring="softmax", renormalize=True),
            "qwen3_moe",
            "Qwen/Qwen3-235B-A22B-FP8",
        ),
        _preset(
            "mixtral-8x7b",
            MoEShape(8, 4096, 14336, 2, num_layers=32, shared_experts=0),
            BF16,
            RoutingConfig(top_k=2, scoring="softmax", renormalize=True),
            "mixtral",
            "mistralai/Mixtral-8x7B-v0.1",
        ),
        _preset(
            "olmoe-1b-7b",
            MoEShape(64, 2048, 1024, 8, num_layers=16, shared_experts=0),
            BF16,
            RoutingConfig(top_k=8, scoring="softmax", renormalize=False),
            "olmoe",
            "allenai/OLMoE-1B-7B-0924",
        ),
    ]
)


def get_model(name_or_path: str | os.PathLike, tp: int = 1) -> ModelSpec:
    """A preset by name (case-insensitive), or the model whose config.json is at this path.

    `tp` splits each expert's intermediate size over that many GPUs; MoEShape raises a
    ValueError if the intermediate size is not divisible by it.
    """
    key = os.fspath(name_or_path)
    preset = PRESETS.get(key.strip().lower())
    if preset is not None:
        return preset.with_tp(tp)
    if os.path.exists(key):
        return parse_config(key, tp=tp)
    raise ValueError(
        f"unknown model {key!r}: not a preset and not an existing path; "
        f"presets: {', '.join(PRESETS)}"
    )


# --------------------------------------------------------------------------------------------
# config.json parsing
# --------------------------------------------------------------------------------------------

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")
_TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k")
_HIDDEN_KEYS = ("hidden_size",)
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layers")

# Families whose config nests the language model under text_config.
_TEXT_CONFIG_FAMILIES = ("llama4", "glm4v_moe")
_DEEPSEEK_FAMILIES = ("deepseek_v3", "kimi_k2", "deepseek_v2")
_GLM_FAMILIES = ("glm4_moe", "glm4v_moe", "glm4_moe_lite")  # lite: GLM-4.7-Flash, DeepSeek-like attention
_QWEN_FAMILIES = ("qwen2_moe", "qwen3_moe")
# The language model's own model_type, as a text sub-config or a text-only model saves it: it
# routes like its family (a "llama4_text" config read as generic would be softmax, renormalized).
_TEXT_MODEL_TYPES = {"llama4_text": "llama4", "glm4v_moe_text": "glm4v_moe"}
_KNOWN_FAMILIES = ("mixtral", "olmoe", "llama4") + _DEEPSEEK_FAMILIES + _GLM_FAMILIES + _QWEN_FAMILIES


def parse_config(source: Mapping[str, Any] | str | os.PathLike, tp: int = 1) -> ModelSpec:
    """Read a Hugging Face config (a dict, a config.json path, or a model folder) into a ModelSpec.

    The MoE fields are read by `model_type` (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3,
    kimi_k2, glm4_moe, glm4v_moe, llama4, and the text-only llama4_text, glm4v_moe_text), with a
    fallback on the usual keys for other families.
    `quantization_config` gives the scheme (none: bf16); an unsupported one raises ValueError
    naming the field and the value found. The config has no tensor parallelism: `tp` sets it.
    """
    config, origin_name = _load(source)
    model_type = config.get("model_type")
    model_type = model_type if isinstance(model_type, str) and model_type else "unknown"

    family = _TEXT_MODEL_TYPES.get(model_type, model_type)

    text = _text_config(config, family)
    where = "text_config" if text is not config else "top level"
    sub = text.get("model_type") if text is not config else None
    if family not in _KNOWN_FAMILIES and isinstance(sub, str):  # an unknown wrapper of a known language model
        sub = _TEXT_MODEL_TYPES.get(sub, sub)
        family = sub if sub in _KNOWN_FAMILIES else family

    num_experts = _get_int(text, _EXPERT_KEYS)
    top_k = _get_int(text, _TOPK_KEYS)
    hidden = _get_int(text, _HIDDEN_KEYS)
    if family in ("mixtral", "olmoe", "llama4"):
        # these call the expert size intermediate_size (Llama-4 dense MLP: intermediate_size_mlp)
        intermediate_keys = ("intermediate_size",)
    else:
        intermediate_keys = _INTERMEDIATE_KEYS
    intermediate = _get_int(text, intermediate_keys)
    missing = [
        "/".join(keys)
        for keys, value in (
            (_EXPERT_KEYS, num_experts),
            (_TOPK_KEYS, top_k),
            (_HIDDEN_KEYS, hidden),
            (intermediate_keys, intermediate),  # the keys read for this family, as the error says
        )
        if value is None or value < 1
    ]
    if missing:
        raise ValueError(
            f"config (model_type {model_type!r}) has no usable MoE fields at its {where}: "
            f"looked for {'; '.join(missing)} (each a positive integer)"
        )

    num_layers = _count_moe_layers(text, where)
    shared = _shared_experts(text, family)
    routing = _routing(text, family, top_k)
    _check_groups(routing, num_experts)
    quant = config.get("quantization_config")
    if quant is None and text is not config:
        quant = text.get("quantization_config")
    scheme = parse_quantization_config(quant)

    shape = MoEShape(
        num_experts=num_experts,
        hidden=hidden,
        intermediate=intermediate,
        top_k=top_k,
        tp=tp,
        num_layers=num_layers,
        shared_experts=shared,
    )
    name, hf_id = _name(config, origin_name, model_type)
    return ModelSpec(name, shape, scheme, routing, model_type, hf_id)


def _load(source) -> tuple[dict, str | None]:
    """The config dict, and the folder name it came from (None for a dict)."""
    if isinstance(source, Mapping):
        return dict(source), None
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"parse_config expects a dict or a path, got {type(source).__name__}")
    path = Path(source).expanduser()
    if path.is_dir():
        folder = path
        path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"model folder {str(folder)!r} has no config.json")
    elif not path.is_file():
        raise ValueError(f"no such config file or model folder: {str(path)!r}")
    else:
        folder = path.resolve().parent
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} holds a JSON {type(config).__name__}, not an object")
    return config, folder.resolve().name or None


def _text_config(config: dict, model_type: str) -> dict:
    """Where the language model's fields live: text_config for vision models, else the top level."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    if model_type in _TEXT_CONFIG_FAMILIES:
        return text
    # An unknown multimodal family: use text_config if the top level has no MoE fields.
    if _get_int(config, _EXPERT_KEYS) is None and _get_int(text, _EXPERT_KEYS) is not None:
        return text
    return config


def _get_int(config: Mapping[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _count_moe_layers(text: dict, where: str) -> int:
    """The decoder layers that hold an MoE block, from the family's layer-schedule keys."""
    moe_layers = text.get("moe_layers")  # llama4_text (newer transformers write it out)
    if isinstance(moe_layers, list) and moe_layers:
        return len(moe_layers)
    types = text.get("mlp_layer_types")  # glm4_moe_lite: "dense" / "sparse" per layer
    if isinstance(types, list) and types:
        count = sum(1 for t in types if t == "sparse")
        if count < 1:
            raise _unsupported("mlp_layer_types", types, "mlp_layer_types with at least one 'sparse' layer")
        return count
    total = _get_int(text, _LAYER_KEYS)
    if total is None or total < 1:
        raise ValueError(
            f"config has no layer count at its {where}: looked for {', '.join(_LAYER_KEYS)}"
        )
    first_dense = _get_int(text, ("first_k_dense_replace",)) or 0  # DeepSeek, Kimi, GLM
    freq = text.get("moe_layer_freq", 1)  # DeepSeek: an int; Megatron-style exports: a 0/1 list
    if not (isinstance(freq, list) or (isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1)):
        raise _unsupported("moe_layer_freq", freq, "moe_layer_freq a positive integer or a list of 0/1")
    mlp_only = text.get("mlp_only_layers") or ()  # Qwen2/3-MoE
    if not isinstance(mlp_only, (list, tuple)) or not all(isinstance(i, int) for i in mlp_only):
        raise _unsupported("mlp_only_layers", mlp_only, "mlp_only_layers a list of layer indices")
    mlp_only = set(mlp_only)
    sparse_step = _positive_or_absent(text, "decoder_sparse_step")  # Qwen2/3-MoE
    interleave = _positive_or_absent(text, "interleave_moe_layer_step")  # Llama-4
    count = 0
    for i in range(total):
        if i < first_dense or i in mlp_only:
            continue
        if isinstance(freq, list):
            if i >= len(freq) or not freq[i]:
                continue
        elif isinstance(freq, int) and freq > 1 and i % freq:
            continue
        if (i + 1) % sparse_step or (i + 1) % interleave:
            continue
        count += 1
    if count < 1:
        raise ValueError(
            f"config schedules no MoE layer among its {total} layers (first_k_dense_replace="
            f"{first_dense}, moe_layer_freq={freq!r}, mlp_only_layers={sorted(mlp_only)}, "
            f"decoder_sparse_step={sparse_step}, interleave_moe_layer_step={interleave})"
        )
    return count


def _positive_or_absent(text: dict, key: str) -> int:
    """A layer step of the config: absent or null is 1; 0, a negative or a non-integer is refused
    (it was read as 1 silently)."""
    value = text.get(key)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _unsupported(key, value, f"{key} a positive integer")
    return value


def _check_groups(routing: RoutingConfig, num_experts: int) -> None:
    """n_group must divide the experts (topk_group is checked against n_group before, _kept_groups):
    route() would refuse it at the first forward, far from the config that said so."""
    groups = routing.num_groups
    if groups is None:
        return
    if num_experts % groups:  # (a positive integer: _kept_groups, RoutingConfig)
        raise _unsupported("n_group", groups, f"n_group a divisor of the number of experts ({num_experts})")


def _kept_groups(groups: int | None, kept: int | None) -> int | None:
    """topk_group, checked with n_group before the RoutingConfig is made (which would refuse them
    too, but naming its own fields, not the config.json keys)."""
    if groups is None or kept is None:
        return kept
    if groups < 1:
        raise _unsupported("n_group", groups, "n_group a positive integer")
    if not 1 <= kept <= groups:
        raise _unsupported("topk_group", kept, f"topk_group between 1 and n_group ({groups})")
    return kept


def _shared_experts(text: dict, family: str) -> int:
    n = _get_int(text, ("n_shared_experts", "num_shared_experts"))
    if n is not None:
        return max(n, 0)
    if (_get_int(text, ("shared_expert_intermediate_size",)) or 0) > 0:  # Qwen2-MoE
        return 1
    if family == "llama4":  # every Llama-4 MoE block has one (a text_config may not name its type)
        return 1
    return 0


def _routing(text: dict, model_type: str, top_k: int) -> RoutingConfig:
    if model_type == "llama4":
        return RoutingConfig(top_k=top_k, scoring="sigmoid", renormalize=False, apply_on_input=True)
    if model_type == "mixtral":
        return RoutingConfig(top_k=top_k, scoring="softmax", renormalize=True)
    if model_type in _QWEN_FAMILIES or model_type == "olmoe":
        # transformers' default for all three is norm_topk_prob=False; Qwen3 configs set it true
        renormalize = _flag(text, "norm_topk_prob", False)
        return RoutingConfig(top_k=top_k, scoring="softmax", renormalize=renormalize)
    if model_type in _GLM_FAMILIES:
        # Glm4MoE routes like DeepSeek-V3's noaux_tc: sigmoid, e_score_correction_bias, groups
        groups = _get_int(text, ("n_group",)) or 1
        return RoutingConfig(
            top_k=top_k,
            scoring="sigmoid",
            renormalize=_flag(text, "norm_topk_prob", True),
            num_groups=groups,
            topk_groups=_kept_groups(groups, _get_int(text, ("topk_group",)) or 1),
            use_correction_bias=True,
            routed_scaling_factor=_scale(text, 1.8 if model_type == "glm4_moe_lite" else 1.0),
        )
    if model_type in _DEEPSEEK_FAMILIES:
        v2 = model_type == "deepseek_v2"
        scoring = text.get("scoring_func", "softmax" if v2 else "sigmoid")
        if scoring not in ("softmax", "sigmoid"):
            raise _unsupported("scoring_func", scoring, "scoring_func 'softmax' or 'sigmoid'")
        method = text.get("topk_method", "greedy" if v2 else "noaux_tc")
        if method not in ("greedy", "noaux_tc"):
            # DeepSeek-V2's group_limited_greedy scores a group by its best expert; moekit's
            # grouped top-k scores it by its best two (noaux_tc)
            raise _unsupported("topk_method", method, "topk_method 'greedy' or 'noaux_tc'")
        _check_noaux(method, scoring)
        # absent fields take transformers' DeepseekV3Config defaults (8 groups, 4 kept, 2.5)
        v3 = model_type == "deepseek_v3"
        groups = _get_int(text, ("n_group",)) or (8 if v3 and "n_group" not in text else None)
        kept = _get_int(text, ("topk_group",)) or (4 if v3 and "topk_group" not in text else None)
        if method == "greedy" or groups is None or kept is None:
            groups = kept = None
        return RoutingConfig(
            top_k=top_k,
            scoring=scoring,
            renormalize=_flag(text, "norm_topk_prob", not v2),
            num_groups=groups,
            topk_groups=_kept_groups(groups, kept),
            use_correction_bias=method == "noaux_tc",
            routed_scaling_factor=_scale(text, 2.5 if model_type == "deepseek_v3" else 1.0),
        )
    # Generic: softmax unless the config says otherwise; another scoring function is refused (as
    # in the DeepSeek branch), never computed as softmax
    scoring = text.get("scoring_func", "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise _unsupported("scoring_func", scoring, "scoring_func 'softmax' or 'sigmoid'")
    method = text.get("topk_method")
    if method not in (None, "greedy", "noaux_tc"):
        raise _unsupported("topk_method", method, "topk_method 'greedy' or 'noaux_tc'")
    _check_noaux(method, scoring)
    groups, kept = _get_int(text, ("n_group",)), _get_int(text, ("topk_group",))
    if method == "greedy" or groups is None or kept is None:
        groups = kept = None
    return RoutingConfig(
        top_k=top_k,
        scoring=scoring,
        renormalize=_flag(text, "norm_topk_prob", True),
        num_groups=groups,
        topk_groups=_kept_groups(groups, kept),
        use_correction_bias=method == "noaux_tc",
        routed_scaling_factor=_scale(text),
    )


def _check_noaux(method, scoring: str) -> None:
    """noaux_tc (the correction bias, groups scored by their two best) is a sigmoid rule in
    DeepSeek's and transformers' code; with softmax no model computes it."""
    if method == "noaux_tc" and scoring != "sigmoid":
        raise _unsupported("scoring_func", scoring, "scoring_func 'sigmoid' with topk_method 'noaux_tc'")


def _flag(text: dict, key: str, default: bool) -> bool:
    """A boolean of the config: absent or null gives `default`; anything but true / false (a
    string "true", 1) is refused rather than guessed."""
    value = text.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _unsupported(key, value, f"{key} true or false")
    return value


def _scale(text: dict, default: float = 1.0) -> float:
    """routed_scaling_factor: absent or null gives `default` (the family's transformers default);
    anything but a positive finite number is refused (it was read as 1.0 silently)."""
    value = text.get("routed_scaling_factor")
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise _unsupported("routed_scaling_factor", value, "routed_scaling_factor a positive number")
    return float(value)


def _name(config: dict, folder_name: str | None, model_type: str) -> tuple[str, str | None]:
    """(preset-like name, hf_id): from _name_or_path, else the folder name, else model_type."""
    origin = config.get("_name_or_path")
    hf_id = None
    if isinstance(origin, str) and origin.strip().strip("/"):
        origin = origin.strip().rstrip("/")
        looks_like_repo = origin.count("/") == 1 and not origin.startswith((".", "~"))
        if looks_like_repo and not os.path.isabs(origin):
            hf_id = origin
            for preset in PRESETS.values():
                if preset.hf_id and preset.hf_id.lower() == origin.lower():
                    return preset.name, hf_id
        return origin.rsplit("/", 1)[-1].lower(), hf_id
    if folder_name:
        return folder_name.lower(), None
    return model_type, None


# --------------------------------------------------------------------------------------------
# quantization_config parsing
# --------------------------------------------------------------------------------------------

_SUPPORTED_METHODS = ("compressed-tensors", "fp8", "fbgemm_fp8")
_Q = "quantization_config"
_SUPPORTED_CT = (
    "weights strategy tensor + input_activations strategy tensor (static or dynamic); "
    "weights channel + input_activations token, dynamic; "
    f"weights block [{BLOCK}, {BLOCK}] + input_activations group (group_size {BLOCK}), dynamic"
)
# weights strategy -> {(activation strategy, dynamic): scheme}
_CT_SCHEMES: dict[str, dict[tuple[str, bool], QuantScheme]] = {
    "tensor": {("tensor", False): FP8_TENSOR_STATIC, ("tensor", True): FP8_TENSOR_DYNAMIC},
    "channel": {("token", True): FP8_CHANNEL_TOKEN},
    "block": {("group", True): FP8_BLOCK128},
}


def _unsupported(path: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"{path}: {value!r} is not supported; moekit supports {supported}")


def parse_quantization_config(quant: Any, experts: tuple[str, ...] | list[str] | None = None) -> QuantScheme:
    """The moekit scheme of a config.json `quantization_config` (None or {}: bf16).

    `experts`: the checkpoint names of one experts module's projections (e.g.
    `model.layers.0.mlp.experts.3.gate_proj`): the scheme of that module, as the config's entries
    that name it say. None: the scheme of the model's routed experts, those the config does not
    name one by one (an `ignore` entry naming one layer's experts leaves the others quantized).
    The config alone does not say which modules the model has, so an `ignore` list naming every
    expert projection one by one still reads as the groups' scheme here; moekit.hf reads each
    module by the checkpoint's own expert names (hf/load.py `_checkpoint_schemes`), which can tell."""
    if quant is None or quant == {}:
        return BF16
    if not isinstance(quant, dict):
        raise _unsupported(_Q, quant, "an object with a quant_method")
    names = tuple(experts) if experts is not None else _EXPERT_MODULES
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        return _parse_compressed_tensors(quant, experts)
    if method == "fp8":
        if _skips_experts(quant, ("modules_to_not_convert", "ignored_layers"), names):
            return BF16
        return _parse_fp8(quant)
    if method == "fbgemm_fp8":  # FP8 per-channel weights, dynamic per-token activations
        # (its activation_scale_ub caps a row's amax at the bound; moekit takes the row's own
        # amax, as finely as the row allows: README, Quantization schemes)
        if _skips_experts(quant, ("modules_to_not_convert",), names):
            return BF16
        return FP8_CHANNEL_TOKEN
    supported = "quant_method " + ", ".join(_SUPPORTED_METHODS)
    raise _unsupported(f"{_Q}.quant_method", method, supported)


# Module names of routed experts as checkpoints write them (one per family layout): what the
# skip lists of quant_method fp8 / fbgemm_fp8 are matched against for the model as a whole.
_EXPERT_MODULES = (
    "model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.experts.0.down_proj",
    "model.layers.1.block_sparse_moe.experts.0.w1", "model.layers.1.block_sparse_moe.experts.0.w2",
    "model.layers.1.feed_forward.experts.0.gate_proj", "model.layers.1.feed_forward.experts.0.down_proj",
    "language_model.model.layers.1.feed_forward.experts.0.gate_proj",
    "model.language_model.layers.1.mlp.experts.0.gate_proj",
)


def _skips_experts(quant: dict, keys: tuple[str, ...], names: tuple[str, ...]) -> bool:
    """Whether a skip list of quant_method fp8 / fbgemm_fp8 names these expert projections
    (transformers matches its entries as substrings of module names): then they are not FP8."""
    for key in keys:
        entries = quant.get(key) or ()
        if not isinstance(entries, (list, tuple)):
            raise _unsupported(f"{_Q}.{key}", entries, f"{key} a list of module names")
        if any(isinstance(e, str) and e and any(e in name for name in names) for e in entries):
            return True
    return False


def _ct_matches(entry, name: str) -> bool:
    """compressed-tensors' rule for a target or ignore entry (compressed_tensors.utils.match:
    match_name and _match_class): "re:<regex>" matched from the start of the module name, a class
    name ("Linear": every expert projection is one), else the module's own name, exactly (a name
    is one module: one layer's experts named in `ignore` are only that layer's)."""
    if not isinstance(entry, str):
        return False
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry in ("Linear", name)


def _ct_matcher(entries):
    """_ct_matches of any of `entries`, as one test: names in a set, regexes compiled once (an
    ignore list may name every expert projection of a model: tens of thousands of names)."""
    entries = [e for e in entries if isinstance(e, str)] if isinstance(entries, (list, tuple)) else []
    exact = set(entries)
    patterns = [re.compile(e[3:]) for e in entries if e.startswith("re:")]
    return lambda name: "Linear" in exact or name in exact or any(p.match(name) for p in patterns)


# compressed-tensors for the model as a whole: sample expert projections of each layout, at
# layers and indices no model has all of (layer 93, expert 255), so that only patterns ("re:",
# "Linear") match every sample of a layout, never a list of single modules' names. Without the
# model's own module names this cannot tell a list naming every expert (all bf16) from one naming
# some (the others FP8): it answers for the patterns only (parse_config's ModelSpec, the CLI's
# --model config.json), and moekit.hf, which has the names, does not use it.
_SAMPLED_EXPERTS = tuple(
    tuple(f"{layout}.layers.{layer}.{block}.experts.{e}.{proj}" for layer in (0, 1, 9, 93) for e in (0, 5, 255)
          for proj in projections)
    for layout, block, projections in (
        ("model", "mlp", ("gate_proj", "up_proj", "down_proj")),
        ("model", "block_sparse_moe", ("w1", "w3", "w2")),
        ("model", "feed_forward", ("gate_proj", "up_proj", "down_proj")),
        ("language_model.model", "feed_forward", ("gate_proj", "up_proj", "down_proj")),
        ("model.language_model", "mlp", ("gate_proj", "up_proj", "down_proj")),
    )
)
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _targets_experts(entries) -> bool:
    """Whether a config group's targets reach any routed expert: a pattern or class matching a
    sample, or the name of one expert projection."""
    return isinstance(entries, (list, tuple)) and any(
        any(_ct_matches(e, n) for layout in _SAMPLED_EXPERTS for n in layout)
        or (isinstance(e, str) and not e.startswith("re:") and ".experts." in e and e.rsplit(".", 1)[-1] in _PROJECTIONS)
        for e in entries)


def _ignores_every_expert(entries) -> bool:
    """Whether an ignore list leaves every routed expert unquantized: its entries match every
    sample of one layout (names of single experts modules never do)."""
    ignored = _ct_matcher(entries)
    return any(all(ignored(n) for n in layout) for layout in _SAMPLED_EXPERTS)


def _parse_fp8(quant: dict) -> QuantScheme:
    """quant_method "fp8": DeepSeek-style block scales, or per-tensor scales (AutoFP8)."""
    fmt = quant.get("fmt")
    if fmt is not None and fmt != "e4m3":
        raise _unsupported(f"{_Q}.fmt", fmt, "fmt 'e4m3'")
    scale_fmt = quant.get("scale_fmt")  # DeepSeek-V3.1: "ue8m0" (README, Quantization schemes)
    if scale_fmt not in (None, "ue8m0"):
        raise _unsupported(f"{_Q}.scale_fmt", scale_fmt, "scale_fmt 'ue8m0' or none")
    act = quant.get("activation_scheme")
    block = quant.get("weight_block_size")
    if block is not None:
        if not isinstance(block, (list, tuple)) or list(block) != [BLOCK, BLOCK]:
            raise _unsupported(
                f"{_Q}.weight_block_size", block, f"weight_block_size [{BLOCK}, {BLOCK}]"
            )
        if act != "dynamic":
            raise _unsupported(
                f"{_Q}.activation_scheme", act,
                f"activation_scheme 'dynamic' with weight_block_size [{BLOCK}, {BLOCK}]",
            )
        return FP8_BLOCK128
    if act == "static":
        return FP8_TENSOR_STATIC
    if act == "dynamic":
        return FP8_TENSOR_DYNAMIC
    raise _unsupported(f"{_Q}.activation_scheme", act, "activation_scheme 'static' or 'dynamic'")


_CT_FORMATS = ("float-quantized", "naive-quantized")


def _parse_compressed_tensors(quant: dict, experts: tuple[str, ...] | list[str] | None) -> QuantScheme:
    """The scheme of the config groups that target the routed experts (`experts`: these expert
    projections); bf16 where none does (an FP8 KV cache or attention alone) or `ignore` names them.
    Groups of other layers are not read: moekit runs only the experts."""
    groups = quant.get("config_groups")
    path = f"{_Q}.config_groups"
    if groups is None:
        groups = {}
    if not isinstance(groups, dict):
        raise _unsupported(path, groups, "a config_groups object")
    ignore = quant.get("ignore")
    if experts is None:
        if _ignores_every_expert(ignore):
            return BF16  # quantized elsewhere, the experts left in bf16
        covering = {name: g for name, g in groups.items()
                    if not isinstance(g, dict) or _targets_experts(g.get("targets", ["Linear"]))}
    else:
        is_ignored = _ct_matcher(ignore)
        ignored = [n for n in experts if is_ignored(n)]
        if ignored and len(ignored) < len(experts):
            kept = next(n for n in experts if n not in ignored)
            raise ValueError(f"{_Q}.ignore names {ignored[0]} but not {kept}: moekit runs one scheme for every "
                             "expert of a layer")
        if ignored:
            return BF16
        covering = {name: g for name, g in groups.items() if not isinstance(g, dict)
                    or any(_ct_matches(t, n) for t in g.get("targets", ["Linear"]) for n in experts)}
    if not covering:
        return BF16
    fmt = quant.get("format")
    if fmt is not None and fmt not in _CT_FORMATS:
        raise _unsupported(f"{_Q}.format", fmt, "format 'float-quantized' (FP8 weights stored as FP8)")
    schemes = {name: _parse_ct_group(group, f"{path}.{name}") for name, group in covering.items()}
    distinct = set(schemes.values())
    if len(distinct) > 1:
        found = ", ".join(f"{name}: {scheme}" for name, scheme in schemes.items())
        raise ValueError(
            f"{path}: the groups that target the experts use different schemes ({found}); moekit runs "
            "one scheme for every expert"
        )
    return distinct.pop()


def _parse_ct_group(group: Any, path: str) -> QuantScheme:
    if not isinstance(group, dict):
        raise _unsupported(path, group, "a config group object")
    fmt = group.get("format")
    if fmt is not None and fmt not in _CT_FORMATS:
        raise _unsupported(f"{path}.format", fmt, "format 'float-quantized' (FP8 weights stored as FP8)")
    weights = group.get("weights")
    wpath = f"{path}.weights"
    if not isinstance(weights, dict):
        raise _unsupported(wpath, weights, "FP8 weights (type float, num_bits 8)")
    _check_fp8_args(weights, wpath)
    wstrategy = weights.get("strategy")
    if wstrategy not in _CT_SCHEMES:
        raise _unsupported(
            f"{wpath}.strategy", wstrategy, "weights strategy tensor, channel, block"
        )
    if wstrategy == "block":
        structure = weights.get("block_structure")
        if not isinstance(structure, (list, tuple)) or list(structure) != [BLOCK, BLOCK]:
            raise _unsupported(
                f"{wpath}.block_structure", structure, f"block_structure [{BLOCK}, {BLOCK}]"
            )

    acts = group.get("input_activations")
    apath = f"{path}.input_activations"
    if not isinstance(acts, dict):
        raise _unsupported(
            apath, acts,
            "FP8 activations (W8A8); weight-only quantization has no moekit scheme: "
            + _SUPPORTED_CT,
        )
    _check_fp8_args(acts, apath)
    astrategy = acts.get("strategy")
    dynamic = acts.get("dynamic")
    if not isinstance(dynamic, bool):
        raise _unsupported(f"{apath}.dynamic", dynamic, "dynamic true or false")
    allowed = _CT_SCHEMES[wstrategy]
    if astrategy not in {strategy for strategy, _ in allowed}:
        wanted = " or ".join(sorted({repr(s) for s, _ in allowed}))
        raise _unsupported(
            f"{apath}.strategy", astrategy,
            f"input_activations strategy {wanted} with weights strategy {wstrategy!r} "
            f"({_SUPPORTED_CT})",
        )
    if (astrategy, dynamic) not in allowed:
        wanted = " or ".join(sorted({repr(d) for s, d in allowed if s == astrategy}))
        raise _unsupported(
            f"{apath}.dynamic", dynamic,
            f"dynamic {wanted} for weights {wstrategy!r} + activations {astrategy!r} "
            f"({_SUPPORTED_CT})",
        )
    if astrategy == "group" and acts.get("group_size") != BLOCK:
        raise _unsupported(f"{apath}.group_size", acts.get("group_size"), f"group_size {BLOCK}")
    return allowed[(astrategy, dynamic)]


def _check_fp8_args(args: dict, path: str) -> None:
    if args.get("type") != "float":
        raise _unsupported(f"{path}.type", args.get("type"), "type 'float' (FP8)")
    if args.get("symmetric", True) is not True:  # zero points: no moekit kernel takes them
        raise _unsupported(f"{path}.symmetric", args.get("symmetric"), "symmetric true (no zero points)")
    if args.get("num_bits") != 8:
        raise _unsupported(f"{path}.num_bits", args.get("num_bits"), "num_bits 8 (FP8 e4m3)")
