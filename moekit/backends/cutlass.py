"""`cutlass`: FP8 expert GEMMs through PyTorch's CUTLASS grouped GEMM with row-wise scales
(`torch.nn.functional.scaled_grouped_mm` where this torch has it, else `torch._scaled_grouped_mm`),
between the Triton glue of `glue/` (permute + FP8 quantization, SiLU-and-mul + requantization,
deterministic combine).

    a, a_scale = permute + quantize x          FP8 [R, H], float32 [R]
    h = scaled_grouped_mm(a, w13^T)            bf16 [R, 2N]  (scale_a [R], scale_b [E, 2N])
    act, act_scale = SiLU(gate) * up, requantized   FP8 [R, N], float32 [R]
    y = scaled_grouped_mm(act, w2^T)           bf16 [R, H]   (scale_a [R], scale_b [E, H])
    out = combine(y, topk_weights)             bf16 [M, H]

Scales: the kernel takes one float32 scale per row of A and one per output column of each
expert's B. Per-token activations and per-channel weights are exactly that; per-tensor scales
(static, or dynamic = one amax over all of x / all M*K intermediate rows) are written out per row
(activations) or per column (weights), the same number everywhere. Groups are the experts, rows
sorted by expert with each group padded to 16 rows (older torch kernels assert it), the
`offs` (int32 cumulative group ends) computed on the GPU: no host sync, capturable into CUDA graphs.

Weights are used in the layout the kernel wants without any copy: mat_b must be column-major
[E, K, N], which `w13.transpose(1, 2)` of the contiguous [E, 2N, H] tensor already is (MoEWeights
refuses tensors that are not contiguous).
What is derived (expanded scales, the transposed views) is built once in weights.prepared["cutlass"].

Numerics, compared with `reference`: identical FP8 inputs of GEMM1; the kernel accumulates in
float32 (in its own order) and rounds h to bf16 before the SiLU, where the reference keeps h in
float32. That rounding moves the intermediate by ~2**-9 relative, which flips the FP8 rounding of
a small fraction of its elements by one FP8 step; y is rounded to bf16 before the combine.
"""

from __future__ import annotations

import dataclasses

import torch

from ..spec import MoEShape, QuantScheme
from ..weights import MoEWeights
from . import glue
from .base import Backend, device_capability

MAX_EXPERTS = glue.GROUPED_GEMM_MAX_GROUPS


# --------------------------------------------------------------------------------- the GEMM


def _v2_call(a, b, scale_a, scale_b, offs):
    F = torch.nn.functional
    return F.scaled_grouped_mm(
        a, b, scale_a, F.ScalingType.RowWise, scale_b, F.ScalingType.RowWise,
        offs=offs, output_dtype=torch.bfloat16,
    )


def _v1_call(a, b, scale_a, scale_b, offs):
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)


def gemm_candidates() -> list[tuple[str, object]]:
    """The row-wise scaled grouped GEMMs this torch has, preferred first: (name, fn) with
    fn(a FP8 [R, K], b FP8 [E, K, N] column-major, scale_a f32 [R], scale_b f32 [E, N],
    offs int32 [E]) -> bf16 [R, N]."""
    F = torch.nn.functional
    found = []
    scaling = getattr(F, "ScalingType", None)
    if hasattr(F, "scaled_grouped_mm") and scaling is not None and hasattr(scaling, "RowWise"):
        found.append(("torch.nn.functional.scaled_grouped_mm", _v2_call))
    if hasattr(torch, "_scaled_grouped_mm"):
        found.append(("torch._scaled_grouped_mm", _v1_call))
    return found


_chosen: dict[torch.device, tuple[str, object]] = {}


def gemm_for(device: torch.device) -> tuple[str, object]:
    """The scaled grouped GEMM to use on `device`: the first candidate that runs and gets a small
    problem right (checked once per device, outside CUDA-graph capture), so that an API that
    exists but behaves differently in some torch version is passed over rather than trusted."""
    device = torch.device(device)
    if device in _chosen:
        return _chosen[device]
    candidates = gemm_candidates()
    if not candidates:
        raise RuntimeError(f"this torch ({torch.__version__}) has no _scaled_grouped_mm")
    if device.type != "cuda" or len(candidates) == 1 or torch.cuda.is_current_stream_capturing():
        return candidates[0]  # nothing to probe with (not cached: a later eager call probes)
    errors = []
    for name, fn in candidates:
        try:
            if _probe(fn, device):
                _chosen[device] = (name, fn)
                return _chosen[device]
            errors.append(f"{name}: wrong result on a probe problem")
        except Exception as exc:  # noqa: BLE001 - any failure passes to the next candidate
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    raise RuntimeError("no scaled grouped GEMM of this torch works: " + "; ".join(errors))


def _probe(fn, device) -> bool:
    g = torch.Generator(device="cpu").manual_seed(0)
    E, R, K, N = 2, 48, 32, 32
    a = torch.randn(R, K, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(E, N, K, generator=g).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(R, generator=g) + 0.5, torch.rand(E, N, generator=g) + 0.5
    offs = torch.tensor([16, 48], dtype=torch.int32)
    got = fn(a.to(device), w.to(device).transpose(1, 2), sa.to(device), sb.to(device), offs.to(device))
    want = torch.cat([a[:16].float() @ w[0].float().T * sb[0], a[16:].float() @ w[1].float().T * sb[1]]) * sa[:, None]
    return bool(((got.float().cpu() - want).abs() <= 1e-2 * want.abs() + 1e-2).all())


# ------------------------------------------------------------------------------ preparation


@dataclasses.dataclass
class Prepared:
    w13_t: torch.Tensor  # FP8 [E, H, 2N] column-major: w13.transpose(1, 2), a view
    w2_t: torch.Tensor  # FP8 [E, N, H] column-major: w2.transpose(1, 2), a view
    w13_scale: torch.Tensor  # float32 [E, 2N]: per output column of GEMM1
    w2_scale: torch.Tensor  # float32 [E, H]: per output column of GEMM2


def prepare(weights: MoEWeights) -> Prepared:
    """Derived state of the weights, built once and kept in weights.prepared["cutlass"] (per-tensor
    scales written in place are expanded again into the same memory: MoEWeights.prepared_state).
    MoEWeights holds contiguous tensors only, so the transposed views are column-major as they
    are: no copy of the weights is ever made here."""
    E, two_n, H = weights.w13.shape
    per_tensor = weights.scheme.weight == "tensor"

    def per_column(scale, cols):
        if per_tensor:  # [E] -> [E, cols]
            return scale[:, None].expand(E, cols).contiguous()
        return scale  # channel: [E, cols] already (contiguous, as MoEWeights requires)

    def build() -> Prepared:
        return Prepared(weights.w13.transpose(1, 2), weights.w2.transpose(1, 2),
                        per_column(weights.w13_scale, two_n), per_column(weights.w2_scale, H))

    def refresh(p: Prepared) -> None:
        if per_tensor:  # the expanded scales are copies; everything else is a view of the weights
            p.w13_scale.copy_(weights.w13_scale[:, None].expand_as(p.w13_scale))
            p.w2_scale.copy_(weights.w2_scale[:, None].expand_as(p.w2_scale))

    return weights.prepared_state("cutlass", build, refresh)


# --------------------------------------------------------------------------------- backend


class CutlassBackend(Backend):
    name = "cutlass"
    description = "PyTorch's CUTLASS FP8 grouped GEMM (SM90), row-wise scales, Triton glue"
    # the glue's first kernel (glue.permute's _rank_kernel) asserts the ids on a GPU, in their own
    # dtype, int32 or int64: fused_moe launches no check and no narrowing for this backend
    checks_expert_ids = True
    reads_int64_ids = True

    def supports(self, shape: MoEShape, scheme: QuantScheme, device: torch.device, dtype=torch.bfloat16):
        reasons = []
        if device.type != "cuda":
            reasons.append(f"needs a CUDA device, got {device.type}")
        else:
            cap = device_capability(device)
            if cap is None:
                reasons.append("needs a CUDA device, but CUDA is not available")
            elif cap != (9, 0):
                reasons.append(f"needs SM90 (Hopper), found sm_{cap[0]}{cap[1]}")
        if not gemm_candidates():
            reasons.append(f"this torch ({torch.__version__}) has no _scaled_grouped_mm")
        glue_refusal = glue.unavailable_on(device)
        if glue_refusal:
            reasons.append(glue_refusal)
        if not scheme.is_fp8:
            reasons.append(
                f"scheme {scheme.name} is unquantized and this backend runs FP8 GEMMs only: "
                "use the `torch` backend (grouped_mm)"
            )
        elif scheme.weight == "block":
            reasons.append("128x128 block weights are not supported by torch's scaled grouped GEMM on Hopper")
        elif scheme.weight not in ("tensor", "channel") or scheme.activation not in ("tensor", "token"):
            reasons.append(
                f"scheme {scheme.name} ({scheme.weight} weights, {scheme.activation} activations) "
                "has no row-wise form"
            )
        if shape.hidden % 16:
            reasons.append(f"hidden {shape.hidden} is not a multiple of 16")
        if shape.n % 16:
            reasons.append(f"intermediate size per GPU {shape.n} is not a multiple of 16")
        if shape.num_experts > MAX_EXPERTS:
            reasons.append(f"{shape.num_experts} experts: torch's grouped GEMM takes at most {MAX_EXPERTS}")
        if dtype != torch.bfloat16:
            reasons.append(f"activations must be bfloat16 (the grouped GEMM's output dtype), got {dtype}")
        return reasons

    def run(self, x, weights: MoEWeights, topk_weights, topk_ids):
        return run_cutlass(x, weights, topk_weights, topk_ids)

    def compile_ahead(self, x, weights: MoEWeights, topk_weights, topk_ids):
        """The glue's Triton kernels (the grouped GEMM is built ahead of time, in torch): the
        GEMMs not run, their outputs empty of the right shapes."""
        run_cutlass(x, weights, topk_weights, topk_ids, gemm=_shape_only_gemm)
        return True

    def prepare_gemm_only(self, x, weights: MoEWeights, topk_weights, topk_ids):
        """A closure running only the two grouped GEMMs on rows already permuted and quantized
        (the intermediate computed once, outside): what `moekit bench --mode gemm` times, and
        the definition of the anchor table's `cutlass` GEMM column."""
        p = prepare(weights)
        gemm = gemm_for(x.device)[1]
        quant = "token" if weights.scheme.activation == "token" else "tensor"
        a, a_scale, layout = glue.permute(
            x, topk_ids, weights.num_experts, align=glue.ALIGN_M, quant=quant, static_scale=weights.a13_scale
        )
        h = gemm(a, p.w13_t, a_scale, p.w13_scale, layout.offs)
        act, act_scale = glue.silu_mul(h, layout, act_dtype=x.dtype, quant=quant, static_scale=weights.a2_scale)
        del h

        def run_gemms():
            gemm(a, p.w13_t, a_scale, p.w13_scale, layout.offs)
            return gemm(act, p.w2_t, act_scale, p.w2_scale, layout.offs)

        return run_gemms


def run_cutlass(x, weights: MoEWeights, topk_weights, topk_ids, *, gemm=None, impl=None):
    """The cutlass computation. `gemm` (a `gemm_candidates()` fn) and `impl` (the glue's) default
    to what the device uses; tests pass an emulated GEMM to run the wiring on the CPU."""
    p = prepare(weights)
    if gemm is None:
        gemm = gemm_for(x.device)[1]
    scheme = weights.scheme
    quant = "token" if scheme.activation == "token" else "tensor"
    a, a_scale, layout = glue.permute(
        x, topk_ids, weights.num_experts, align=glue.ALIGN_M, quant=quant,
        static_scale=weights.a13_scale, impl=impl,
    )
    h = gemm(a, p.w13_t, a_scale, p.w13_scale, layout.offs)  # bf16 [R, 2N]
    act, act_scale = glue.silu_mul(h, layout, act_dtype=x.dtype, quant=quant, static_scale=weights.a2_scale)
    y = gemm(act, p.w2_t, act_scale, p.w2_scale, layout.offs)  # bf16 [R, H]
    return glue.combine(y, layout, topk_weights, out_dtype=x.dtype)


def _shape_only_gemm(a, w_t, a_scale, w_scale, offs):
    """A grouped GEMM's output [R, N] of bf16, uncomputed: what compile_ahead passes for the GEMM,
    whose offsets (the glue's, never computed there) it must not read."""
    return torch.empty(a.shape[0], w_t.shape[-1], dtype=torch.bfloat16, device=a.device)
