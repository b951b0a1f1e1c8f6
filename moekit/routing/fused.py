"""Launching the routing kernel (_kernels.route_kernel): route()'s path for GPU logits.

route()'s torch path is about a dozen launches (a cast, the finiteness check, softmax or sigmoid,
the bias, grouped top-k's masking, top-k, the gather, renormalization, the int32 cast); this is one,
which reads the logits in their own dtype and strides and asserts on the device that they are
finite. Callers have validated the rule and the bias (route() does).
"""

from __future__ import annotations

import functools

import torch

from .. import env
from ..backends.sizes import cdiv, next_pow2
from ..backends.triton_options import ASSERT_OPTIONS, compile_options
from . import _RENORM_EPS
from . import _kernels as k

# Logits per program: BLOCK_M rows of E padded to a power of two. 2048 float32 values are 16 per
# thread of 4 warps, a few registers for each of the kernel's row-wide tiles.
TILE_ELEMENTS = 2048
MAX_BLOCK_M = 64


def block_m(num_experts: int) -> int:
    """Tokens per program: as many as fill TILE_ELEMENTS, between 1 and MAX_BLOCK_M."""
    return max(1, min(MAX_BLOCK_M, TILE_ELEMENTS // next_pow2(num_experts)))


@functools.lru_cache(maxsize=1)
def _launch_options(interpreting: bool) -> dict:
    """device_assert compiled in (Triton's `debug`) and FP fusion as every moekit kernel asks for
    it; the interpreter takes no options (tests turn its debug on themselves)."""
    return {} if interpreting else {**ASSERT_OPTIONS, **compile_options(False)}


def route_fused(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str,
    renormalize: bool,
    num_groups: int | None,
    topk_groups: int | None,
    bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [M, k], ids int32 [M, k]) by route()'s rule, in one kernel on logits' device.

    logits: [M, E] with M >= 1, any float dtype and strides. bias: float32 [E], contiguous, or None.
    """
    from ..backends.glue.ops import on_device
    from ..backends.triton.launch import pdl_enabled

    bias = bias.contiguous() if bias is not None else None  # read as bias_ptr + expert
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    grouped = num_groups is not None and topk_groups < num_groups
    rows = block_m(num_experts)
    interpreting = env.interpreting()
    pdl = pdl_enabled(logits.device)
    with on_device(logits.device):
        k.route_kernel[(cdiv(num_tokens, rows),)](
            logits, logits.stride(0), logits.stride(1),
            bias if bias is not None else weights,  # any pointer where there is no bias: never read
            weights, ids,
            num_tokens, num_experts, top_k, num_groups or 1, topk_groups or 1, num_experts // (num_groups or 1),
            float(routed_scaling_factor),
            SOFTMAX=scoring == "softmax",
            HAS_BIAS=bias is not None,
            CHOOSE_ON_LOGITS=scoring == "sigmoid" and bias is None and num_groups is None,
            GROUPED=grouped,
            RENORMALIZE=renormalize,
            RENORM_EPS=_RENORM_EPS,
            BLOCK_M=rows,
            E_PAD=next_pow2(num_experts),
            K_PAD=next_pow2(top_k),
            G_PAD=next_pow2(num_groups or 1),
            INTERPRET=interpreting,
            PDL=pdl,
            num_warps=4,
            **_launch_options(interpreting),
            **({"launch_pdl": True} if pdl else {}),
        )
    return weights, ids
