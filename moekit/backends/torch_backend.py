"""`torch`: the experts through PyTorch's own grouped GEMM (`grouped_mm`, what transformers v5
calls its `grouped_mm` experts implementation), on unquantized weights.

Every scheme runs, so every scheme has a second opinion and the FP8 backends' gain can be seen:
  - bf16/fp16 weights are used as they are for x of their dtype (fused_moe refuses the other
    one); float32 x gets a float32 copy, cast once (copies_weights says so);
  - FP8 weights are dequantized ONCE, at the first call, to x's dtype and kept in
    `weights.prepared["torch"]` (the path transformers takes for compressed-tensors FP8 experts).
    The activations are NOT quantized: bf16 activations meet the dequantized weights. So results
    differ from `reference` (which quantizes x and the intermediate to FP8) by that activation
    quantization noise, a few percent; against `reference` run on the same dequantized weights
    as an unquantized scheme they agree to bf16 rounding.

Paths:
  - CUDA SM90, bf16 activations, H and N multiples of 8: permute (Triton glue, no host sync),
    `grouped_mm` for both GEMMs, SiLU-and-mul, combine. Captures into CUDA graphs.
  - Otherwise (CPU, other GPUs, fp16/float32, odd sizes): the same glue and a loop over the experts
    that received tokens. On a GPU the loop reads the expert offsets once (one host sync, so it
    does not capture into CUDA graphs); on the CPU the glue is its torch implementation.
Both GEMMs produce x's dtype (as grouped_mm does: bf16 out), the intermediate SiLU(gate) * up is
computed in float32 from that and rounded to x's dtype, the combine sums in float32.
"""

from __future__ import annotations

import torch

from ..spec import MoEShape, QuantScheme
from ..weights import MoEWeights
from . import glue
from .base import Backend, device_capability
from .compile_only import compiling_only

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Compute capabilities where torch's grouped_mm runs a CUTLASS kernel in every torch >= 2.8.
GROUPED_MM_CAPABILITIES = ((9, 0),)


def grouped_mm_fn():
    """torch's bf16 grouped GEMM (F.grouped_mm where present, else torch._grouped_mm), or None."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def prepared_weights(weights: MoEWeights, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2N, H], w2 [E, H, N]) in `dtype`, contiguous; built once per dtype and cached in
    weights.prepared["torch"], written again in place after an in-place write to the weights
    (MoEWeights.prepared_state). Unquantized weights already in `dtype` are used as they are."""
    if not weights.scheme.is_fp8 and weights.w13.dtype == dtype:
        return weights.w13, weights.w2

    def refresh(cache: dict) -> None:
        for w13, w2 in cache.values():
            _write_weights(weights, w13, w2)

    cache = weights.prepared_state("torch", dict, refresh)
    if dtype not in cache:
        # normal tensors, as prepared_state makes them: refreshed in place in or out of inference mode
        with torch.inference_mode(False), torch.no_grad():
            w13 = torch.empty(weights.w13.shape, dtype=dtype, device=weights.device)
            w2 = torch.empty(weights.w2.shape, dtype=dtype, device=weights.device)
            cache[dtype] = _write_weights(weights, w13, w2)
    return cache[dtype]


def _write_weights(weights: MoEWeights, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights' values written into w13 and w2 (of another dtype); FP8 weights dequantized one
    expert at a time (bounded memory)."""
    if not weights.scheme.is_fp8:
        w13.copy_(weights.w13)
        w2.copy_(weights.w2)
    else:
        for e in range(weights.num_experts):
            d13, d2 = weights.dequantize_expert(e)
            w13[e].copy_(d13[0])
            w2[e].copy_(d2[0])
    return w13, w2


def _glue_impl(device: torch.device) -> str:
    """The glue implementation of the loop path: Triton on GPUs, torch on the CPU."""
    return "triton" if device.type == "cuda" else "torch"


def _use_grouped_mm(x: torch.Tensor, weights: MoEWeights) -> bool:
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and device_capability(x.device) in GROUPED_MM_CAPABILITIES
        and weights.hidden % 8 == 0  # 16-byte row strides for the GEMM's TMA loads
        and weights.n % 8 == 0
        and weights.num_experts <= glue.GROUPED_GEMM_MAX_GROUPS  # more: the per-expert loop
        and grouped_mm_fn() is not None
    )


class TorchBackend(Backend):
    name = "torch"
    description = (
        "torch grouped_mm (SM90, bf16) or a per-expert loop, on unquantized weights "
        "(FP8 schemes dequantized once: activations not quantized)"
    )
    # the glue's first kernel (glue.permute's _rank_kernel) asserts the ids on a GPU, in their own
    # dtype, int32 or int64: fused_moe launches no check and no narrowing for this backend
    checks_expert_ids = True
    reads_int64_ids = True

    def supports(self, shape: MoEShape, scheme: QuantScheme, device: torch.device, dtype=torch.bfloat16):
        if dtype not in DTYPES:
            return [f"activations must be bfloat16, float16 or float32, got {dtype}"]
        # Any scheme (FP8 ones are dequantized once), any size, any device. bf16 on SM90 takes
        # grouped_mm; everything else the per-expert loop (float32 computes in float32).
        glue_refusal = glue.unavailable_on(device)
        return [glue_refusal] if glue_refusal else []

    def copies_weights(self, scheme: QuantScheme, dtype: torch.dtype = torch.bfloat16) -> bool:
        # the dequantized copy in weights.prepared["torch"]; unquantized (bf16/fp16) weights are
        # used as they are for x of their dtype (fused_moe refuses the other half-precision one)
        # but cast to a float32 copy for float32 activations
        return scheme.is_fp8 or dtype == torch.float32

    def run(self, x, weights: MoEWeights, topk_weights, topk_ids):
        w13, w2 = prepared_weights(weights, x.dtype)
        if _use_grouped_mm(x, weights):
            return _run_grouped(x, w13, w2, topk_weights, topk_ids, grouped_mm_fn())
        return _run_loop(x, w13, w2, topk_weights, topk_ids, _glue_impl(x.device))

    def compile_ahead(self, x, weights: MoEWeights, topk_weights, topk_ids):
        """The glue's Triton kernels, on a GPU (on the CPU the glue is torch ops): the GEMMs not
        run. The weights as stored stand in for the ones run() prepares (a dequantized or float32
        copy): only their shapes are used, so warmup makes no copy and reads none."""
        if _glue_impl(x.device) != "triton":
            return False
        if _use_grouped_mm(x, weights):
            _run_grouped(x, weights.w13, weights.w2, topk_weights, topk_ids, _shape_only_grouped_mm)
        else:
            _run_loop(x, weights.w13, weights.w2, topk_weights, topk_ids, "triton")
        return True


def _run_grouped(x, w13, w2, topk_weights, topk_ids, gmm, impl=None):
    E = w13.shape[0]
    a, _, layout = glue.permute(x, topk_ids, E, align=glue.ALIGN_M, impl=impl)
    h = gmm(a, w13.transpose(1, 2), offs=layout.offs)  # [R, 2N]; mat_b [E, H, 2N] column-major view
    act, _ = glue.silu_mul(h, layout, act_dtype=x.dtype)
    y = gmm(act, w2.transpose(1, 2), offs=layout.offs)  # [R, H]
    return glue.combine(y, layout, topk_weights, out_dtype=x.dtype)


def _run_loop(x, w13, w2, topk_weights, topk_ids, impl):
    E, two_n, H = w13.shape
    a, _, layout = glue.permute(x, topk_ids, E, align=1, impl=impl)
    # the only host sync (none on the CPU to speak of); none compiling only (moekit.warmup), where
    # the offsets hold nothing: no GEMM runs
    ends = [] if compiling_only() else layout.offs.tolist()
    h = torch.empty(layout.num_rows, two_n, dtype=x.dtype, device=x.device)
    _per_expert_mm(a, w13, ends, h)
    act, _ = glue.silu_mul(h, layout, act_dtype=x.dtype)
    y = torch.empty(layout.num_rows, H, dtype=x.dtype, device=x.device)
    _per_expert_mm(act, w2, ends, y)
    return glue.combine(y, layout, topk_weights, out_dtype=x.dtype)


def _per_expert_mm(a: torch.Tensor, w: torch.Tensor, ends: list[int], out: torch.Tensor) -> None:
    """out[rows of e] = a[rows of e] @ w[e].T for every expert e with rows (others skipped)."""
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            torch.mm(a[start:end], w[e].t(), out=out[start:end])
        start = end


def _shape_only_grouped_mm(a, b, offs):
    """grouped_mm's output [R, N], uncomputed: what compile_ahead passes for the GEMM."""
    return torch.empty(a.shape[0], b.shape[-1], dtype=a.dtype, device=a.device)
