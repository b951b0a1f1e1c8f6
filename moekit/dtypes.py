"""Activation dtypes by name, as the commands' --dtype and the Python API take them."""

import torch

# moekit's names of the activation dtypes
ACTIVATION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

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
