"""The triton backend's GEMV path (KernelConfig.GEMV = 1 or 2, how GEMM1 reduces its products): a decode layer in three launches for
row-quantized schemes (quantize x, GEMM1 per pair, GEMM2 per token with the combine in it; a
dynamic per-tensor scale adds its max pass and a zeroed maximum), no alignment; kernels in
_gemv_kernels.py, the why in its docstring. The tuner decides where it beats the tiled kernels
(its search space holds GEMV configs at decode sizes, moekit.tune.space)."""

from __future__ import annotations

import torch

from ...weights import MoEWeights
from ..sizes import cdiv, next_pow2
from . import _gemv_kernels as gk
from .config import KernelConfig
# launch.py imports this module only inside functions (run, prepare_gemm_only): launch is loaded here
from .launch import A_SCALE_KIND, B_SCALE_KIND, _TL_DTYPE, _gemm2_launch, _interpreting, _launch, _scale_strides, quantize_input


def run_gemv(x, weights: MoEWeights, topk_weights, topk_ids, cfg: KernelConfig, *, row_intermediate: bool):
    """The whole layer by the GEMV path. `row_intermediate`: quantize fp8 token/group schemes'
    intermediate per row (fast mode's rule) rather than per 1x128 group."""
    a, a_scale = quantize_input(x, weights)
    return gemv_gemms(a, a_scale, weights, topk_weights, topk_ids, x.dtype, cfg, row_intermediate=row_intermediate)


def gemv_gemms(a, a_scale, weights: MoEWeights, topk_weights, topk_ids, out_dtype, cfg: KernelConfig, *,
               row_intermediate: bool):
    """The layer from x already quantized (quantize_input): GEMM1, then GEMM2 with the combine."""
    act, act_scale, a_mode = gemv1(a, a_scale, weights, topk_ids, out_dtype, cfg, row_intermediate)
    return gemv2(act, act_scale, a_mode, weights, topk_weights, topk_ids, out_dtype, cfg)


def gemm2_groups(cfg: KernelConfig, top_k: int) -> int:
    """128-groups of N that GEMM2 reads per pair and step: as many weight bytes per step as GEMM1
    reads (gate and up: 2 x GROUPS groups per column), spread over the token's pairs (padded to a
    power of two), and at least one group per pair. GLM-4.5V and DeepSeek-V3 (top-8) at K steps
    of 512 then read one group per pair; Mixtral (top-2) four. Beyond top-8 the tile grows with
    the pairs (one group each), and a top-k short of a power of two leaves padded rows idle: no
    such preset was measured."""
    return max(1, 2 * (cfg.BLOCK_K // 128) // next_pow2(top_k))


def _gemm2_input_mode(weights: MoEWeights, row_intermediate: bool) -> int:
    """gemv2_kernel's A_MODE for this scheme (see its docstring)."""
    scheme = weights.scheme
    if not scheme.is_fp8:
        return 0
    if scheme.static_activation:
        return 1
    if scheme.activation == "tensor":
        return 3
    return 5 if row_intermediate else 2


def gemv1(a, a_scale, weights: MoEWeights, topk_ids, out_dtype, cfg: KernelConfig, row_intermediate: bool):
    """(each pair's SiLU(gate) * up [P, N], the scale GEMM2 reads with it, GEMM2's A_MODE)."""
    scheme = weights.scheme
    M, K = topk_ids.shape
    N, H = weights.n, weights.hidden
    dev = a.device
    unused = a  # pointer arguments a variant never reads (no buffer, no fill launched for them)
    a_mode = _gemm2_input_mode(weights, row_intermediate)
    out_mode = {1: 2, 3: 1}.get(a_mode, 0)  # static: quantize here; dynamic tensor: record the max
    if a_mode == 1:
        out_scale = weights.a2_scale
    elif a_mode == 3:  # the shared maximum GEMV1 records
        out_scale = torch.zeros(1, dtype=torch.float32, device=dev)
    else:
        out_scale = unused
    out = torch.empty(M * K, N, dtype=torch.float8_e4m3fn if out_mode == 2 else out_dtype, device=dev)
    w_scale = weights.w13_scale
    stride_wse, stride_wsn = _scale_strides(w_scale)
    _launch(gk.gemv1_kernel, (M * K, cdiv(N, cfg.BLOCK_N)),
        a, a_scale if a_scale is not None else unused, weights.w13, w_scale if w_scale is not None else unused,
        out, out_scale, out_scale, topk_ids.reshape(-1), weights.num_experts, N, H, K,
        a.stride(0), a_scale.stride(0) if a_scale is not None and a_scale.dim() == 2 else 1,
        weights.w13.stride(0), weights.w13.stride(1), stride_wse, stride_wsn, out.stride(0),
        A_SCALE=A_SCALE_KIND[scheme.activation] if scheme.is_fp8 else 0, B_SCALE=B_SCALE_KIND[scheme.weight],
        OUT_MODE=out_mode, ACT_DTYPE=_TL_DTYPE[out_dtype], BLOCK_N=cfg.BLOCK_N, GROUPS=cfg.BLOCK_K // 128,
        STAGES=cfg.num_stages, INTERPRET=_interpreting(), LATE=cfg.GEMV == 2, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, out_scale, a_mode


def gemv2(act, act_scale, a_mode, weights: MoEWeights, topk_weights, topk_ids, out_dtype, cfg: KernelConfig,
          groups: int | None = None):
    """The layer's output [M, H]: each token's K pairs through w2, weighted and summed; on
    GEMM2's own column block, warps and K-loop depth where the config has them
    (KernelConfig.gemm2), its K step GEMM1's (gemm2_groups) unless `groups` (128-groups per pair
    and step, a power of two) is given: scripts/diag_gemv_gemm2_steps.py measures other steps."""
    M, K = topk_ids.shape
    g2 = _gemm2_launch(cfg)
    N, H = weights.n, weights.hidden
    out = torch.empty(M, H, dtype=out_dtype, device=act.device)
    w_scale = weights.w2_scale
    stride_wse, stride_wsn = _scale_strides(w_scale)
    _launch(gk.gemv2_kernel, (M, cdiv(H, g2.BLOCK_N)),
        act, act_scale, weights.w2, w_scale if w_scale is not None else act,
        topk_weights.reshape(-1).contiguous(), topk_ids.reshape(-1), out, N, H,
        act.stride(0), weights.w2.stride(0), weights.w2.stride(1), stride_wse, stride_wsn, out.stride(0),
        A_MODE=a_mode, B_SCALE=B_SCALE_KIND[weights.scheme.weight], K_TOP=K, K_POW2=next_pow2(K),
        BLOCK_N=g2.BLOCK_N, GROUPS=groups or gemm2_groups(cfg, K), STAGES=g2.num_stages, INTERPRET=_interpreting(),
        num_warps=g2.num_warps, num_stages=g2.num_stages,
    )
    return out
