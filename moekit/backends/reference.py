"""`reference`: the ground truth. float32 arithmetic on dequantized weights, with activations
quantized exactly as the scheme says, so that any backend can be compared like for like.

The GEMM2 input (SiLU(gate) * up) is first rounded to the activations' dtype (every real kernel
stores it so), then quantized by the scheme's activation rule: per tensor (static scale, or one
dynamic scale over all M*K rows), per row, or per 1x128 group. A backend that quantizes the
intermediate differently (the triton backend uses 1x128 groups for fp8-channel-token) is compared
with `reference_moe(..., intermediate_granularity="group")`, the same function with that one change.
"""

from __future__ import annotations

import contextlib

import torch

from .. import quant
from ..spec import MoEShape, QuantScheme
from ..weights import MoEWeights
from .base import Backend


@contextlib.contextmanager
def _exact_fp32_matmul():
    """Keep float32 matmuls in full float32 even if the caller allowed TF32. Through
    `fp32_precision` where torch has it (2.9+): once a caller sets that, reading the legacy
    `allow_tf32` raises ("mix of the legacy and new APIs"), and the ground truth would fail."""
    matmul = torch.backends.cuda.matmul
    name, exact = ("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    saved = getattr(matmul, name)
    setattr(matmul, name, exact)
    try:
        yield
    finally:
        setattr(matmul, name, saved)


class ReferenceBackend(Backend):
    name = "reference"
    description = "float32 loop over experts on dequantized weights (ground truth, slow)"

    def supports(self, shape: MoEShape, scheme: QuantScheme, device: torch.device, dtype=torch.bfloat16):
        return []  # any scheme, any size, any device

    def run(self, x, weights: MoEWeights, topk_weights, topk_ids):
        return reference_moe(x, weights, topk_weights, topk_ids)


def expert_groups(topk_ids: torch.Tensor, num_experts: int):
    """Yield (expert, pair indices) for every expert that received tokens; pair p = token p // K."""
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    start = 0
    for e, count in enumerate(torch.bincount(flat_ids, minlength=num_experts).tolist()):
        if count:
            yield e, order[start : start + count]
            start += count


@torch.no_grad()
def reference_moe(x, weights: MoEWeights, topk_weights, topk_ids, intermediate_granularity=None,
                  round_gemm1_output: bool = False):
    """The reference computation; `intermediate_granularity` overrides how the GEMM2 input is
    quantized (default: the scheme's activation rule); `round_gemm1_output` stores GEMM1's output
    in x's dtype before SiLU (a backend's own rounding point: cutlass)."""
    scheme = weights.scheme
    M, K = topk_ids.shape
    N = weights.n
    with _exact_fp32_matmul():
        xq = x.float()  # [M, H]
        if scheme.is_fp8:
            xq = quant.fake_quantize_activation(x, scheme.activation, weights.a13_scale)
        act = xq.new_empty(M * K, N)  # SiLU(gate) * up of every (token, expert) pair
        for e, pairs in expert_groups(topk_ids, weights.num_experts):
            w13, _ = weights.dequantize_expert(e)
            h = xq[pairs // K] @ w13[0].T  # [pairs, 2N]
            if round_gemm1_output:
                h = h.to(x.dtype).float()
            act[pairs] = torch.nn.functional.silu(h[:, :N]) * h[:, N:]
        act = act.to(x.dtype).float()
        if scheme.is_fp8:
            act = quant.fake_quantize_activation(
                act, intermediate_granularity or scheme.activation, weights.a2_scale
            )
        out_pairs = xq.new_empty(M * K, weights.hidden)
        for e, pairs in expert_groups(topk_ids, weights.num_experts):
            _, w2 = weights.dequantize_expert(e)
            out_pairs[pairs] = act[pairs] @ w2[0].T  # [pairs, H]
        out = (out_pairs.view(M, K, weights.hidden) * topk_weights.float()[:, :, None]).sum(dim=1)
    return out.to(x.dtype)
