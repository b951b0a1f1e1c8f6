"""Fast glue around grouped GEMMs, shared by the `cutlass` and `torch` backends: permute rows by
expert (fused with FP8 quantization), SiLU-and-mul (fused with requantization), and a
deterministic weighted combine. Triton on the GPU; a small torch fallback on the CPU."""

from .ops import ALIGN_M, Layout, combine, default_impl, num_permuted_rows, permute, silu_mul, unavailable_on

# torch's grouped GEMMs, FP8 (cutlass) and bf16 (the torch backend's grouped path), check
# group_count < 1024 (ScaledGroupMM.cu, GroupMM.cu): at most this many experts per call
GROUPED_GEMM_MAX_GROUPS = 1023

__all__ = ["ALIGN_M", "GROUPED_GEMM_MAX_GROUPS", "Layout", "combine", "default_impl", "num_permuted_rows", "permute",
           "silu_mul", "unavailable_on"]
