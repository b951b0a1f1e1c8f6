"""The contract every backend fulfils, and the registry that holds them."""

from __future__ import annotations

import abc
import contextlib
import contextvars
import functools

import torch

from ..dtypes import as_torch_dtype
from ..spec import MoEShape, QuantScheme, get_scheme
from ..weights import MoEWeights


class Backend(abc.ABC):
    """One way of running an MoE layer.

    `supports` says, without running anything, every reason the backend cannot run a problem
    (an empty list means it can). `run` receives inputs already validated by `moekit.fused_moe`.
    A subclass's `supports` receives its arguments normalised (supports_args), whatever its
    caller passed: __init_subclass__ wraps it.
    """

    name: str
    description: str
    # True if `run` asserts on the device that every id of topk_ids lies in [0, E) before it uses
    # one (a GPU kernel cannot raise: a device-side assertion stops the process's CUDA context).
    # Otherwise fused_moe launches its own check first (moekit.api.assert_ids_in_range).
    checks_expert_ids: bool = False
    # True if `run` takes int64 topk_ids as they are (its kernels read and check them in int64).
    # Otherwise fused_moe narrows int64 ids on a GPU to int32 first (glue.narrow_ids: one launch,
    # which transformers' routers, whose top-k ids are int64, pay on every layer call).
    reads_int64_ids: bool = False

    @abc.abstractmethod
    def supports(
        self, shape: MoEShape, scheme: QuantScheme | str, device: torch.device | str,
        dtype: torch.dtype | str = torch.bfloat16,
    ) -> list[str]: ...

    def __init_subclass__(cls, **kwargs):
        # supports() is public and select_backend takes names ("fp8-block128", "cuda", "bfloat16"):
        # passed to supports() directly, each backend refused "bfloat16" as not bfloat16, or failed
        # with an AttributeError on a str, or said yes to a scheme it never looked at. Normalised
        # here, once for every backend (and any registered later), not in each one.
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("supports")
        if own is not None:
            cls.supports = _normalising(own)

    @abc.abstractmethod
    def run(
        self,
        x: torch.Tensor,  # [M, H] bf16/fp16 (float32 only where supports() allows)
        weights: MoEWeights,
        topk_weights: torch.Tensor,  # [M, K] float32
        topk_ids: torch.Tensor,  # [M, K] int32, every id in [0, E)
    ) -> torch.Tensor:  # [M, H], x's dtype
        ...

    def compile_ahead(self, x: torch.Tensor, weights: MoEWeights, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> bool:
        """Called inside `compile_only()` (moekit.warmup): compile every Triton kernel that
        `run` with inputs of these shapes and dtypes would launch, launching none, reading no
        input (they may be empty tensors) and making no copy of the weights. True if this backend
        did; False where it has no Triton kernels (its kernels are built ahead of time, or it runs
        torch ops)."""
        return False

    def copies_weights(self, scheme: QuantScheme, dtype: torch.dtype = torch.bfloat16) -> bool:
        """True if running `scheme` with activations of `dtype` keeps a converted second copy of
        the weights (in weights.prepared). `auto` in a `moekit.MoELayer` never picks such a
        backend; naming it does."""
        return False


def supports_args(shape, scheme, device, dtype) -> tuple[MoEShape, QuantScheme, torch.device, torch.dtype]:
    """supports()'s arguments in the one form every backend reads: a scheme's name as the scheme
    (spec.get_scheme: ValueError listing the schemes), a device's name as a torch.device, a
    dtype's name as the torch.dtype (dtypes.as_torch_dtype). A shape that is no MoEShape, a
    device neither a torch.device nor a str, or a dtype neither a torch.dtype nor a str, is a
    TypeError naming the argument."""
    check_shape(shape)
    scheme = get_scheme(scheme)
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as e:  # torch's message lists the device types
            raise ValueError(f"device {device!r} is not a device name: {e}") from None
    elif not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device or its name ('cuda:0', 'cpu'), got "
                        f"{type(device).__name__} {device!r}")
    return shape, scheme, device, as_torch_dtype(dtype)


def check_shape(shape) -> None:
    """TypeError unless `shape` is a moekit.MoEShape (a tuple of sizes failed deep inside a
    backend's supports() with an AttributeError)."""
    if not isinstance(shape, MoEShape):
        raise TypeError(f"shape must be a moekit.MoEShape (e.g. weights.shape(top_k)), got "
                        f"{type(shape).__name__} {shape!r}")


def _normalising(supports):
    """A backend's own supports() behind supports_args (Backend.__init_subclass__)."""

    @functools.wraps(supports)
    def wrapper(self, shape, scheme, device, dtype=torch.bfloat16):
        return supports(self, *supports_args(shape, scheme, device, dtype))

    return wrapper


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    if backend.name in _REGISTRY or backend.name == "auto":
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    """The backend registered as `name` ("auto" is not one: it is a rule of moekit.select)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        if name == "auto":
            raise ValueError(
                "get_backend('auto'): auto is not a backend but the rule that chooses one per call; "
                "moekit.select_backend(...) tells which backend it chooses, or name one of: "
                + ", ".join(_REGISTRY)
            ) from None
        raise ValueError(
            f"unknown backend {name!r}; expected one of: auto, {', '.join(_REGISTRY)}"
        ) from None


def check_backend_name(backend) -> None:
    """ValueError unless `backend` is None, "auto" or a registered backend's name: for what
    stores a name to use later (MoELayer), so that a typo fails where it was written."""
    if backend is None or backend == "auto":
        return
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a backend's name, 'auto' or None, got {type(backend).__name__}")
    get_backend(backend)  # an unknown name raises, listing the valid ones


def backend_names() -> list[str]:
    return list(_REGISTRY)


_assumed_capability: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "moekit_assumed_capability", default=None
)


@contextlib.contextmanager
def assume_capability(capability: tuple[int, int]):
    """Inside the block, every CUDA device reads as having `capability`: lets supports() answer
    for a GPU that is not here (`moekit select --device-name`). Real devices are unaffected outside."""
    token = _assumed_capability.set(tuple(capability))
    try:
        yield
    finally:
        _assumed_capability.reset(token)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for any other device. Remembered per device index:
    the triton backend asks at every kernel launch (launch.pdl_enabled), and torch's own answer
    (torch.cuda.is_available, get_device_capability, get_device_properties) held 12% of an eager
    GLM-4.5V decode call's host path in cProfile on an H200 host (BENCHMARKS.md, thirty-seventh
    session; the gain itself not yet timed)."""
    if device.type != "cuda":
        return None
    assumed = _assumed_capability.get()
    if assumed is not None:
        return assumed
    index = device.index
    if index is None or index not in _CAPABILITIES:
        if not torch.cuda.is_available():
            return None
        index = torch.cuda.current_device() if index is None else index
        if index not in _CAPABILITIES:
            _CAPABILITIES[index] = tuple(torch.cuda.get_device_capability(index))
    return _CAPABILITIES[index]


_CAPABILITIES: dict[int, tuple[int, int]] = {}  # CUDA device index -> its compute capability
