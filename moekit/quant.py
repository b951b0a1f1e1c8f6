"""FP8 (e4m3fn) quantization helpers, following compressed-tensors conventions.

scale = amax / 448 (float32), stored value q = x / scale rounded to e4m3fn, real value = q * scale.
Weights carry a leading expert dimension [E, R, C]; activations are [T, C].

Every backend's kernels quantize with exactly these formulas (scale = max(amax, AMAX_FLOOR) / 448,
q = clamp(x / scale, -448, 448)), so that the reference backend can be compared like for like.
"""

from __future__ import annotations

import torch

from .spec import BLOCK, FP8_MAX

FP8_DTYPE = torch.float8_e4m3fn
# A row of zeros would give scale 0 and 0/0 = NaN: the floor keeps the scale positive.
AMAX_FLOOR = 1e-10


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # Divide by a tensor on amax's device, not by a Python number: on CUDA, torch turns division
    # by a host scalar into multiplication by its reciprocal, which differs from IEEE division
    # in the last bit for about half of all values (seen on an H200, 2026-12-03), and then
    # a GPU's FP8 values would depend on which code path quantized them.
    fp8_max = torch.full((), FP8_MAX, dtype=torch.float32, device=amax.device)
    return amax.float().clamp(min=AMAX_FLOOR) / fp8_max


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale saturated to the FP8 range; `scale` broadcasts against x."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _pad_to_block(x: torch.Tensor, dim: int) -> torch.Tensor:
    size = x.shape[dim]
    pad = -size % BLOCK
    if pad == 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = pad
    return torch.cat([x, x.new_zeros(pad_shape)], dim=dim)


def _expand_groups(scale: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """Repeat each group's scale over its BLOCK columns (or rows) and cut to `size`."""
    return scale.repeat_interleave(BLOCK, dim=dim).narrow(dim, 0, size)


# ----------------------------------------------------------------------------------- weights


def weight_scale_shape(granularity: str, num_experts: int, rows: int, cols: int) -> tuple[int, ...]:
    if granularity == "tensor":
        return (num_experts,)
    if granularity == "channel":
        return (num_experts, rows)
    if granularity == "block":
        return (num_experts, -(-rows // BLOCK), -(-cols // BLOCK))
    raise ValueError(f"unknown weight granularity {granularity!r}; expected tensor, channel or block")


def quantize_weight(w: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, R, C] float weights -> (FP8 [E, R, C], float32 scales of `weight_scale_shape`)."""
    w = w.float()
    if granularity == "tensor":
        scale = scale_from_amax(w.abs().amax(dim=(1, 2)))  # [E]
        return to_fp8(w, scale[:, None, None]), scale
    if granularity == "channel":
        scale = scale_from_amax(w.abs().amax(dim=2))  # [E, R]
        return to_fp8(w, scale[:, :, None]), scale
    if granularity == "block":
        E, R, C = w.shape
        padded = _pad_to_block(_pad_to_block(w, 1), 2)
        blocks = padded.view(E, padded.shape[1] // BLOCK, BLOCK, padded.shape[2] // BLOCK, BLOCK)
        scale = scale_from_amax(blocks.abs().amax(dim=(2, 4)))  # [E, R/B, C/B]
        full = _expand_groups(_expand_groups(scale, R, 1), C, 2)
        return to_fp8(w, full), scale
    weight_scale_shape(granularity, 0, 0, 0)  # raises the error naming the granularity
    raise AssertionError


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, granularity: str) -> torch.Tensor:
    """FP8 [E, R, C] and its scales -> float32 [E, R, C]."""
    if granularity == "tensor":
        return q.float() * scale[:, None, None]
    if granularity == "channel":
        return q.float() * scale[:, :, None]
    if granularity == "block":
        full = _expand_groups(_expand_groups(scale, q.shape[1], 1), q.shape[2], 2)
        return q.float() * full
    weight_scale_shape(granularity, 0, 0, 0)
    raise AssertionError


# ------------------------------------------------------------------------------- activations


def quantize_activation(
    x: torch.Tensor, granularity: str, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, C] activations -> (FP8 [T, C], float32 scale).

    Scale shapes: tensor [1]; token [T]; group [T, ceil(C / 128)]. A static scale (tensor only)
    is used as given instead of being computed from x.
    """
    x = x.float()
    if static_scale is not None:
        if granularity != "tensor":
            raise ValueError(f"static activation scales exist only per tensor, not per {granularity}")
        scale = static_scale.float().reshape(1)
        return to_fp8(x, scale), scale
    if granularity == "tensor":
        amax = x.abs().amax() if x.numel() else x.new_zeros(())
        scale = scale_from_amax(amax).reshape(1)
        return to_fp8(x, scale), scale
    if granularity == "token":
        if x.shape[0] == 0:
            return x.to(FP8_DTYPE), x.new_zeros(0)
        scale = scale_from_amax(x.abs().amax(dim=1))  # [T]
        return to_fp8(x, scale[:, None]), scale
    if granularity == "group":
        T, C = x.shape
        padded = _pad_to_block(x, 1)
        scale = scale_from_amax(padded.view(T, padded.shape[1] // BLOCK, BLOCK).abs().amax(dim=2))  # [T, C/B]
        return to_fp8(x, _expand_groups(scale, C, 1)), scale
    raise ValueError(f"unknown activation granularity {granularity!r}; expected tensor, token or group")


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, granularity: str) -> torch.Tensor:
    if granularity == "tensor":
        return q.float() * scale
    if granularity == "token":
        return q.float() * scale[:, None]
    if granularity == "group":
        return q.float() * _expand_groups(scale, q.shape[1], 1)
    raise ValueError(f"unknown activation granularity {granularity!r}; expected tensor, token or group")


def fake_quantize_activation(
    x: torch.Tensor, granularity: str, static_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantize then dequantize: the float32 values an FP8 kernel actually multiplies."""
    q, scale = quantize_activation(x, granularity, static_scale)
    return dequantize_activation(q, scale, granularity)
