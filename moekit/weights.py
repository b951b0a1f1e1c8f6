"""`MoEWeights`: one layer's expert weights and scales, in the layout every backend reads.

Layout (as vLLM, SGLang and transformers v5 fused experts):
    w13 [E, 2N, H]: gate rows first, then up rows;  w2 [E, H, N].
Scales (float32) by weight granularity:
    tensor  w13_scale [E]              w2_scale [E]
    channel w13_scale [E, 2N]          w2_scale [E, H]
    block   w13_scale [E, 2N/128, ceil(H/128)]   w2_scale [E, ceil(H/128), N/128]
Static activation scales (fp8-tensor-static): a13_scale and a2_scale, float32 [1], one per GEMM input.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import numbers
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import quant
from .spec import BLOCK, FP8_MAX, MoEShape, QuantScheme, get_scheme

UNQUANTIZED_DTYPES = (torch.bfloat16, torch.float16)
TENSOR_FIELDS = ("w13", "w2", "w13_scale", "w2_scale", "a13_scale", "a2_scale")


@dataclasses.dataclass(frozen=True)
class Shard:
    """Which rank's part of a whole layer's weights a MoEWeights holds, as
    `moekit.distributed.shard_weights_tp` / `shard_weights_ep` cut it: tp_fused_moe and
    ep_fused_moe check it against their process group, so that the whole weights or another
    rank's shard cannot run as this rank's (an unsharded TP layer would return world_size times
    the output)."""

    parallel: str  # "tp" (a slice of every expert's N) or "ep" (whole experts)
    rank: int
    world_size: int
    whole: int  # the whole layer's intermediate size N (tp) or number of experts E (ep)


@dataclasses.dataclass(eq=False, repr=False)  # __repr__: a summary, not every tensor's values
class MoEWeights:
    scheme: QuantScheme
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None
    # the rank's part of a whole layer these weights are (moekit.distributed), None for a whole layer
    shard: Shard | None = None
    # Per-backend derived state (e.g. a dequantized copy for the `torch` backend), built once and
    # refreshed in place after a tensor is written: read it through prepared_state(). Not init
    # fields, so that dataclasses.replace(weights, w13=...) starts its own: shared, each call of the
    # one rebuilt (and freed) the other's, memory a CUDA graph captured with the other reads.
    prepared: dict = dataclasses.field(init=False, default_factory=dict, repr=False)
    # per backend, the values its state was made from (_values_stamp)
    _stamps: dict = dataclasses.field(init=False, default_factory=dict, repr=False)

    def __post_init__(self):
        self.scheme = get_scheme(self.scheme)
        _validate(self)
        self.__dict__["_validated"] = True

    def __setattr__(self, name, value):
        """A tensor replaced after construction is validated as the constructor validates it
        (a non-contiguous w13 gave the triton backend garbage; a scale of the wrong shape failed
        deep inside a backend): the old tensor is put back and the error raised. To change
        several tensors at once (another E, another device), make new weights:
        dataclasses.replace(weights, w13=..., w2=..., ...) validates them together. A MoELayer
        running these weights takes the new tensor as its buffer (FollowsWeights)."""
        if name not in (*TENSOR_FIELDS, "scheme") or not self.__dict__.get("_validated"):
            super().__setattr__(name, value)
            return
        old = self.__dict__.get(name)
        if name == "scheme":  # a name as the constructor takes it; the tensors must suit it
            value = get_scheme(value)
        super().__setattr__(name, value)
        try:
            _validate(self)
        except (ValueError, TypeError):
            super().__setattr__(name, old)
            raise
        for layer in list(self.__dict__.get("_layers", ())):  # the modules over these tensors follow
            layer._weights_assigned(self, name, old)

    def _followed_by(self, layer) -> None:
        """`layer` (a module whose buffers are these tensors: FollowsWeights) is told of every
        tensor or scheme assigned here, so that its buffers follow. Held weakly: the weights never
        keep a layer alive."""
        self.__dict__.setdefault("_layers", weakref.WeakSet()).add(layer)

    def __getstate__(self):
        # weak references cannot be pickled or deep-copied; a copied module links its own copy
        # of the weights again (FollowsWeights.__setstate__)
        state = dict(self.__dict__)
        state.pop("_layers", None)
        return state

    def __repr__(self) -> str:
        """Scheme, sizes, dtype and device, as MoELayer's repr says them: the dataclass repr
        printed every tensor, hundreds of lines for one layer."""
        try:
            what = (f"E={self.num_experts}, H={self.hidden}, N={self.n}, dtype={self.w13.dtype}, "
                    f"device={self.device}")
        except (AttributeError, IndexError, TypeError):  # tensors not of the layout (a failed construction)
            what = f"w13={type(self.w13).__name__}, w2={type(self.w2).__name__}"
        shard = "" if self.shard is None else f", shard={self.shard}"
        return f"MoEWeights(scheme={getattr(self.scheme, 'name', self.scheme)}, {what}{shard})"

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_fp8(
        cls,
        scheme: str | QuantScheme,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor,
        w2_scale: torch.Tensor,
        a13_scale: torch.Tensor | None = None,
        a2_scale: torch.Tensor | None = None,
    ) -> "MoEWeights":
        """Wrap FP8 tensors and scales that already exist (a checkpoint), validating every one.
        A static activation scale may be 0-d, as older checkpoints store input_scale (and as
        quantize_weights' input_scales takes it): it is used as the [1] tensor it views."""
        scheme = get_scheme(scheme)
        if not scheme.is_fp8:
            raise ValueError(f"from_fp8 needs an FP8 scheme, got {scheme.name!r}")
        a13_scale, a2_scale = _as_one_element(a13_scale), _as_one_element(a2_scale)
        return cls(scheme, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale)

    # ------------------------------------------------------------------ properties
    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[2]

    @property
    def n(self) -> int:
        """Intermediate size per expert (on this GPU)."""
        return self.w2.shape[2]

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def shape(self, top_k: int) -> MoEShape:
        return MoEShape(self.num_experts, self.hidden, self.n, top_k)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in TENSOR_FIELDS if getattr(self, k) is not None}

    @property
    def nbytes(self) -> int:
        """Bytes of the weights and scales (not of any backend's prepared copies)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def prepared_state(self, backend: str, build: Callable[[], Any], refresh: Callable[[Any], None]):
        """The backend's derived state of the tensors' current values (the `torch` backend's
        dequantized copy, cutlass's expanded scales), kept in self.prepared[backend]: build()
        makes it.

        It goes stale when a tensor is written in place (load_state_dict into the same storage,
        copy_, mul_, an RL weight sync ...): torch counts every in-place write, through any view,
        in the tensor's `_version`. Stale state is refreshed in place, refresh(state), into its
        own memory: a CUDA graph captured with it must never read freed memory, and so reads the
        new values. Where a tensor's storage changed (an attribute replaced by another tensor),
        build() runs again. Tensors made under torch.inference_mode keep no version counter: after
        writing those in place, call invalidate(). The state is built outside inference mode
        (normal tensors), so that it can be refreshed in place in or out of it."""
        stamp = self._values_stamp()
        state, made_from = self.prepared.get(backend), self._stamps.get(backend)
        if state is None or made_from != stamp:
            with torch.inference_mode(False), torch.no_grad():
                if state is not None and [ptr for ptr, _ in made_from] == [ptr for ptr, _ in stamp]:
                    refresh(state)
                else:
                    state = self.prepared[backend] = build()
            self._stamps[backend] = stamp
        return state

    def check_scale_values(self) -> None:
        """The check of the scales' values (finite, weight scales not negative, static activation
        scales positive) that construction left pending: made inside scale_values_checked_later()
        (a MoELayer's weights) or where values could not be read (under graph capture or
        torch.compile). fused_moe runs it before any backend. ValueError naming the scale; a no-op
        once it has read them."""
        if self.__dict__.get("_values_pending") and _check_scale_values(self):
            self.__dict__.pop("_values_pending", None)

    @property
    def scale_values_pending(self) -> bool:
        """Whether the scales' values are still to be checked (check_scale_values)."""
        return bool(self.__dict__.get("_values_pending"))

    def invalidate(self) -> None:
        """Every backend's derived state is refreshed (in place, in its own memory) at its next
        use: for weights written in place that torch cannot see written, those made under
        torch.inference_mode (they keep no version counter)."""
        for backend, stamp in self._stamps.items():
            self._stamps[backend] = tuple((ptr, "invalidated") for ptr, _ in stamp)

    def _values_stamp(self) -> tuple:
        # Inference tensors (made under torch.inference_mode) keep no version counter; writes to
        # them happen only inside inference_mode and cannot be seen here.
        return tuple(
            (t.data_ptr(), None if t.is_inference() else t._version) for t in self.tensors().values()
        )

    def to(self, device: torch.device | str) -> "MoEWeights":
        moved = {k: v.to(device) for k, v in self.tensors().items()}
        return MoEWeights(self.scheme, **moved, shard=self.shard)

    def carry_prepared_from(self, older: "MoEWeights") -> None:
        """Take over `older`'s derived state (the same layer's weights, rebuilt over its
        buffers): state over unchanged storage is then refreshed in place instead of made anew,
        so that a CUDA graph captured with it never reads freed memory (MoELayer after
        load_state_dict or .half()). `older` keeps none of it (it would rebuild its own)."""
        self.prepared, self._stamps = older.prepared, older._stamps
        older.prepared, older._stamps = {}, {}

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (w13 [E, 2N, H], w2 [E, H, N])."""
        return self.dequantize_expert(slice(None))

    def dequantize_expert(self, experts: int | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 weights of some experts, without materialising the others."""
        if isinstance(experts, int):
            experts = slice(experts, experts + 1)
        if not self.scheme.is_fp8:
            return self.w13[experts].float(), self.w2[experts].float()
        g = self.scheme.weight
        return (
            quant.dequantize_weight(self.w13[experts], self.w13_scale[experts], g),
            quant.dequantize_weight(self.w2[experts], self.w2_scale[experts], g),
        )


def _as_one_element(scale):
    """A 0-d static activation scale as a [1] view (the shape every backend reads); anything
    else as it is, for validation to judge."""
    return scale.reshape(1) if isinstance(scale, torch.Tensor) and scale.dim() == 0 else scale


def _check_tensor(name: str, t, dtypes, shape, device, why: str = "") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"MoEWeights.{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(
            f"MoEWeights.{name} has dtype {t.dtype}; expected {' or '.join(map(str, dtypes))}{why}"
        )
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"MoEWeights.{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    if t.device != device:
        raise ValueError(f"MoEWeights.{name} is on {t.device} but w13 is on {device}")


def _check_contiguous(name: str, t: torch.Tensor) -> None:
    """Every backend reads the tensors in place, in the contiguous layout of the module docstring:
    the triton kernels take only the outer strides and assume unit stride along the last
    dimension (any other layout computes silently wrong results), cutlass uses the transposed
    views of contiguous tensors without a copy. So another layout is refused here, by name."""
    if t.is_contiguous():
        return
    want = torch.empty(t.shape, device="meta").stride()
    raise ValueError(
        f"MoEWeights.{name} is not contiguous: shape {tuple(t.shape)} with strides {t.stride()}, expected "
        f"strides {want}; every backend reads the weights in place in that layout. Pass {name}.contiguous() "
        f"(a copy); a tensor stored as [E, H, 2N] / [E, N, H] is transposed: transpose it to [E, 2N, H] / "
        f"[E, H, N] and make it contiguous"
    )


def check_intermediate(scheme: QuantScheme, N: int) -> None:
    """ValueError unless `scheme` can take the intermediate size per GPU N (128x128 block scales:
    N a multiple of 128)."""
    if scheme.weight == "block" and N % BLOCK:
        raise ValueError(
            f"scheme {scheme.name} needs the intermediate size per GPU to be a multiple of {BLOCK} "
            f"(gate and up rows must not share a 128-row block), got N={N}"
        )


def _unreadable(t: torch.Tensor) -> bool:
    """Whether a tensor's values cannot be read on the host now: while a CUDA graph is being
    captured (a MoELayer rebuilding its weights in a captured forward; a host read would break
    the capture), or a tensor without values (meta, torch.compile's fakes)."""
    return t.is_meta or torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _not_a_scale(t: torch.Tensor) -> torch.Tensor:
    return ~((t >= 0) & (t < float("inf")))  # NaN fails both compares


def _check_scale_values(w: MoEWeights) -> bool:
    """ValueError where a weight scale is NaN, infinite or negative, or a static activation scale
    is not positive and finite: every output channel it scales would be NaN, zero or garbage, with
    no error anywhere else (no FP8 quantizer writes such a scale; a checkpoint read with the wrong
    dtype or offset does). A weight scale of zero is allowed: a channel of zero weights. One host
    read for all of them. Returns whether it read them: False where nothing can be read now
    (_unreadable: graph capture, torch.compile's fakes, meta tensors)."""
    weight = {name: getattr(w, name) for name in ("w13_scale", "w2_scale")}
    static = {name: getattr(w, name) for name in ("a13_scale", "a2_scale") if w.scheme.static_activation}
    if any(_unreadable(t) for t in (*weight.values(), *static.values())):
        return False
    try:
        counts = torch.stack([_not_a_scale(t).sum() for t in weight.values()]
                             + [(_not_a_scale(t) | (t == 0)).sum() for t in static.values()]).tolist()
    except RuntimeError:  # a traced or fake tensor: no value to read
        return False
    for (name, t), count in zip(weight.items(), counts):
        if count:
            index = tuple(torch.nonzero(_not_a_scale(t))[0].tolist())
            raise ValueError(
                f"MoEWeights.{name} has {count} value(s) that are NaN, infinite or negative, e.g. "
                f"{float(t[index])} at {index}; weight scales must be finite and at least 0"
            )
    for (name, t), count in zip(static.items(), counts[len(weight):]):
        if count:  # 0: every output zero
            raise ValueError(f"MoEWeights.{name} must be positive and finite, got {float(t)}")
    return True


_VALUES_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar("moekit_scale_values_deferred", default=False)


@contextlib.contextmanager
def scale_values_checked_later():
    """MoEWeights made inside have their scales' values checked by check_scale_values(), not at
    construction: a MoELayer's weights over buffers allocated but not yet loaded (to_empty, then
    load_state_dict) hold whatever memory held, and printing or warming the layer before the load
    must not fail on them. fused_moe checks them at the first call that runs them. Never entered
    while torch.compile traces (Dynamo traces no ContextVar): MoELayer.weights refuses to build
    weights there before it gets here."""
    token = _VALUES_DEFERRED.set(True)
    try:
        yield
    finally:
        _VALUES_DEFERRED.reset(token)


class FollowsWeights:
    """A torch module whose buffers are the tensors of the MoEWeights it runs (MoELayer, moekit.hf's
    MoekitExperts): a tensor or scheme assigned to those weights becomes the module's buffer.
    Forward had run the new tensor while state_dict() saved the old buffer, a no-op .to("cpu")
    went back to the old one, and load_state_dict wrote into buffers forward no longer read.
    The module calls `weights._followed_by(self)` for the weights it runs and gives
    `_weights_followed()` (those weights, to link a copy to its own), `_set_scheme(scheme)` and
    `_buffers_assigned(weights)` (the buffers now hold a new tensor of `weights`)."""

    def _weights_assigned(self, weights: MoEWeights, name: str, old) -> None:
        """MoEWeights.__setattr__ calls this after a tensor (or the scheme) of weights this module
        was made or rebuilt with was replaced and validated: where every buffer is still their
        tensor as it was, the buffer becomes the new one. Weights the module no longer runs (its
        buffers since moved, loaded with assign=True or assigned) leave it alone."""
        was = {n: old if n == name else getattr(weights, n) for n in TENSOR_FIELDS}
        if any(self._buffers.get(n) is not t for n, t in was.items()):
            return
        if name == "scheme":
            self._set_scheme(weights.scheme)
        else:  # the dict itself: the module's setattr would drop `weights`, which are these buffers already
            self._buffers[name] = getattr(weights, name)
        self._buffers_assigned(weights)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        weights = self._weights_followed()
        if weights is not None:  # a copy (deepcopy, pickle) follows its own weights
            weights._followed_by(self)


def _validate(w: MoEWeights) -> None:
    s = w.scheme
    for name in ("w13", "w2"):
        t = getattr(w, name)
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"MoEWeights.{name} must be a 3-D tensor, got {got}")
    E, two_n, H = w.w13.shape
    if two_n % 2:
        raise ValueError(f"MoEWeights.w13 has {two_n} rows; expected 2N (gate rows then up rows)")
    if not (E and two_n and H):
        raise ValueError(f"MoEWeights.w13 has shape {(E, two_n, H)}; expected [E, 2N, H] with E, N and H at least 1")
    N = two_n // 2
    device = w.w13.device
    wdtypes = (quant.FP8_DTYPE,) if s.is_fp8 else UNQUANTIZED_DTYPES
    # unquantized: how to get there from float32 (FP8 weights of another dtype need quantizing, said elsewhere)
    why = "" if s.is_fp8 else (" (the unquantized scheme's dtypes): pass w13.bfloat16() / w13.half() and w2 "
                               "likewise, or quantize_weights(w13, w2, 'bf16'), which casts float32 weights")
    _check_tensor("w13", w.w13, wdtypes, None, device, why)
    _check_tensor("w2", w.w2, (w.w13.dtype,), (E, H, N), device, " (w13's dtype)")
    if s.is_fp8:
        _validate_scales(w, s, E, N, H, device)
    else:
        extra = [k for k in ("w13_scale", "w2_scale", "a13_scale", "a2_scale") if getattr(w, k) is not None]
        if extra:
            raise ValueError(f"scheme {s.name} is unquantized but scales were given: {', '.join(extra)}")
    # last: a tensor of the wrong shape or dtype is told so, not told to be made contiguous
    for name, t in w.tensors().items():  # scales included: the kernels index them the same way
        if isinstance(t, torch.Tensor):
            _check_contiguous(name, t)


def _validate_scales(w: MoEWeights, s, E: int, N: int, H: int, device) -> None:
    """The FP8 schemes' weight scales and, for static activation scales, those too."""
    check_intermediate(s, N)
    for name, rows, cols in (("w13_scale", 2 * N, H), ("w2_scale", H, N)):
        t = getattr(w, name)
        if t is None:
            raise ValueError(f"scheme {s.name} has FP8 weights, so MoEWeights.{name} is required")
        _check_tensor(name, t, (torch.float32,), quant.weight_scale_shape(s.weight, E, rows, cols), device)
    for name in ("a13_scale", "a2_scale"):
        t = getattr(w, name)
        if s.static_activation:
            if t is None:
                raise ValueError(
                    f"scheme {s.name} uses static activation scales, so MoEWeights.{name} is required"
                )
            _check_tensor(name, t, (torch.float32,), (1,), device)
        elif t is not None:
            raise ValueError(f"scheme {s.name} computes activation scales per call; {name} must be None")
    # one host read, at construction or assignment; else left for check_scale_values, which
    # fused_moe runs (torch.compile: is_compiling first, as Dynamo traces no ContextVar)
    if torch.compiler.is_compiling() or _VALUES_DEFERRED.get() or not _check_scale_values(w):
        w.__dict__["_values_pending"] = True
    else:
        w.__dict__.pop("_values_pending", None)


def quantize_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    scheme: str | QuantScheme,
    *,
    input_scales: tuple[float | torch.Tensor, float | torch.Tensor] | None = None,
    calibration: torch.Tensor | None = None,
) -> MoEWeights:
    """Quantize float expert weights (w13 [E, 2N, H], w2 [E, H, N]) to `scheme`.

    fp8-tensor-static also needs the static activation scales of both GEMM inputs: pass them as
    `input_scales=(a13_scale, a2_scale)`, or pass activations `calibration=x [T, H]` to measure
    them (x is sent through every expert, a conservative bound on what routing will send).
    The unquantized scheme keeps bf16 / fp16 weights as they are and casts float32 / float64
    ones to the dtype it was asked in ("bf16" or BF16: bfloat16; "fp16" or SCHEMES["fp16"]:
    float16; QuantScheme.cast_dtype), as the FP8 schemes quantize weights of any float dtype.
    """
    scheme = get_scheme(scheme)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
        raise TypeError("quantize_weights takes torch tensors w13 [E, 2N, H] and w2 [E, H, N]")
    given = [name for name, v in (("input_scales", input_scales), ("calibration", calibration)) if v is not None]
    if given and not scheme.static_activation:
        raise ValueError(f"{' and '.join(given)}: only for fp8-tensor-static (static activation scales); scheme "
                         f"{scheme.name} computes its activation scales per call")
    for name, t in (("w13", w13), ("w2", w2)):  # both: an integer w2 was quantized as if it were weights
        if not t.is_floating_point() or t.dtype == quant.FP8_DTYPE:
            raise ValueError(f"quantize_weights needs float weights, got {name} of dtype {t.dtype}"
                             + ("; FP8 weights with their scales are wrapped by MoEWeights.from_fp8"
                                if t.dtype == quant.FP8_DTYPE else ""))
    if not scheme.is_fp8:  # get_scheme("fp16") is the unquantized scheme with cast_dtype "fp16"
        target = torch.float16 if scheme.cast_dtype == "fp16" else torch.bfloat16
        return MoEWeights(scheme, _cast_wide(w13, target), _cast_wide(w2, target))
    if w13.dim() != 3 or w13.shape[1] % 2 or tuple(w2.shape) != (w13.shape[0], w13.shape[2], w13.shape[1] // 2):
        raise ValueError(
            f"quantize_weights takes w13 [E, 2N, H] and w2 [E, H, N], got {tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    if 0 in w13.shape:
        raise ValueError(f"quantize_weights takes w13 [E, 2N, H] with E, N and H at least 1, got {tuple(w13.shape)}")
    if w2.device != w13.device:
        raise ValueError(f"w2 is on {w2.device} but w13 is on {w13.device}")
    E, H, N = w2.shape
    a13 = a2 = None
    if scheme.static_activation:
        if input_scales is not None and calibration is not None:
            raise ValueError("give either input_scales= or calibration=, not both")
        if input_scales is not None:
            a13, a2 = _static_input_scales(input_scales, w13.device)
        elif calibration is not None:
            a13, a2 = _calibrate(w13, w2, calibration)
        else:
            raise ValueError(
                f"scheme {scheme.name} uses static activation scales: pass input_scales=(a13, a2) "
                "from the checkpoint or calibration=x (sample activations [T, H]) to measure them"
            )
        for name, s in (("a13", a13), ("a2", a2)):
            if not bool(torch.isfinite(s).all()) or float(s) <= 0:
                raise ValueError(f"static activation scale {name} must be positive and finite, got {float(s)}")
    # one expert at a time: a whole layer in float32 is several GB (128 experts)
    return quantize_per_expert(lambda e: (w13[e], w2[e]), E, H, N, scheme, w13.device,
                               input_scales=None if a13 is None else (a13, a2))


def _static_input_scales(input_scales, device) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_weights' input_scales=(a13, a2) as two float32 [1] tensors on `device`. A lone
    scalar, or a None among the two, raised Python's own TypeError ("'float' object is not
    iterable"), which named neither the argument nor its form."""
    form = "input_scales must be two scalars (a13, a2), the scales of GEMM1's and GEMM2's inputs"
    if not isinstance(input_scales, (tuple, list)):
        raise TypeError(f"{form}, in a tuple or list; got {type(input_scales).__name__}")
    if any(isinstance(v, bool) or not isinstance(v, (numbers.Real, torch.Tensor)) for v in input_scales):
        got = ", ".join(type(v).__name__ for v in input_scales)
        raise TypeError(f"{form}, each a float or a one-element tensor; got ({got})")
    scales = [torch.as_tensor(v, dtype=torch.float32, device=device) for v in input_scales]
    if len(scales) != 2 or any(v.numel() != 1 for v in scales):
        raise ValueError(f"{form}; got {len(scales)} of sizes {[v.numel() for v in scales]}")
    return scales[0].reshape(1), scales[1].reshape(1)


def _cast_wide(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 / float64 weight as `dtype`, contiguous (a new tensor, as quantizing makes);
    any other as it is: bf16 or fp16 ones are the unquantized scheme's own (a half is never
    converted into the other), the rest refused by MoEWeights by name."""
    if t.dtype not in (torch.float32, torch.float64):
        return t
    return t.detach().to(dtype=dtype, memory_format=torch.contiguous_format)


@torch.no_grad()  # weights given as Parameters: no autograd graph holding float32 copies
def quantize_per_expert(expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]], E: int, H: int, N: int,
                        scheme: QuantScheme, device: torch.device | str,
                        input_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> MoEWeights:
    """Quantize experts given by `expert(e) -> (w13_e [2N, H], w2_e [H, N])` (float, on any device)
    to the FP8 `scheme` on `device`, one at a time: only one expert is ever held in float32. Every
    scale is one expert's own, so this is bitwise the whole layer's quant.quantize_weight. New
    contiguous tensors whatever the inputs' layout. fp8-tensor-static: with its `input_scales`
    (a13 [1], a2 [1])."""
    check_intermediate(scheme, N)
    g = scheme.weight
    w13 = torch.empty(E, 2 * N, H, dtype=quant.FP8_DTYPE, device=device)
    w2 = torch.empty(E, H, N, dtype=quant.FP8_DTYPE, device=device)
    s13 = torch.empty(quant.weight_scale_shape(g, E, 2 * N, H), dtype=torch.float32, device=device)
    s2 = torch.empty(quant.weight_scale_shape(g, E, H, N), dtype=torch.float32, device=device)
    for e in range(E):
        gu, d = expert(e)
        q, s = quant.quantize_weight(gu.to(device)[None], g)
        w13[e], s13[e] = q[0], s[0]
        q, s = quant.quantize_weight(d.to(device)[None], g)
        w2[e], s2[e] = q[0], s[0]
    return MoEWeights.from_fp8(scheme, w13, w2, s13, s2, *(input_scales or ()))


@torch.no_grad()
def _calibrate(w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():  # a list or a numpy array: no .dim()
        got = f"a tensor of dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"calibration must be a float torch.Tensor of activations [T, hidden={w13.shape[2]}], "
                        f"got {got}")
    if x.dim() != 2 or x.shape[1] != w13.shape[2] or x.shape[0] == 0:
        raise ValueError(
            f"calibration activations must be [T > 0, hidden={w13.shape[2]}], got {tuple(x.shape)}"
        )
    x = x.to(w13.device).float()
    a13 = quant.scale_from_amax(x.abs().amax()).reshape(1)
    xq = quant.fake_quantize_activation(x, "tensor", a13)
    N = w2.shape[2]
    amax = torch.zeros((), device=x.device)
    for e in range(w13.shape[0]):  # one expert at a time bounds the memory to [T, 2N]
        h = xq @ w13[e].float().T
        amax = torch.maximum(amax, (torch.nn.functional.silu(h[:, :N]) * h[:, N:]).abs().amax())
    return a13, quant.scale_from_amax(amax).reshape(1)



def empty_weights(shape: MoEShape, scheme: QuantScheme, device: torch.device, dtype: torch.dtype) -> MoEWeights:
    """Weights with the shapes and dtypes of the scheme, the weights' contents undefined (never
    read); every scale ones, as MoEWeights checks scales' values (finite, not negative; the static
    activation scales positive): memory left as it was can hold anything."""
    E, H, N = shape.num_experts, shape.hidden, shape.n
    wdtype = torch.float8_e4m3fn if scheme.is_fp8 else dtype
    tensors = {"w13": torch.empty(E, 2 * N, H, dtype=wdtype, device=device),
               "w2": torch.empty(E, H, N, dtype=wdtype, device=device)}
    if scheme.is_fp8:
        tensors["w13_scale"] = torch.ones(quant.weight_scale_shape(scheme.weight, E, 2 * N, H), device=device)
        tensors["w2_scale"] = torch.ones(quant.weight_scale_shape(scheme.weight, E, H, N), device=device)
        if scheme.static_activation:
            tensors["a13_scale"] = torch.ones(1, device=device)
            tensors["a2_scale"] = torch.ones(1, device=device)
    return MoEWeights(scheme, **tensors)


__all__ = ["MoEWeights", "empty_weights", "quantize_weights", "FP8_MAX"]
