"""The contract every backend fulfils, and the registry that holds them."""

from __future__ import annotations

import abc

import torch

from ..spec import MoEShape, QuantScheme
from ..weights import MoEWeights


class Backend(abc.ABC):
    """One way of running an MoE layer.

    `supports` says, without running anything, every reason the backend cannot run a problem
    (an empty list means it can). `run` receives inputs already validated by `moekit.fused_moe`.
    """

    name: str
    description: str

    @abc.abstractmethod
    def supports(
        self, shape: MoEShape, scheme: QuantScheme, device: torch.device, dtype: torch.dtype = torch.bfloat16
    ) -> list[str]: ...

    @abc.abstractmethod
    def run(
        self,
        x: torch.Tensor,  # [M, H] bf16/fp16 (float32 only where supports() allows)
        weights: MoEWeights,
        topk_weights: torch.Tensor,  # [M, K] float32
        topk_ids: torch.Tensor,  # [M, K] int32, every id in [0, E)
    ) -> torch.Tensor:  # [M, H], x's dtype
        ...


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    if backend.name in _REGISTRY or backend.name == "auto":
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown backend {name!r}; expected one of: auto, {', '.join(_REGISTRY)}"
        ) from None


def backend_names() -> list[str]:
    return list(_REGISTRY)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for any other device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)
