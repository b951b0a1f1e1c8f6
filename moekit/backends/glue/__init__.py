"""Fast glue around grouped GEMMs, shared by the `cutlass` and `torch` backends: permute rows by
expert (fused with FP8 quantization), SiLU-and-mul (fused with requantization), and a
deterministic weighted combine. Triton on the GPU; a small torch fallback on the CPU."""

from .ops import ALIGN_M, Layout, combine, default_impl, num_permuted_rows, permute, silu_mul

__all__ = ["ALIGN_M", "Layout", "combine", "default_impl", "num_permuted_rows", "permute", "silu_mul"]
