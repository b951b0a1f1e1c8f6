"""What moekit needs to know about each transformers MoE family, in one table.

For every family: the transformers class that holds the routed experts (replaced by moekit at
load time), how its weights are laid out, and what the per-expert checkpoint tensors are called.

Layouts of the experts module in transformers v5:
    "concat"      gate_up_proj [E, 2N, H] (gate rows, then up rows), down_proj [E, H, N]:
                  moekit's own layout (w13, w2); Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GLM-4.5(V).
    "transposed"  gate_up_proj [E, H, 2N] (gate columns, then up columns), down_proj [E, N, H]:
                  Llama-4, whose experts module is not dispatched through transformers'
                  ExpertsInterface and whose router weight multiplies the expert's INPUT.
Per-expert checkpoint tensors (the format of the original checkpoints, of compressed-tensors
FP8 checkpoints and of what transformers v5 itself saves) are Linear weights [out, in]:
    {experts}.{e}.{gate}.weight [N, H], {experts}.{e}.{up}.weight [N, H], {experts}.{e}.{down}.weight [H, N]
with (gate, up, down) = (w1, w3, w2) for Mixtral and (gate_proj, up_proj, down_proj) elsewhere.
"""

from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Family:
    """One transformers MoE family.

    model_types: config.model_type values (top level and text sub-config) of the family.
    module: the transformers modeling module, e.g. "transformers.models.mixtral.modeling_mixtral".
    experts_class: the class holding the routed experts' weights.
    block_class: for families whose MoE block itself must change (Llama-4: the router weight
        multiplies the input), the block class moekit replaces; None otherwise.
    router_class: the class of the family's router (what `routers.fuse_routers` can run through
        `moekit.route`).
    projections: checkpoint names of the (gate, up, down) projections of one expert.
    transposed: the experts module stores gate_up_proj [E, H, 2N] and down_proj [E, N, H].
    apply_on_input: the router weight multiplies the expert's input (Llama-4).
    """

    name: str
    model_types: tuple[str, ...]
    module: str
    experts_class: str
    block_class: str | None = None
    router_class: str | None = None
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    transposed: bool = False
    apply_on_input: bool = False

    def modeling_module(self):
        return importlib.import_module(self.module)

    def original_class(self, name: str):
        """The transformers class `name` of this family (not a replacement registered for it)."""
        key = (self.module, name)
        if key not in _ORIGINALS:  # resolved before moekit registers any replacement for it
            _ORIGINALS[key] = getattr(self.modeling_module(), name)
        return _ORIGINALS[key]

    @property
    def patched_class(self) -> str:
        """The class moekit replaces at load time: the block for Llama-4, else the experts."""
        return self.block_class or self.experts_class


_ORIGINALS: dict[tuple[str, str], type] = {}

_TM = "transformers.models"
FAMILIES: tuple[Family, ...] = (
    Family("mixtral", ("mixtral",), f"{_TM}.mixtral.modeling_mixtral", "MixtralExperts",
           router_class="MixtralTopKRouter", projections=("w1", "w3", "w2")),
    Family("qwen2_moe", ("qwen2_moe",), f"{_TM}.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeExperts",
           router_class="Qwen2MoeTopKRouter"),
    Family("qwen3_moe", ("qwen3_moe",), f"{_TM}.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts",
           router_class="Qwen3MoeTopKRouter"),
    Family("olmoe", ("olmoe",), f"{_TM}.olmoe.modeling_olmoe", "OlmoeExperts", router_class="OlmoeTopKRouter"),
    Family("deepseek_v3", ("deepseek_v3",), f"{_TM}.deepseek_v3.modeling_deepseek_v3", "DeepseekV3Experts",
           router_class="DeepseekV3TopkRouter"),
    Family("glm4_moe", ("glm4_moe",), f"{_TM}.glm4_moe.modeling_glm4_moe", "Glm4MoeExperts",
           router_class="Glm4MoeTopkRouter"),
    Family("glm4v_moe", ("glm4v_moe", "glm4v_moe_text"), f"{_TM}.glm4v_moe.modeling_glm4v_moe",
           "Glm4vMoeTextExperts", router_class="Glm4vMoeTextTopkRouter"),
    Family("llama4", ("llama4", "llama4_text"), f"{_TM}.llama4.modeling_llama4", "Llama4TextExperts",
           block_class="Llama4TextMoe", router_class="Llama4Router", transposed=True, apply_on_input=True),
)


def supported_model_types() -> list[str]:
    return [t for f in FAMILIES for t in f.model_types]


def family_of(model_type: str | None) -> Family | None:
    for f in FAMILIES:
        if model_type in f.model_types:
            return f
    return None


def family_of_config(config) -> Family:
    """The family of a transformers config (or its text sub-config); a clear error otherwise."""
    candidates = [getattr(config, "model_type", None)]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        candidates.append(getattr(get_text(), "model_type", None))
    for model_type in candidates:
        family = family_of(model_type)
        if family is not None:
            return family
    raise UnsupportedModelError(
        f"model_type {candidates[0]!r} has no fused experts moekit can run; moekit supports "
        f"the MoE families {', '.join(supported_model_types())}"
    )


def family_of_module(module) -> Family | None:
    """The family whose experts (or, for Llama-4, MoE block) class `module` is an instance of."""
    cls_name = type(module).__name__
    for f in FAMILIES:
        if cls_name not in (f.experts_class, f.block_class):
            continue
        try:
            if isinstance(module, f.original_class(cls_name)):
                return f
        except (ImportError, AttributeError):  # a transformers without this family
            continue
    return None


class UnsupportedModelError(ValueError):
    """The model, its quantization or its checkpoint is something moekit cannot run."""
