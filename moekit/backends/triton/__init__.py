"""The `triton` backend: moekit's own fused MoE kernels."""

from .config import KernelConfig, default_config, get_config
from .launch import TritonBackend

__all__ = ["TritonBackend", "KernelConfig", "default_config", "get_config"]
