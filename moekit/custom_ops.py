"""torch.compile support: moekit's calls as opaque torch.library custom ops.

Inside a function torch.compile traces, `moekit.fused_moe`, `moekit.MoELayer` and moekit's
transformers experts each become one custom op (`torch.ops.moekit.fused_moe`,
`torch.ops.moekit.forward`) instead of Python the compiler would trace: backend choice, input
checks, table lookups and Triton launches are host code that reads values (routing sizes, the
environment, the tensors' versions), which would break the graph or fail under
`fullgraph=True`. At run time each op calls the same eager code, so a compiled model's output
is bitwise its eager output, whatever the backend. The compiler sees each op's output shape
and dtype (x's) from its fake implementation.

The object an op runs (a MoEWeights, a module) cannot be an argument of an op, so it is named
by an integer handle, its id() (moekit/handles.py). moekit's own modules hold theirs as an int
attribute from construction; for any other object (a MoEWeights, transformers' own experts
modules) the compiler turns id(obj) into a constant of the graph, guarding on the object's
identity (on every torch from 2.11), and handle_of() registers the object under it at trace time,
when the compiler calls it with that constant (assume_constant_result: torch 2.11 passes such a
function only constant arguments, never the object itself, so the live object is looked up by its
id there). The registry finds the object again when the op runs. The tensors the object holds are
passed too, as the op's declared inputs, but the op reads them through the object: a write to them
inside the compiled function (applied after the graph) is not seen by the op of the same call, so
weights are written outside (README).

So by default every layer object gets a graph of its own (its handle is a constant): a whole model
compiled at once is one graph holding every layer's handle, but one function (or one block class's
forward, compiled block by block) traced for many layer objects recompiles per object, and past
torch._dynamo.config.recompile_limit (8) falls back to eager (fullgraph=True: raises). With
torch._dynamo.config.allow_unspec_int_on_nn_module = True, a moekit module's handle attribute is a
graph input instead, and one graph serves every MoELayer / MoekitExperts (after one recompile that
finds the handle varying).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from . import handles
from .weights import MoEWeights


WEIGHTS_MADE_WHILE_TRACING = (
    "moekit.fused_moe under torch.compile needs its MoEWeights made outside the compiled "
    "function (once, like a module's weights), not inside it. MoELayer.weights builds a new "
    "MoEWeights when first read after .to(), load_state_dict() or a buffer assignment: call "
    "the layer itself (layer(x, ...)) in the compiled function, or read layer.weights once "
    "outside it"
)


def handle_of(obj) -> int:
    """obj's handle, registering obj under it. Inside a traced function the compiler makes id(obj)
    a constant (guarding on obj's identity) and calls _register with it once, at trace time."""
    return _register(id(obj))


@torch.compiler.assume_constant_result
def _register(object_id: int) -> int:
    # Only ever called with the id of an object alive at this moment: handle_of's argument, which
    # the caller (or, while tracing, the compiler) holds. So the id still names that object here.
    obj = ctypes.cast(object_id, ctypes.py_object).value
    if not isinstance(obj, torch.nn.Module) and not (isinstance(obj, MoEWeights) and "w13" in obj.__dict__):
        # A MoEWeights built inside the traced function exists only in the compiler's trace: the
        # id the compiler gives is that of an empty shell (torch 2.11) or of the compiler's own
        # record of the object (newer). Unsupported: without fullgraph the compiler breaks the
        # graph there and runs the call eagerly; with fullgraph it raises, with this message.
        raise torch._dynamo.exc.Unsupported(WEIGHTS_MADE_WHILE_TRACING)
    if isinstance(obj, MoEWeights):
        # Long-lived, like a module's buffers (which the compiler treats so already): under
        # torch.compile's CUDA graphs (mode="reduce-overhead") a tensor not so marked would be
        # copied into the graph's memory at every replay, here a whole layer that the op does not
        # even read (it reads the object). Marked here, at trace time, before the traced code
        # reads the tensors (custom_ops.fused_moe asks for the handle first).
        for t in obj.tensors().values():
            torch._dynamo.mark_static_address(t, guard=False)
    return handles.register(obj)


@torch.compiler.assume_constant_result
def refuse_layer_weights_built_while_tracing() -> int:
    """Raises Unsupported with WEIGHTS_MADE_WHILE_TRACING: MoELayer.weights calls it where it would
    build its MoEWeights inside a traced function. Run for real at trace time (as _register is),
    so the message reaches the user; the rebuild itself does not trace on torch 2.11 (its Dynamo
    cannot trace the layer's __dict__.pop), which broke the graph with a message naming only pop."""
    raise torch._dynamo.exc.Unsupported(WEIGHTS_MADE_WHILE_TRACING)


# ------------------------------------------------------------------------------ fused_moe


@torch.library.custom_op("moekit::fused_moe", mutates_args=())
def _fused_moe_op(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weight_tensors: list[torch.Tensor],
    handle: int,
    backend: str | None,
    apply_router_weight_on_input: bool,
    allow_weight_copies: bool,
) -> torch.Tensor:
    from .api import fused_moe

    out = fused_moe(
        x, handles.lookup(handle), topk_weights, topk_ids, backend,
        apply_router_weight_on_input=apply_router_weight_on_input, allow_weight_copies=allow_weight_copies,
    )
    return out.contiguous()  # the fake's layout (see _contiguous_like)


@_fused_moe_op.register_fake
def _(x, topk_weights, topk_ids, weight_tensors, handle, backend, apply_router_weight_on_input, allow_weight_copies):
    hidden = weight_tensors[0].shape[2]  # w13 [E, 2N, H]
    return x.new_empty(x.shape[0], hidden)  # contiguous, as the op returns it


def fused_moe(x, weights, topk_weights, topk_ids, backend, *, apply_router_weight_on_input, allow_weight_copies):
    """moekit.fused_moe as one op of a compiled graph. `weights` must be a MoEWeights made
    outside the compiled function (the compiler passes the real object to handle_of)."""
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights must be a moekit.MoEWeights, got {type(weights).__name__}")
    handle = handle_of(weights)  # first: it marks the tensors static before they are read below
    return torch.ops.moekit.fused_moe(
        x.detach(), topk_weights.detach(), topk_ids, _detached(weights.tensors().values()), handle,
        backend, apply_router_weight_on_input, allow_weight_copies,
    )


# -------------------------------------------------------------------------------- modules


@torch.library.custom_op("moekit::forward", mutates_args=())
def _forward_op(x: torch.Tensor, args: list[torch.Tensor], state: list[torch.Tensor], handle: int) -> torch.Tensor:
    return _forward_eagerly(handles.lookup(handle), x, args).contiguous()  # the fake's layout


def _forward_eagerly(module: torch.nn.Module, x: torch.Tensor, args) -> torch.Tensor:
    """moekit's modules (MoELayer, MoekitExperts) run their own _forward_eager (a subclass's
    override included); transformers' own experts modules (experts_implementation="moekit")
    the forward moekit.hf registered for them."""
    forward = getattr(module, "_forward_eager", None)
    if forward is not None:
        return forward(x, *args)
    from .hf.experts import hf_experts_forward_eager

    return hf_experts_forward_eager(module, x, *args)


@_forward_op.register_fake
def _(x, args, state, handle):
    return _contiguous_like(x)  # every moekit module returns x's shape in x's dtype


def _contiguous_like(x: torch.Tensor) -> torch.Tensor:
    """An op's output as its fake implementation gives it: x's shape and dtype, contiguous. Not
    torch.empty_like(x), which keeps the strides of a permuted x (x.transpose(0, 1) of a [S, B, H]
    tensor): the eager code returns a contiguous tensor, and inductor checks (assert_size_stride)
    and indexes the op's output by the fake's strides. The ops make their real outputs contiguous
    too (no copy where they already are), so that the two agree whatever a backend returns."""
    return x.new_empty(x.shape)


def module_forward(module: torch.nn.Module, x: torch.Tensor, args: Sequence[torch.Tensor]) -> torch.Tensor:
    """A moekit module's forward as one op of a compiled graph; the op runs the module's eager
    forward (_forward_eagerly)."""
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"argument {i + 1} after x must be a torch.Tensor, got {type(a).__name__}")
    state = _detached([*module.parameters(recurse=False), *module.buffers(recurse=False)])
    # moekit's modules carry their handle (an int attribute: a graph input under
    # allow_unspec_int_on_nn_module); transformers' own experts modules get one by identity
    handle = getattr(module, handles.HANDLE_ATTR, None)
    if handle is None:
        handle = handle_of(module)
    return torch.ops.moekit.forward(x.detach(), _detached(args), state, handle)


def _detached(tensors) -> list[torch.Tensor]:
    """The ops' inputs without autograd history: moekit is inference only and its eager calls run
    under torch.no_grad, so a compiled call's output carries no gradient either (the compiler
    would otherwise ask the ops for a backward formula)."""
    return [t.detach() for t in tensors]
