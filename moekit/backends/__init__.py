"""Backends: each one a way to run an MoE layer, registered by name."""

from .base import Backend, backend_names, get_backend, register
from .cutlass import CutlassBackend
from .reference import ReferenceBackend
from .torch_backend import TorchBackend
from .triton import TritonBackend

register(ReferenceBackend())
register(CutlassBackend())
register(TorchBackend())
register(TritonBackend())

__all__ = ["Backend", "backend_names", "get_backend", "register"]
