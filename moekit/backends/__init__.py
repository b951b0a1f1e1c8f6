"""Backends: each one a way to run an MoE layer, registered by name."""

from .base import Backend, backend_names, get_backend, register
from .reference import ReferenceBackend
from .triton import TritonBackend

register(ReferenceBackend())
register(TritonBackend())

__all__ = ["Backend", "backend_names", "get_backend", "register"]
