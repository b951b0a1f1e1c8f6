"""`fused_moe`: the one entry point that runs an MoE layer's experts."""

from __future__ import annotations

import warnings

import torch

from .backends import get_backend
from .backends.glue.ops import narrow_ids, on_device
from .dtypes import check_fused_moe_dtype
from .routing import check_flag
from .select import select_backend
from .weights import MoEWeights



def fused_moe(
    x: torch.Tensor,
    weights: MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    backend: str | None = "auto",
    *,
    apply_router_weight_on_input: bool = False,
    allow_weight_copies: bool = True,
) -> torch.Tensor:
    """Run the routed experts: out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).

    x [M, H] (bf16, fp16; float32 on backends that allow it), topk_weights [M, K] float,
    topk_ids [M, K] int32/int64. Returns [M, H] in x's dtype. `backend`: a backend name or
    "auto"; None or "auto" lets MOEKIT_BACKEND decide before auto does.
    `apply_router_weight_on_input` (Llama-4, top-1): the weight scales x before the experts.
    `allow_weight_copies=False`: auto never picks a backend that keeps a converted copy of the
    weights (what `moekit.MoELayer` passes); a backend named explicitly still runs.
    Inference only: where an input requires grad, runs under torch.no_grad with a warning.
    Runs on x's GPU whichever GPU is current (on_device). Inside a function torch.compile traces,
    the call is one custom op (custom_ops; `weights` made outside that function).
    """
    if type(apply_router_weight_on_input) is not bool or type(allow_weight_copies) is not bool:
        # checked as bools: a string or None was taken by its truthiness ("no" applied the rule);
        # the common call, two Python bools, makes no call here
        apply_router_weight_on_input, allow_weight_copies = check_flags(apply_router_weight_on_input,
                                                                        allow_weight_copies)
    if torch.compiler.is_compiling():
        from . import custom_ops  # imported here: it imports torch._dynamo (~1 s), needed only now

        return custom_ops.fused_moe(x, weights, topk_weights, topk_ids, backend,
                                    apply_router_weight_on_input=apply_router_weight_on_input,
                                    allow_weight_copies=allow_weight_copies)
    if grads_would_be_dropped(x, weights, topk_weights):
        with torch.no_grad():  # once: the call below sees grad off
            return fused_moe(x, weights, topk_weights, topk_ids, backend,
                             apply_router_weight_on_input=apply_router_weight_on_input,
                             allow_weight_copies=allow_weight_copies)
    check_tensor("x", x)  # before x.device is read (on_device), as validate_inputs words it
    with on_device(x.device):
        return _fused_moe(x, weights, topk_weights, topk_ids, backend, apply_router_weight_on_input,
                          allow_weight_copies)


def check_flags(apply_router_weight_on_input, allow_weight_copies) -> tuple[bool, bool]:
    """fused_moe's (and tp_ / ep_fused_moe's) two flags as Python bools: ValueError naming the
    one that is not True or False (routing.check_flag, RoutingConfig's check)."""
    return (check_flag("apply_router_weight_on_input", apply_router_weight_on_input),
            check_flag("allow_weight_copies", allow_weight_copies))


def check_tensor(name: str, value) -> None:
    """TypeError unless `value` is a torch.Tensor, naming the argument."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def grads_would_be_dropped(x, weights, topk_weights) -> bool:
    """True, with a warning, where grad mode is on and an input requires grad (the activations,
    the routing weights of a trainable router, the expert weights): moekit is inference only, and
    the caller then runs under torch.no_grad. Where nothing requires grad, no_grad would change
    nothing, so the common call does not pay for entering it."""
    if not torch.is_grad_enabled() or not isinstance(weights, MoEWeights):
        return False
    tensors = (x, topk_weights, *weights.tensors().values())  # scales too (an nn.Parameter scale)
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        return False
    warnings.warn(
        "moekit is inference only: no gradient flows through the experts (they run under torch.no_grad); "
        "call the model under torch.inference_mode() or torch.no_grad(), or freeze what requires grad",
        stacklevel=3,
    )
    return True


def _fused_moe(x, weights, topk_weights, topk_ids, backend, apply_router_weight_on_input, allow_weight_copies):
    topk_weights, topk_ids = validate_inputs(x, weights, topk_weights, topk_ids, device_check=False,
                                             narrow=False)
    if weights.scale_values_pending:  # a MoELayer's weights after a load, or made under capture: one host read
        weights.check_scale_values()
    M, K = topk_ids.shape
    if apply_router_weight_on_input:
        x, topk_weights = weight_input(x, topk_weights)
    choice = select_backend(
        weights.shape(K), weights.scheme, x.device, x.dtype, M, backend, allow_weight_copies=allow_weight_copies
    )
    if M == 0:
        return x.new_empty(0, weights.hidden)
    impl = get_backend(choice.backend)
    return impl.run(x, weights, topk_weights, ids_for_backend(impl, topk_ids, weights.num_experts))


def ids_for_backend(impl, topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """What fused_moe does to validated ids before the chosen backend runs: int64 ids narrowed to
    int32 on a GPU for a backend that reads only int32 (validate_inputs' docstring), and the
    device-side range check for one that does not check them itself (ids checked on the host are
    int32 already: validate_inputs). moekit.warmup runs it too, on unchecked empty ids under
    compile_only(), to compile those launches."""
    if not _ids_checked_on_device(topk_ids):
        return topk_ids.to(torch.int32)  # validate_inputs' host path; a no-op after it
    if topk_ids.dtype == torch.int64 and not impl.reads_int64_ids:
        topk_ids = narrow_ids(topk_ids, num_experts)
    if _ids_checked_on_device(topk_ids) and not impl.checks_expert_ids:
        assert_ids_in_range(topk_ids, num_experts)
    return topk_ids


def weight_input(x: torch.Tensor, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-4's rule (`apply_router_weight_on_input`, top-1): x scaled by its token's routing
    weight, in float32 then back to x's dtype, and routing weights of one, so that the experts'
    output is what the model adds up. fused_moe applies it; the bench and the accuracy check apply
    it to their reference's inputs, so that both sides saw the same x."""
    if topk_weights.dim() != 2:
        raise ValueError(f"topk_weights must be 2-D [tokens, top_k], got shape {tuple(topk_weights.shape)}")
    if topk_weights.shape[1] != 1:
        raise ValueError(f"apply_router_weight_on_input needs top-k = 1, got top-k = {topk_weights.shape[1]}")
    return (x.float() * topk_weights.float()).to(x.dtype), torch.ones_like(topk_weights)


def assert_ids_in_range(topk_ids: torch.Tensor, num_experts: int) -> None:
    """The device-side check of the expert ids: a checking kernel and torch._assert_async, no
    host synchronisation (it survives CUDA-graph capture). Torch ops took five launches inside
    every captured layer (about 10 µs of a 57 µs GLM-4.5V decode layer, BENCHMARKS.md); this is
    one at decode sizes. Where the assertion runs eagerly on the CPU (the interpreter) it raises
    at once."""
    from .backends.compile_only import compiling_only
    from .backends.glue.ops import ids_in_range

    in_range = ids_in_range(topk_ids, num_experts)
    if not compiling_only():  # compile-only (moekit.warmup): the check was compiled, not run, and holds nothing
        torch._assert_async(in_range, f"moekit: topk_ids outside [0, {num_experts})")


def _ids_checked_on_device(topk_ids: torch.Tensor) -> bool:
    """Whether the ids' range check is a device-side assertion (GPU tensors) rather than a host
    check (a test makes CPU tensors take the device path under the interpreter)."""
    return topk_ids.device.type == "cuda"


def validate_inputs(x, weights, topk_weights, topk_ids, *, device_check: bool = True,
                    num_experts: int | None = None, narrow: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Check every input of fused_moe; returns topk_weights as float32 and topk_ids as int32.

    Ids are range-checked on the host for CPU tensors. On a GPU the check is a device-side
    assertion (assert_ids_in_range), so it never makes the host wait and survives graph capture;
    `device_check=False` leaves it to the caller (fused_moe: to the backend, where the backend's
    own kernels assert the ids, Backend.checks_expert_ids). int64 ids on the device are narrowed
    to int32 by glue.narrow_ids, which writes an id outside [0, E) as -1, so that it stays out of
    range for those checks (cast as it is, 2**32 + 3 would read as expert 3). `narrow=False`
    returns them as int64 (fused_moe: narrowed only for a backend that does not read int64 ids,
    Backend.reads_int64_ids, sparing the backends whose kernels read them, all but reference, that launch).
    Unquantized weights must have x's dtype (float32 x excepted: computed in float32).
    `num_experts`: the model's expert count that top-k and the ids are checked against, where
    `weights` hold only some of the experts (expert parallel: this rank's shard); default
    weights.num_experts.
    """
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights must be a moekit.MoEWeights, got {type(weights).__name__}")
    for name, t in (("x", x), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        check_tensor(name, t)
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if t.device != weights.device:
            raise ValueError(f"{name} is on {t.device} but the weights are on {weights.device}")
    check_fused_moe_dtype(x.dtype, "x has dtype")
    check_weight_dtype(x.dtype, weights)
    if x.shape[1] != weights.hidden:
        raise ValueError(f"x has hidden size {x.shape[1]} but the weights expect {weights.hidden}")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} differ in shape"
        )
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"routing has {topk_ids.shape[0]} rows but x has {x.shape[0]} tokens")
    E, K = weights.num_experts if num_experts is None else num_experts, topk_ids.shape[1]
    if not 1 <= K <= E:
        raise ValueError(f"top-k must be between 1 and the number of experts ({E}), got {K}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids has dtype {topk_ids.dtype}; expected int32 or int64")
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights has dtype {topk_weights.dtype}; expected a float dtype")
    if topk_ids.numel() and _ids_checked_on_device(topk_ids):
        if device_check:
            assert_ids_in_range(topk_ids, E)
        if topk_ids.dtype == torch.int64:  # the one launch the cast would take, no host sync (docstring)
            return topk_weights.float(), narrow_ids(topk_ids, E) if narrow else topk_ids
    elif topk_ids.numel():
        in_range = (topk_ids >= 0) & (topk_ids < E)
        if not bool(in_range.all()):
            bad = topk_ids[~in_range]
            raise ValueError(
                f"topk_ids must lie in [0, {E}); found {bad.numel()} outside, e.g. {bad[0].item()}"
            )
    return topk_weights.float(), topk_ids.to(torch.int32)


def check_weight_dtype(x_dtype: torch.dtype, weights: MoEWeights) -> None:
    """ValueError unless unquantized weights can meet activations of x_dtype: the same dtype, or
    float32 activations (computed in float32). bf16 activations on fp16 weights (or the reverse)
    would reach the kernels as two dtypes (triton's tensor-core dot takes one) or make the
    `torch` backend keep a cast copy of the weights."""
    w_dtype = weights.w13.dtype
    if not weights.scheme.is_fp8 and x_dtype not in (w_dtype, torch.float32):
        raise ValueError(
            f"x has dtype {x_dtype} but the unquantized weights (scheme {weights.scheme.name}) are {w_dtype}: "
            f"pass x as {w_dtype} (or float32), or weights in {x_dtype}"
        )
