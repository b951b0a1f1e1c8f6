"""moekit as the experts of a transformers v5 model.

Two ways in, one computation (`run_experts` -> `moekit.fused_moe`):

1. `experts_implementation="moekit"` (registered in transformers' `ExpertsInterface` when
   `moekit.hf` is imported): transformers' own experts modules (bf16/fp16 `gate_up_proj`
   [E, 2N, H] and `down_proj` [E, H, N]) run through moekit; nothing else of the model changes.
   `moekit_experts_forward` wraps the module's parameters in a `MoEWeights` without copying them.
2. `MoekitExperts`: the module `moekit.hf.from_pretrained` / `patch_model` put in place of a
   family's experts. It holds moekit's layout as buffers (w13, w2, scales; FP8 stays FP8) and
   always runs through moekit, whatever the config's experts_implementation says: FP8 weights
   have no other implementation to fall back to.

What transformers hands an experts module (every family of `families.py` except Llama-4):
hidden_states [T, H] in the model's dtype, top_k_index [T, K] int64, top_k_weights [T, K] float32
(Mixtral, DeepSeek-V3, GLM-4.5) or the model's dtype (Qwen2/3-MoE, OLMoE). Weights of shape
[T, E] (a dense score per expert) are also accepted and gathered at top_k_index (with top-k = E
the shapes agree: read as [T, K]).

Inference only: gradients do not flow through moekit's kernels.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .. import env
from ..api import fused_moe
from ..handles import HandleOwner
from ..layer import apply_keeping_dtypes
from ..select import ENV_VAR, select_backend
from ..spec import BF16, BLOCK, FP8_BLOCK128
from ..weights import TENSOR_FIELDS, FollowsWeights, MoEWeights

log = logging.getLogger("moekit.hf")

IMPLEMENTATION = "moekit"


class ExpertsError(ValueError):
    """An experts module moekit cannot run, named with the reason."""


# ----------------------------------------------------------------------------------- running


def _per_token(t: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """t as [T, -1]; with no tokens [0, t.shape[-1]] (reshape cannot infer -1 from 0 elements)."""
    return t.reshape(num_tokens, -1) if num_tokens else t.reshape(0, t.shape[-1])


def _routing(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_tokens: int, label: str):
    """(ids [T, K], weights [T, K]) from what the MoE block passed. Weights [T, E] (a dense score
    per expert) are gathered at the ids; where K == E the two shapes agree, and weights are read
    as [T, K], in the ids' order (what every transformers family passes)."""
    ids = _per_token(top_k_index, num_tokens)
    weights = _per_token(top_k_weights, num_tokens)
    if weights.shape != ids.shape:
        if weights.shape[1] > ids.shape[1]:  # a dense [T, E] score matrix
            # gathered at clamped ids: an id out of range still reaches fused_moe's check, and its
            # message, rather than failing inside gather (a bare device assertion on a GPU)
            weights = weights.gather(1, ids.long().clamp(0, weights.shape[1] - 1))
        else:
            raise ExpertsError(
                f"{label}: top_k_weights {tuple(top_k_weights.shape)} does not match "
                f"top_k_index {tuple(top_k_index.shape)}"
            )
    return ids, weights


def run_experts(
    module: nn.Module,
    weights: MoEWeights,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    backend: str | None = "auto",
    apply_on_input: bool = False,
    label: str = "experts",
) -> torch.Tensor:
    """The routed experts of one layer through moekit.fused_moe; returns hidden_states' shape.
    Auto never picks a backend that would keep a converted (dequantized) copy of the experts
    (allow_weight_copies=False): FP8 experts stay FP8 unless a backend is named explicitly."""
    shape = hidden_states.shape
    if hidden_states.dtype not in (torch.bfloat16, torch.float16, torch.float32):  # model.double(): named here
        raise ExpertsError(f"{label}: hidden states are {hidden_states.dtype}; moekit's experts take bfloat16, "
                           "float16 or float32 activations (model.bfloat16(), .half() or .float())")
    x = hidden_states.reshape(-1, shape[-1])
    ids, w = _routing(top_k_index, top_k_weights, x.shape[0], label)
    _note_backend(module, weights, x, ids.shape[1], backend, label)
    if not apply_on_input:
        out = fused_moe(x, weights, w, ids, backend=backend, allow_weight_copies=False)
    elif ids.shape[1] == 1:
        out = fused_moe(x, weights, w, ids, backend=backend, apply_router_weight_on_input=True,
                        allow_weight_copies=False)
    else:  # weight on the input with top-k > 1: one top-1 call per slot, summed in float32
        out = None
        for j in range(ids.shape[1]):
            part = fused_moe(x, weights, w[:, j : j + 1], ids[:, j : j + 1], backend=backend,
                             apply_router_weight_on_input=True, allow_weight_copies=False).float()
            out = part if out is None else out + part
        out = (out if out is not None else x.float() * 0).to(x.dtype)
    return out.reshape(shape)


def _note_backend(module, weights: MoEWeights, x, top_k, backend, label) -> None:
    """Once per module and request: check the backend can run (a clear error if it cannot),
    and say so when FP8 experts are about to run as a dequantized bf16 copy (`torch`). Only a
    named backend (the argument, set_backend, MOEKIT_BACKEND) gets there: with
    allow_weight_copies=False auto passes over `torch` for FP8 weights, so this is info, the
    user's own choice, not a warning."""
    key = (backend, env.raw(ENV_VAR), x.device, x.dtype, weights.scheme.name)
    seen = module.__dict__.setdefault("_moekit_checked", set())
    if key in seen:
        return
    choice = select_backend(weights.shape(top_k), weights.scheme, x.device, x.dtype, max(x.shape[0], 1), backend,
                            allow_weight_copies=False)
    if weights.scheme.is_fp8 and choice.backend == "torch":
        log.info("%s: FP8 experts (%s) run on the `torch` backend (%s), which keeps a dequantized %s copy of the "
                 "experts and does not quantize activations; the FP8 kernels are the `triton`/`cutlass` backends "
                 "on a GPU, the FP8-exact CPU path is `reference`", label, weights.scheme.name, choice.detail,
                 x.dtype)
    else:
        log.debug("%s: moekit backend %s", label, choice)
    seen.add(key)


# ------------------------------------------------------------------- transformers' own modules


def _is_silu(act) -> bool:
    """SiLU as a module (nn.SiLU, transformers' SiLUActivation) or as the function itself
    (LFM2-MoE's act_fn = F.silu)."""
    return (act is torch.nn.functional.silu or isinstance(act, nn.SiLU)
            or type(act).__name__ in ("SiLU", "SiLUActivation"))


# The attributes that change FP8Experts._apply_gate away from SiLU(gate) * up (transformers 5.25).
FP8_GATE_KNOBS = ("gate_softcap", "up_softcap", "swiglu_alpha", "limit")


def fp8_experts_class() -> type | None:
    """transformers' own FP8Experts (quant_method "fp8" kept in FP8 on a GPU), or None for a
    transformers without it."""
    try:
        from transformers.integrations.finegrained_fp8 import FP8Experts
    except ImportError:  # pragma: no cover - a transformers without FP8 experts
        return None
    return FP8Experts


def _fp8_experts_gate():
    """FP8Experts._apply_gate (the function), or None where it does not exist."""
    return getattr(fp8_experts_class(), "_apply_gate", None)


def check_hf_experts(module: nn.Module, label: str | None = None) -> None:
    """Raise ExpertsError unless this transformers experts module is one moekit computes
    exactly: SiLU(gate) * up, gate and up concatenated, no bias, no post-expert norm."""
    label = label or type(module).__name__
    problems = []
    if getattr(module, "has_bias", False):
        problems.append("its experts have biases")
    if not getattr(module, "has_gate", True):
        problems.append("its experts have no gate projection")
    if not getattr(module, "is_concatenated", True):
        problems.append("gate and up rows are interleaved, not concatenated")
    if getattr(module, "is_transposed", False):
        # the one transposed family moekit runs is Llama-4, whose block patch_model replaces
        problems.append("its weights are transposed ([E, H, 2N]), a layout moekit runs only for Llama-4's "
                        "experts (through moekit.hf.patch_model)")
    if getattr(module, "has_post_expert_norm", False):
        problems.append("it normalizes each expert's output")
    if getattr(module, "_is_expert_parallel", False):
        problems.append("it is expert-parallel (sharded experts)")
    act = getattr(module, "act_fn", None)
    if act is not None and not _is_silu(act):
        problems.append(f"its activation is {getattr(act, '__name__', type(act).__name__)}, not SiLU")
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None and apply_gate is _fp8_experts_gate():
        # transformers' FP8Experts has one gate for every model, SiLU(gate) * up unless one of these
        # is set (it was refused whole, so experts_implementation="moekit" never ran on it)
        changed = [f"{k}={getattr(module, k)!r}" for k in FP8_GATE_KNOBS if getattr(module, k, None) is not None]
        if changed:
            problems.append(f"its gate is clamped or soft-capped ({', '.join(changed)})")
    elif apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        problems.append("it overrides the gate (_apply_gate: clamping, soft-capping or similar)")
    if problems:
        raise ExpertsError(
            f"{label} ({type(module).__name__}) cannot run on moekit: " + "; ".join(problems)
        )


def _hf_weights(module: nn.Module, label: str) -> MoEWeights:
    """A MoEWeights over the module's own parameters (no copy), cached on the module while every
    tensor it wraps is the same (values written in place are seen: the MoEWeights reads these
    tensors, and its backends' prepared state follows their versions, MoEWeights.prepared_state)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise ExpertsError(f"{label} ({type(module).__name__}) has no gate_up_proj / down_proj tensors")
    key = tuple(
        None if not isinstance(t, torch.Tensor) else (t.data_ptr(), t.device, t.dtype, tuple(t.shape))
        for t in (gate_up, down, getattr(module, "gate_up_proj_scale_inv", None),
                  getattr(module, "down_proj_scale_inv", None))
    )
    cached = module.__dict__.get("_moekit_weights")
    if cached is not None and cached[0] == key:
        return cached[1]
    check_hf_experts(module, label)
    if gate_up.dtype not in (torch.float8_e4m3fn, torch.bfloat16, torch.float16):
        raise ExpertsError(
            f"{label}: moekit runs bf16/fp16 or FP8 experts, but gate_up_proj is {gate_up.dtype}; "
            "load the model with dtype=torch.bfloat16"
        )
    try:  # MoEWeights' own refusals (e.g. tensors that are not contiguous), named by module
        if gate_up.dtype == torch.float8_e4m3fn:
            weights = _hf_fp8_weights(module, gate_up, down, label)
        else:
            weights = MoEWeights(BF16, gate_up.detach(), down.detach())
    except ExpertsError:
        raise
    except ValueError as e:
        raise ExpertsError(f"{label} ({type(module).__name__}): {e}") from None
    module.__dict__["_moekit_weights"] = (key, weights)
    return weights


def _hf_fp8_weights(module, gate_up, down, label) -> MoEWeights:
    """transformers' own FP8Experts (quant_method "fp8", kept in FP8 on a GPU): 128x128 block
    scales named *_scale_inv (multipliers despite the name), dynamic activations."""
    block = getattr(module, "block_size", None)
    if block is None or list(block) != [BLOCK, BLOCK] or getattr(module, "activation_scheme", "dynamic") != "dynamic":
        raise ExpertsError(
            f"{label}: transformers FP8 experts with block_size={block!r}, activation_scheme="
            f"{getattr(module, 'activation_scheme', None)!r}: moekit runs block_size [128, 128] "
            "with dynamic activations"
        )
    s13, s2 = module.gate_up_proj_scale_inv, module.down_proj_scale_inv
    if s13.dtype != torch.float32 or s2.dtype != torch.float32:
        raise ExpertsError(f"{label}: FP8 expert scales must be float32, got {s13.dtype} (ue8m0 scales are not supported)")
    return MoEWeights.from_fp8(FP8_BLOCK128, gate_up.detach(), down.detach(), s13.detach(), s2.detach())


def moekit_experts_forward(self: nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """The `experts_implementation="moekit"` forward of a transformers experts module (inside a
    function torch.compile traces, one op running hf_experts_forward_eager: custom_ops)."""
    if isinstance(self, MoekitExperts):
        return self(hidden_states, top_k_index, top_k_weights)
    if torch.compiler.is_compiling():
        from .. import custom_ops

        return custom_ops.module_forward(self, hidden_states, (top_k_index, top_k_weights))
    return hf_experts_forward_eager(self, hidden_states, top_k_index, top_k_weights)


def hf_experts_forward_eager(self: nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    label = getattr(self, "moekit_name", None) or type(self).__name__
    weights = _hf_weights(self, label)
    backend = getattr(self, "moekit_backend", "auto")
    return run_experts(self, weights, hidden_states, top_k_index, top_k_weights, backend=backend, label=label)


_registered = False


def register() -> None:
    """Register "moekit" in transformers' ExpertsInterface (and its FP8 twin). Idempotent."""
    global _registered
    if _registered:
        return
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, moekit_experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # pragma: no cover - a transformers without FP8 experts
        pass
    else:
        FP8ExpertsInterface.register(IMPLEMENTATION, moekit_experts_forward)
    _registered = True


# ------------------------------------------------------------------------ moekit's own module


class MoekitExperts(HandleOwner, FollowsWeights, nn.Module):
    """A layer's routed experts in moekit's layout, run by moekit.fused_moe.

    Buffers (moved by .to() / .cuda() with the model, part of its state_dict):
        w13 [E, 2N, H], w2 [E, H, N] (FP8 e4m3fn, or bf16/fp16 for the bf16 scheme),
        w13_scale, w2_scale (float32, by granularity), a13_scale, a2_scale (fp8-tensor-static).
        .half() / .to(dtype) keep FP8 experts' dtypes (as MoELayer does); bf16 experts follow to
        bf16 / fp16 and stay bf16 under .float() (float32 activations run on them).
    forward(hidden_states, top_k_index, top_k_weights) is the contract of transformers'
    experts modules. `backend` picks the moekit backend ("auto": MOEKIT_BACKEND, then auto).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, family: str | None = None,
                 source_class: str | None = None, apply_on_input: bool = False):
        super().__init__()
        self._take_handle()  # names the module inside compiled graphs (moekit/handles.py)
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, intermediate
        self.family = family
        self.source_class = source_class
        self.apply_on_input = apply_on_input
        self.backend: str | None = "auto"
        self.scheme = None  # the QuantScheme once weights are in
        self.moekit_name: str | None = None  # the module's name in the model, for messages

    @property
    def label(self) -> str:
        return self.moekit_name or "experts"

    @property
    def loaded(self) -> bool:
        return self.scheme is not None

    def extra_repr(self) -> str:
        scheme = self.scheme.name if self.scheme is not None else "not loaded"
        return (f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"scheme={scheme}, backend={self.backend}")

    def load(self, weights: MoEWeights) -> None:
        """Take these weights (their tensors become the module's buffers)."""
        expected = (self.num_experts, self.hidden_dim, self.intermediate_dim)
        got = (weights.num_experts, weights.hidden, weights.n)
        if got != expected:
            raise ExpertsError(
                f"{self.label}: weights of (experts, hidden, intermediate) = {got}, the model "
                f"expects {expected}"
            )
        for name in TENSOR_FIELDS:
            if name in self._buffers:
                del self._buffers[name]
        for name, tensor in weights.tensors().items():
            self.register_buffer(name, tensor)
        self.scheme = weights.scheme
        self.__dict__.pop("_moekit_cached", None)
        self.__dict__.pop("_moekit_checked", None)

    def _apply(self, fn, *args, **kwargs):
        # model.half() / model.to(torch.float16) must not cast FP8 weights or float32 scales; bf16
        # experts follow the model to bf16 / fp16 (activations and unquantized weights must share
        # a dtype) but not to float32 or float64, which moekit refuses as weights: model.float()
        # keeps them bf16, and float32 activations run on them (computed in float32), as MoELayer
        unquantized = (self._buffers["w13"], self._buffers["w2"]) if self.loaded and not self.scheme.is_fp8 else ()
        return apply_keeping_dtypes(self, fn, *args, half_precision=unquantized, **kwargs)

    def moe_weights(self) -> MoEWeights:
        """The MoEWeights over the current buffers (rebuilt after the module moves)."""
        if not self.loaded:
            raise ExpertsError(f"{self.label}: the experts' weights were never loaded")
        # values written in place (load_state_dict into the same storage) need no new MoEWeights:
        # it reads these tensors, and its prepared state follows their versions (prepared_state)
        key = self._buffers_key()
        cached = self.__dict__.get("_moekit_cached")
        if cached is None or cached[0] != key:
            tensors = {k: self._buffers[k] for k in TENSOR_FIELDS if self._buffers.get(k) is not None}
            cached = (key, MoEWeights(self.scheme, **tensors))
            self.__dict__["_moekit_cached"] = cached
            cached[1]._followed_by(self)  # a tensor assigned to them becomes this module's buffer
        return cached[1]

    def _buffers_key(self) -> tuple:
        """What the cached MoEWeights were made over: each buffer's storage, device, dtype, shape."""
        return tuple((k, t.data_ptr(), t.device, t.dtype, tuple(t.shape))
                     for k in TENSOR_FIELDS if (t := self._buffers.get(k)) is not None)

    # FollowsWeights: a tensor assigned to the weights moe_weights() gave becomes the buffer
    def _weights_followed(self) -> MoEWeights | None:
        cached = self.__dict__.get("_moekit_cached")
        return cached[1] if cached is not None else None

    def _set_scheme(self, scheme) -> None:
        self.scheme = scheme

    def _buffers_assigned(self, weights: MoEWeights) -> None:
        if self._weights_followed() is weights:  # they run on over the new buffer, their derived state kept
            self.__dict__["_moekit_cached"] = (self._buffers_key(), weights)
        else:  # older weights over these buffers: rebuilt at the next call
            self.__dict__.pop("_moekit_cached", None)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers()) + sum(
            p.numel() * p.element_size() for p in self.parameters()
        )

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if torch.compiler.is_compiling():  # one op in a compiled graph, running _forward_eager
            from .. import custom_ops

            return custom_ops.module_forward(self, hidden_states, (top_k_index, top_k_weights))
        return self._forward_eager(hidden_states, top_k_index, top_k_weights)

    def _forward_eager(self, hidden_states, top_k_index, top_k_weights):
        config = getattr(self, "config", None)
        requested = getattr(config, "_experts_implementation", IMPLEMENTATION) if config is not None else IMPLEMENTATION
        if requested not in (None, IMPLEMENTATION) and not self.__dict__.get("_moekit_said_impl"):
            log.warning("%s: experts_implementation=%r is ignored: these experts were loaded by moekit "
                        "and run only through moekit", self.label, requested)
            self.__dict__["_moekit_said_impl"] = True
        return run_experts(self, self.moe_weights(), hidden_states, top_k_index, top_k_weights,
                           backend=self.backend, apply_on_input=self.apply_on_input, label=self.label)


def on_moekit(module: nn.Module) -> bool:
    """Whether `module` is transformers' own experts module running through moekit: its config
    says experts_implementation="moekit" and it holds the fused gate_up_proj tensor that the
    switch dispatches on (moekit's own MoekitExperts are not these)."""
    config = getattr(module, "config", None)
    return (not isinstance(module, MoekitExperts)
            and getattr(config, "_experts_implementation", None) == IMPLEMENTATION
            and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor))


def set_backend(model: nn.Module, backend: str | None) -> int:
    """Use `backend` ("auto", a backend name, or None = auto) for every experts module of `model`
    that runs through moekit: moekit's own, and transformers' own under experts_implementation=
    "moekit". Returns how many modules were set. transformers' experts running otherwise get it
    too (used once they are switched to "moekit") but are not counted."""
    if backend not in (None, "auto"):
        from ..backends import get_backend

        get_backend(backend)  # an unknown name raises, listing the valid ones
    count = 0
    for module in model.modules():
        if isinstance(module, MoekitExperts):
            module.backend = backend
            module.__dict__.pop("_moekit_checked", None)
            count += 1
        elif getattr(module, "_moekit_weights", None) is not None or hasattr(module, "gate_up_proj"):
            module.moekit_backend = backend
            if on_moekit(module):
                count += 1
    return count


def experts_modules(model: nn.Module) -> dict[str, MoekitExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, MoekitExperts)}


def experts_nbytes(model: nn.Module) -> int:
    """Bytes held by the model's experts modules that run through moekit (weights and scales):
    moekit's own, and transformers' own under experts_implementation="moekit"."""
    total = 0
    for module in model.modules():
        if isinstance(module, MoekitExperts):
            total += module.nbytes
        elif on_moekit(module):
            total += sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    return total
