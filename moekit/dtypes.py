"""Activation dtypes: by name, as the commands' --dtype and the Python API take them, and the
ones fused_moe runs."""

import torch

# moekit's names of the activation dtypes
ACTIVATION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# the dtypes of x fused_moe runs (float32 is computed in float32, on the backends that allow it).
# select_backend and moekit.warmup refuse the others as fused_moe does: they answered `reference`
# for a float64 or int8 x that fused_moe then refused.
FUSED_MOE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# every spelling people bring (moekit's, torch's, and vLLM's --dtype values) to moekit's names
DTYPE_SPELLINGS = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16"}


def as_torch_dtype(dtype) -> torch.dtype:
    """An activation dtype as a torch.dtype: a torch.dtype as it is, or a name of DTYPE_SPELLINGS
    (bf16, bfloat16, fp16, float16, half). A name reached every backend's supports() as a str,
    and each refused "bfloat16" as not bfloat16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = DTYPE_SPELLINGS.get(dtype.strip().lower())
        if name is not None:
            return ACTIVATION_DTYPES[name]
        raise ValueError(f"dtype {dtype!r} is not an activation dtype name: expected one of "
                         f"{', '.join(DTYPE_SPELLINGS)}, or a torch.dtype (e.g. torch.bfloat16)")
    raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16) or its name ('bf16'), "
                    f"got {type(dtype).__name__} {dtype!r}")


def check_fused_moe_dtype(dtype: torch.dtype, subject: str = "dtype is") -> None:
    """ValueError unless fused_moe runs activations of `dtype` (FUSED_MOE_DTYPES), worded as
    fused_moe words it: f"{subject} {dtype}; expected ..." ("x has dtype" there)."""
    if dtype not in FUSED_MOE_DTYPES:
        raise ValueError(f"{subject} {dtype}; expected bfloat16, float16 or float32")
