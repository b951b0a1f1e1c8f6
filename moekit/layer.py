"""`MoELayer`: one MoE layer's routed experts as a `torch.nn.Module`.

    layer = moekit.MoELayer(weights, routing=moekit.RoutingConfig(top_k=8))   # backend="auto"
    out = layer(x, router_logits)                # routes with the layer's RoutingConfig
    out = layer(x, topk_weights, topk_ids)       # or takes the routing as computed elsewhere

The weight tensors are the module's buffers (`w13`, `w2`, and the scales the scheme has), so
`.to(device)`, `state_dict()` and `load_state_dict()` behave as for any module, and a tensor
assigned to the layer's MoEWeights (`layer.weights.w13 = new`) becomes the buffer. `.to(dtype)`
and `.half()` leave FP8 weights and float32 scales as they are (the activations' dtype is x's);
unquantized (bf16 / fp16) weights follow a conversion to bf16 or fp16, as the model's own layers
do. The weights exist once: `auto` chooses per call (each batch size M may get another backend)
but only among backends that read them as they are, never one that keeps a converted copy (the
`torch` backend dequantizes FP8 weights to bf16): that one runs only when named
(`backend="torch"` or MOEKIT_BACKEND=torch). `memory()` reports the bytes of the weights and
of every backend's prepared state.
"""

from __future__ import annotations

import dataclasses

import torch

from .api import fused_moe
from .backends.base import check_backend_name
from .handles import HandleOwner
from .models import ModelSpec, get_model
from .routing import RoutingConfig, check_fits, route
from .dtypes import as_torch_dtype
from .spec import QuantScheme, get_scheme
from .weights import TENSOR_FIELDS, UNQUANTIZED_DTYPES, FollowsWeights, MoEWeights, scale_values_checked_later

BIAS = "e_score_correction_bias"  # the checkpoint's name for DeepSeek-V3 / GLM-4.5's router bias


def _tensors_in(obj, depth: int = 0):
    """Every tensor reachable from a backend's prepared state (dicts, sequences, dataclasses)."""
    if depth > 8:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name), depth + 1)


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (t.device, s.data_ptr()), s.nbytes()


def weight_memory(weights: MoEWeights) -> dict:
    """Bytes held for one layer's weights: {"weights": ..., "prepared": {backend: ...}, "total": ...}.

    "weights": the weights and scales themselves. "prepared": per backend, the memory of what it
    derived and keeps in weights.prepared, counted by storage: views of the weights (cutlass's
    transposed views, scales used as they are) count 0, a converted copy (torch's dequantized bf16
    weights) its full size, a storage shared by two backends once."""
    seen = {_storage_key(t)[0] for t in weights.tensors().values()}
    prepared = {}
    for name, state in weights.prepared.items():
        total = 0
        for t in _tensors_in(state):
            key, nbytes = _storage_key(t)
            if key not in seen:
                seen.add(key)
                total += nbytes
        prepared[name] = total
    return {"weights": weights.nbytes, "prepared": prepared, "total": weights.nbytes + sum(prepared.values())}


def apply_keeping_dtypes(module: torch.nn.Module, fn, *args, half_precision=(), **kwargs):
    """`Module._apply` for modules holding FP8 weights and float32 scales: Module.to(dtype) /
    .half() would convert every floating point tensor, FP8 included (and lose the scales'
    precision), so each tensor keeps its dtype and takes only fn's device (probed on an empty
    tensor). The tensors in `half_precision` (unquantized weights) take fn's dtype where it is
    bfloat16 or float16. Shared by MoELayer and moekit.hf's MoekitExperts."""
    def keep_dtype(t: torch.Tensor) -> torch.Tensor:
        probe = fn(t.new_empty(0))
        follows = probe.dtype in UNQUANTIZED_DTYPES and any(t is u for u in half_precision)
        return fn(t) if probe.dtype == t.dtype or follows else t.to(device=probe.device)

    return torch.nn.Module._apply(module, keep_dtype, *args, **kwargs)


def _check_leading_dims(x: torch.Tensor, name: str, t: torch.Tensor) -> None:
    """ValueError unless `t` [..., width] (router logits, or routing results) belongs to x's
    tokens row by row: x's leading dimensions, or as many rows where either side is flat ([M, H]
    or [M, width]): the same rows in the same order. Both with leading dimensions, they must be
    the same ones: [S, B] rows of a [B, S] x have as many tokens and would misroute, silently."""
    width = t.shape[-1]
    tokens = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else None
    rows = t.numel() // width if width else None
    flat = (t.dim() == 2 or x.dim() == 2) and rows == tokens
    if t.shape[:-1] != x.shape[:-1] and not flat:
        raise ValueError(
            f"{name} {tuple(t.shape)} does not match x {tuple(x.shape)}: expected the same "
            f"leading dimensions, {tuple(x.shape[:-1]) + (width,)}, or [{tokens}, {width}]"
        )


class MoELayer(HandleOwner, FollowsWeights, torch.nn.Module):
    """The routed experts of one MoE layer; see the module docstring.

    weights: the layer's `MoEWeights` (used as they are, not copied). routing: the model's
    `RoutingConfig`, needed for the `(x, router_logits)` form and for Llama-4's
    `apply_on_input`; None means the caller always passes (x, topk_weights, topk_ids).
    backend: "auto" (default; MOEKIT_BACKEND is honoured first), or a backend name.
    correction_bias: DeepSeek-V3 / GLM-4.5's e_score_correction_bias [E] when the routing uses
    one; a buffer (zeros until given or loaded with load_state_dict)."""

    def __init__(
        self,
        weights: MoEWeights,
        routing: RoutingConfig | None = None,
        backend: str | None = "auto",
        *,
        correction_bias: torch.Tensor | None = None,
        parallel: str | None = None,
        process_group=None,
        num_experts: int | None = None,
    ):
        super().__init__()
        self._take_handle()  # names the layer inside compiled graphs (moekit/handles.py)
        if not isinstance(weights, MoEWeights):
            raise TypeError(f"weights must be a moekit.MoEWeights, got {type(weights).__name__}")
        if routing is not None and not isinstance(routing, RoutingConfig):
            raise TypeError(f"routing must be a moekit.RoutingConfig or None, got {type(routing).__name__}")
        if parallel not in (None, "tp", "ep"):
            raise ValueError(f"parallel must be None, 'tp' or 'ep', got {parallel!r}")
        if parallel is None and process_group is not None:
            raise ValueError("process_group is only for parallel='tp' or 'ep' (a layer of one process has no group)")
        shard = weights.shard
        if parallel is None and shard is not None and shard.world_size > 1:
            raise ValueError(
                f"these weights are one rank's shard ({shard}): pass parallel={shard.parallel!r}, or the whole weights"
            )
        if parallel is not None and (shard is None or shard.parallel != parallel):
            raise ValueError(
                f"parallel={parallel!r} needs this rank's shard as made by moekit.distributed.shard_weights_{parallel} "
                f"(or MoELayer.sharded, from the whole weights); got "
                + ("whole weights (no MoEWeights.shard)" if shard is None else f"a shard for {shard.parallel!r}")
            )
        if parallel == "ep":
            if num_experts is None:
                raise ValueError("an expert-parallel layer needs num_experts, the model's number of experts")
            from .distributed.checks import as_count

            num_experts = as_count("num_experts", num_experts)
            if num_experts < weights.num_experts:
                raise ValueError(
                    f"an expert-parallel layer needs num_experts, the model's number of experts "
                    f"(>= this rank's {weights.num_experts}), got {num_experts!r}"
                )
        elif num_experts not in (None, weights.num_experts):
            raise ValueError(f"num_experts={num_experts} is only for parallel='ep' (weights hold {weights.num_experts})")
        # parallel: None, or "tp" / "ep" with `weights` this rank's shard (see `MoELayer.sharded`)
        self.parallel, self.process_group = parallel, process_group
        self.num_experts = num_experts if parallel == "ep" else weights.num_experts
        if routing is not None:
            try:  # route()'s own check against E (top_k among it), now rather than at the first forward
                check_fits(routing, self.num_experts)
            except ValueError as e:
                raise ValueError(f"routing does not fit this layer's {self.num_experts} experts: {e}") from None
        self.routing = routing
        self.backend = backend  # checked by __setattr__
        for name, t in weights.tensors().items():
            self.register_buffer(name, t)
        if routing is not None and routing.use_correction_bias:
            if correction_bias is None:
                correction_bias = torch.zeros(self.num_experts, device=weights.device)
            if (not isinstance(correction_bias, torch.Tensor) or not correction_bias.is_floating_point()
                    or tuple(correction_bias.shape) != (self.num_experts,)):
                got = (f"{correction_bias.dtype} of shape {tuple(correction_bias.shape)}"
                       if isinstance(correction_bias, torch.Tensor) else type(correction_bias).__name__)
                raise ValueError(f"correction_bias must be a float tensor of shape ({self.num_experts},), got {got}")
            self.register_buffer(BIAS, correction_bias.to(device=weights.device, dtype=torch.float32))
        elif correction_bias is not None:
            raise ValueError("correction_bias was given but the routing does not use one (use_correction_bias)")
        self._scheme, self._shard = weights.scheme, weights.shard
        self._weights: MoEWeights | None = weights
        weights._followed_by(self)  # a tensor assigned to them becomes this layer's buffer

    # ------------------------------------------------------------------------- constructors
    @classmethod
    def sharded(
        cls, weights: MoEWeights, parallel: str, routing: RoutingConfig | None = None,
        backend: str | None = "auto", *, process_group=None, correction_bias: torch.Tensor | None = None,
    ) -> "MoELayer":
        """This rank's layer of a tensor- ("tp") or expert-parallel ("ep") MoE over
        `process_group` (None: the default group), sliced from the whole layer's `weights`
        (moekit.distributed.shard_weights_tp / shard_weights_ep). Under "tp" every rank passes the
        whole batch and gets the whole output; under "ep" each rank passes its own tokens."""
        import torch.distributed as dist

        from . import distributed as md

        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        if parallel == "tp":
            local = md.shard_weights_tp(weights, rank, world)
        elif parallel == "ep":
            local = md.shard_weights_ep(weights, rank, world)
        else:
            raise ValueError(f"parallel must be 'tp' or 'ep', got {parallel!r}")
        return cls(
            local, routing, backend, correction_bias=correction_bias, parallel=parallel,
            process_group=process_group, num_experts=weights.num_experts if parallel == "ep" else None,
        )

    @classmethod
    def from_model(
        cls, model: str | ModelSpec, weights: MoEWeights, *, tp: int = 1, backend: str | None = "auto",
        correction_bias: torch.Tensor | None = None,
    ) -> "MoELayer":
        """A layer of a model (a preset name, a config.json path, or a ModelSpec): its routing
        rule, with these weights (which must have the model's shape at this tp)."""
        spec = model if isinstance(model, ModelSpec) else get_model(model, tp=tp)
        s = spec.shape
        for what, want, got in (
            ("experts", s.num_experts, weights.num_experts), ("hidden", s.hidden, weights.hidden),
            ("intermediate per GPU", s.n, weights.n),
        ):
            if want != got:
                raise ValueError(f"{spec.name} (tp {s.tp}) has {what} {want} but the weights have {got}")
        return cls(weights, spec.routing, backend, correction_bias=correction_bias)

    @classmethod
    def random(
        cls, model: str | ModelSpec, tp: int = 1, scheme: str | QuantScheme | None = None,
        device: torch.device | str = "cpu", *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
        backend: str | None = "auto",
    ) -> "MoELayer":
        """A layer of the model's shape with random weights (scheme: the model's own by default)
        and, where the routing has one, a random correction bias: for tests and demos."""
        from .inputs import make_weights

        spec = model if isinstance(model, ModelSpec) else get_model(model, tp=tp)
        scheme = get_scheme(scheme) if scheme is not None else spec.scheme
        device = torch.device(device)
        weights = make_weights(spec.shape, scheme, device, seed=seed, dtype=dtype)
        bias = None
        if spec.routing.use_correction_bias:
            g = torch.Generator().manual_seed(seed + 7)
            bias = (0.1 * torch.randn(spec.shape.num_experts, generator=g)).to(device)
        return cls(weights, spec.routing, backend, correction_bias=bias)

    # ---------------------------------------------------------------------------- weights
    @property
    def weights(self) -> MoEWeights:
        """The MoEWeights over the current buffers: the same object (with its backends' prepared
        state) until .to(), load_state_dict() or an assignment replaces or changes a buffer."""
        w = self._weights
        if w is None:
            if torch.compiler.is_compiling():  # weights made while tracing cannot run: say so by name
                from . import custom_ops

                custom_ops.refuse_layer_weights_built_while_tracing()
            buffers = self._buffers
            with scale_values_checked_later():  # buffers may not be loaded yet: fused_moe checks them
                w = self._weights = MoEWeights(self._scheme, **{n: buffers.get(n) for n in TENSOR_FIELDS},
                                               shard=self._shard)
            older = self.__dict__.pop("_older_weights", None)
            if older is not None:  # derived state over unchanged storage is refreshed in place, not freed
                w.carry_prepared_from(older)
            w._followed_by(self)
        return w

    # FollowsWeights: a tensor assigned to the weights this layer runs becomes its buffer
    def _weights_followed(self) -> MoEWeights | None:
        return self.__dict__.get("_weights")

    def _set_scheme(self, scheme: QuantScheme) -> None:
        self._scheme = scheme

    def _buffers_assigned(self, weights: MoEWeights) -> None:
        if self.__dict__.get("_weights") is not weights:  # older weights over these buffers: rebuilt
            self._drop_weights()

    def _drop_weights(self, keep_derived: bool = False) -> None:
        """The weights are rebuilt (and re-validated) over the buffers at their next use.
        `keep_derived` (after load_state_dict() or .half(), the buffers changed in place): where
        every buffer is still the storage the weights were made over, the new weights take over
        the old ones' derived state, refreshed in place: a CUDA graph captured before reads that
        memory, which must stay where it is. Otherwise (.to() another device, a buffer replaced)
        nothing of the old weights is kept alive."""
        old = self.__dict__.get("_weights")
        self.__dict__.pop("_older_weights", None)
        if keep_derived and old is not None:
            now = {n: b.data_ptr() for n, b in self._buffers.items() if n in TENSOR_FIELDS and b is not None}
            if now == {n: t.data_ptr() for n, t in old.tensors().items()}:
                self.__dict__["_older_weights"] = old
        self.__dict__["_weights"] = None

    def __setattr__(self, name, value):
        if name in TENSOR_FIELDS:
            self._drop_weights()  # a new weight tensor
        elif name == "backend":
            check_backend_name(value)  # a typo fails where it is written, not at the next call
        super().__setattr__(name, value)

    def register_buffer(self, name, tensor, persistent=True):
        if "_weights" in self.__dict__:
            self._drop_weights()
        super().register_buffer(name, tensor, persistent)

    def memory(self) -> dict:
        """`weight_memory` of this layer's weights: bytes of the weights and of prepared copies."""
        return weight_memory(self.weights)

    def _apply(self, fn, *args, **kwargs):
        # unquantized weights follow .half() / .bfloat16() / .to(bf16 or fp16) as a model's own
        # layers and moekit.hf's experts do: activations and unquantized weights must share a
        # dtype, and a bf16 layer left behind by model.half() refused the model's fp16 x. To
        # float32 / float64 they stay: float32 x runs on them as they are (MoEWeights refuses a
        # float32 copy). FP8 weights and float32 scales always keep their dtypes.
        unquantized = () if self._scheme.is_fp8 else (self._buffers["w13"], self._buffers["w2"])
        out = apply_keeping_dtypes(self, fn, *args, half_precision=unquantized, **kwargs)
        if unquantized and self._buffers["w13"].dtype != unquantized[0].dtype:
            # the same unquantized scheme, asked for in the new dtype (spec.FP16)
            self._scheme = get_scheme("fp16" if self._buffers["w13"].dtype == torch.float16 else "bf16")
        self._drop_weights(keep_derived=True)  # new tensors (another dtype): the weights rebuilt anew
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for name, buf in self._buffers.items():
            t = state_dict.get(prefix + name)
            if name == BIAS and isinstance(t, torch.Tensor) and t.dtype != torch.float32:
                # checkpoints store the router bias in float32 or bf16 (what their model holds): a
                # float bias becomes float32 (exact from bf16 / fp16), also under assign=True.
                # torch's load_state_dict copies the dict so that this method may modify it.
                if t.is_floating_point() and t.dtype.itemsize > 1:
                    state_dict[prefix + name] = t.to(torch.float32)
                else:
                    error_msgs.append(f"{prefix}{name} must be a float32 (or bf16 / fp16) tensor, got {t.dtype}")
                continue
            if (isinstance(t, torch.Tensor) and buf is not None and not self._scheme.is_fp8
                    and {t.dtype, buf.dtype} == set(UNQUANTIZED_DTYPES)):
                # bf16 and fp16 are one unquantized scheme, and the layer follows .half() /
                # .bfloat16(): a state dict of the model in the other one loads converted to this
                # layer's dtype, as nn.Linear's copy_ converts it (also under assign=True, so that
                # the weights keep the layer's dtype)
                state_dict[prefix + name] = t.to(buf.dtype)
            elif isinstance(t, torch.Tensor) and buf is not None and t.dtype != buf.dtype:
                error_msgs.append(
                    f"{prefix}{name} has dtype {t.dtype} in the state dict but {buf.dtype} in this layer "
                    f"(scheme {self._scheme.name}); load weights of the same scheme"
                )
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        self._drop_weights(keep_derived=True)  # new values: derived state refreshed at its next use

    # ---------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, *routing: torch.Tensor) -> torch.Tensor:
        """`(x, router_logits)` or `(x, topk_weights, topk_ids)`; x [..., H] -> [..., H] in x's dtype.
        Inside a function torch.compile traces, the call is one custom op running this same code
        (custom_ops)."""
        if torch.compiler.is_compiling():
            from . import custom_ops  # imported only now: it imports torch._dynamo

            return custom_ops.module_forward(self, x, routing)
        return self._forward_eager(x, *routing)

    def _forward_eager(self, x: torch.Tensor, *routing: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if len(routing) == 1:
            if self.routing is None:
                raise ValueError(
                    "this MoELayer has no RoutingConfig: call it with (x, topk_weights, topk_ids), "
                    "or build it with routing=RoutingConfig(...)"
                )
            logits = self._check_logits(x, routing[0])
            logits = logits.reshape(-1, logits.shape[-1]) if logits.dim() != 2 else logits
            bias = self._buffers.get(BIAS)
            topk_weights, topk_ids = route(logits, config=self.routing, correction_bias=bias)
        elif len(routing) == 2:
            topk_weights, topk_ids = routing
            k = topk_ids.shape[-1] if isinstance(topk_ids, torch.Tensor) and topk_ids.dim() else None
            if self.routing is not None and k is not None and k != self.routing.top_k:
                # routed by another rule than the layer's own (apply_on_input among it): a mistake
                raise ValueError(
                    f"topk_ids has {k} experts per token, but this MoELayer's RoutingConfig has top_k="
                    f"{self.routing.top_k}: route with the layer's rule (moekit.route(logits, config=layer.routing)) "
                    f"or call the layer with the router logits"
                )
            topk_weights = self._rows_of(x, "topk_weights", topk_weights)
            topk_ids = self._rows_of(x, "topk_ids", topk_ids)
        else:
            raise TypeError(
                f"MoELayer takes (x, router_logits) or (x, topk_weights, topk_ids), got {1 + len(routing)} tensors"
            )
        on_input = self.routing is not None and self.routing.apply_on_input
        weights = self.weights  # its scales' values are checked by fused_moe (scale_values_checked_later)
        if self.parallel is None:
            out = fused_moe(
                x2, weights, topk_weights, topk_ids, self.backend,
                apply_router_weight_on_input=on_input, allow_weight_copies=False,
            )
        else:
            from . import distributed as md

            if self.parallel == "tp":
                out = md.tp_fused_moe(
                    x2, weights, topk_weights, topk_ids, self.process_group, self.backend,
                    apply_router_weight_on_input=on_input, allow_weight_copies=False,
                )
            else:
                out = md.ep_fused_moe(
                    x2, weights, topk_weights, topk_ids, self.num_experts, self.process_group,
                    self.backend, apply_router_weight_on_input=on_input, allow_weight_copies=False,
                )
        return out if x.dim() == 2 else out.reshape(*lead, out.shape[-1])

    def _check_logits(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The router logits of x: [..., E] over this layer's (the model's) E experts, with x's
        leading dimensions ([M, E] for any x of M tokens). A narrower tensor would route to the
        first experts only, silently; a wider one fail on ids it never asked for."""
        if not isinstance(logits, torch.Tensor) or logits.dim() == 0:
            got = type(logits).__name__ if not isinstance(logits, torch.Tensor) else "a 0-d tensor"
            raise ValueError(f"router_logits must be a tensor [..., {self.num_experts}], got {got}")
        if logits.shape[-1] != self.num_experts:
            raise ValueError(
                f"router_logits has {logits.shape[-1]} columns but this layer routes over {self.num_experts} experts "
                f"(expected shape [..., {self.num_experts}], got {tuple(logits.shape)})"
            )
        _check_leading_dims(x, "router_logits", logits)
        return logits

    @staticmethod
    def _rows_of(x: torch.Tensor, name: str, t):
        """topk_weights / topk_ids as [M, K] rows of x's tokens, after the check of their leading
        dimensions that the logits get (routing [S, B, K] of a [B, S, H] x ran, every token with
        another token's experts); anything not a tensor of at least one dimension as it is, for
        fused_moe to refuse by name."""
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        _check_leading_dims(x, name, t)
        return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])

    def warmup(self, max_batch_size: int | None = None, *, batch_sizes=None, top_k: int | None = None,
               dtype: torch.dtype = torch.bfloat16, on_size=None):
        """Compile the Triton kernels this layer's calls would launch at each batch size (1 ...
        max_batch_size, or `batch_sizes`) before serving, launching none: `moekit.warmup` with this
        layer's weights, backend and top-k (its RoutingConfig's, else `top_k`), topk_ids of int32
        and int64; with a RoutingConfig also moekit.route's kernel for router logits of float32
        and `dtype` (compile_ahead.warm_routing, which runs it on zeros). Under parallel="tp"
        each rank warms its own shard at the same sizes. An expert-parallel layer is refused: the
        rows its local experts receive depend on the routing; warm them with
        `moekit.warmup(layer.weights, top_k, batch_sizes=...)` at the sizes they get."""
        from .compile_ahead import warmup

        dtype = as_torch_dtype(dtype)  # "bf16" as select_backend takes it
        if self.parallel == "ep":
            raise ValueError(
                "MoELayer.warmup does not take an expert-parallel layer (the rows its experts receive depend on the "
                "routing): call moekit.warmup(layer.weights, top_k, batch_sizes=...) with the local batch sizes"
            )
        if self.routing is not None and top_k not in (None, self.routing.top_k):
            raise ValueError(f"top_k={top_k} differs from this layer's RoutingConfig top_k {self.routing.top_k}")
        k = self.routing.top_k if self.routing is not None else top_k
        if k is None:
            raise ValueError("this MoELayer has no RoutingConfig: pass top_k, the experts per token of its calls")
        report = warmup(self.weights, k, max_batch_size, batch_sizes=batch_sizes, dtype=dtype, backend=self.backend,
                        allow_weight_copies=False, on_size=on_size)  # as the layer's calls
        if self.routing is not None:  # (x, router_logits) calls route first: its kernel too
            from .compile_ahead import batch_sizes_to_warm, warm_routing

            warm_routing(self.routing, self.num_experts, batch_sizes_to_warm(max_batch_size, batch_sizes),
                         self.weights.device, (torch.float32, dtype), self._buffers.get(BIAS))
        return report

    def extra_repr(self) -> str:
        w = self.weights
        top_k = f", top_k={self.routing.top_k}" if self.routing is not None else ""
        par = "" if self.parallel is None else f", parallel={self.parallel} ({w.num_experts} of {self.num_experts} experts here)"
        return f"E={w.num_experts}, H={w.hidden}, N={w.n}{top_k}, scheme={w.scheme.name}, backend={self.backend!r}{par}"
