"""What an MoE layer is: its shape (`MoEShape`) and how its numbers are stored (`QuantScheme`).

Dimension letters used across moekit:
    M = tokens in the batch, E = experts, K = top-k experts per token,
    H = hidden size, N = intermediate size per expert on this GPU (intermediate / tp).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
BLOCK = 128  # edge of the weight blocks and activation groups of the block scheme

Granularity = Literal["tensor", "channel", "block", "token", "group"]


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """Sizes of one MoE layer. `intermediate` is the whole model's size; `n` is this GPU's share."""

    num_experts: int
    hidden: int
    intermediate: int
    top_k: int
    tp: int = 1
    num_layers: int = 1  # MoE layers in the whole model, for whole-model estimates
    shared_experts: int = 0  # informational: moekit runs the routed experts only

    def __post_init__(self):
        for field in ("num_experts", "hidden", "intermediate", "top_k", "tp", "num_layers"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEShape.{field} must be a positive integer, got {value!r}")
        if self.shared_experts < 0:
            raise ValueError(f"MoEShape.shared_experts must be >= 0, got {self.shared_experts!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEShape.top_k ({self.top_k}) cannot exceed num_experts ({self.num_experts})")
        if self.intermediate % self.tp:
            raise ValueError(
                f"MoEShape.intermediate ({self.intermediate}) is not divisible by tp ({self.tp})"
            )

    @property
    def n(self) -> int:
        """Intermediate size per expert on one GPU."""
        return self.intermediate // self.tp

    def with_tp(self, tp: int) -> "MoEShape":
        return dataclasses.replace(self, tp=tp)

    def describe(self) -> str:
        return f"E={self.num_experts} H={self.hidden} N={self.n} top{self.top_k}" + (
            f" (intermediate {self.intermediate}, tp{self.tp})" if self.tp > 1 else ""
        )


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How weights and activations are quantized. A scheme is a value; compare schemes with ==.

    weight: "tensor" (one scale per expert matrix), "channel" (one per output row) or
        "block" (one per 128x128 block); None for unquantized weights.
    activation: "tensor" (one scale), "token" (one per row) or "group" (one per 1x128 group);
        None for unquantized activations.
    static_activation: activation scales come from the checkpoint rather than each call.
    cast_dtype: the unquantized scheme only, "bf16" or "fp16": the dtype quantize_weights casts
        float32 weights to. Not part of == or hash (see FP16).
    """

    name: str
    weight: Granularity | None
    activation: Granularity | None
    static_activation: bool = False
    cast_dtype: Literal["bf16", "fp16"] | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def is_fp8(self) -> bool:
        return self.weight is not None

    @property
    def block(self) -> int | None:
        return BLOCK if self.weight == "block" else None

    def __str__(self) -> str:
        return self.name


BF16 = QuantScheme("bf16", None, None, cast_dtype="bf16")
# "fp16" is the unquantized scheme asked for in float16, not a scheme of its own: the weights' dtype
# says bf16 or fp16, and tables (file names scheme=bf16, "a bf16 table answers for fp16 too"), check's
# thresholds and the checkpoint loaders' scheme comparisons know one unquantized scheme, by the name
# "bf16". So FP16 is equal to BF16 (same name, same rules, ==, same hash) and differs only in
# cast_dtype, which quantize_weights reads: SCHEMES["fp16"] / get_scheme("fp16") had been BF16
# itself, and quantize_weights(w13, w2, SCHEMES["fp16"]) made bf16 weights where "fp16" made fp16.
# A scheme named "fp16" would have split those tables and comparisons in two.
FP16 = dataclasses.replace(BF16, cast_dtype="fp16")
FP8_TENSOR_STATIC = QuantScheme("fp8-tensor-static", "tensor", "tensor", static_activation=True)
FP8_TENSOR_DYNAMIC = QuantScheme("fp8-tensor-dynamic", "tensor", "tensor")
FP8_CHANNEL_TOKEN = QuantScheme("fp8-channel-token", "channel", "token")
FP8_BLOCK128 = QuantScheme("fp8-block128", "block", "group")

SCHEMES: dict[str, QuantScheme] = {
    s.name: s for s in (BF16, FP8_TENSOR_STATIC, FP8_TENSOR_DYNAMIC, FP8_CHANNEL_TOKEN, FP8_BLOCK128)
}
SCHEMES["fp16"] = FP16  # the unquantized scheme, asked for in fp16 (see FP16)


def get_scheme(scheme: str | QuantScheme) -> QuantScheme:
    """The scheme named `scheme` (or `scheme` itself); unknown names list the valid ones."""
    if isinstance(scheme, QuantScheme):
        return scheme
    try:
        return SCHEMES[scheme]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown quantization scheme {scheme!r}; expected one of: {', '.join(SCHEMES)}"
        ) from None
