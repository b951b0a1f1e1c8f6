"""`moekit check`: every backend's accuracy against a float64 computation of the same quantized problem.

The problem a backend must solve is the one `reference` documents: x quantized by the scheme's
activation rule, GEMM1 with the dequantized w13, SiLU(gate) * up stored in the activations' dtype
(bf16/fp16) and quantized again by the scheme's rule, GEMM2 with the dequantized w2, the top-k
weighted sum. `float64_moe` computes exactly that with float64 arithmetic between the rounding
points (the quantizations use `moekit.quant`, so the FP8 values and scales are the same bits);
each backend's output is compared with it, over several seeds and batch sizes, including M = 1
and a case where some experts receive no tokens.

Metrics per case: relative L2 error ||out - ref|| / ||ref||, max |out - ref| / max |ref|, and the
cosine similarity. A backend passes when every case is within the threshold of its scheme and
class (THRESHOLDS, derived below). The pairwise agreement (relative L2) between backends is
reported too, for information: two correct backends can differ by the sum of their errors.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch
from rich.markup import escape

from . import quant
from .api import fused_moe
from .backends import get_backend
from .backends.reference import expert_groups
from .bench import (
    CPU_MAX_EXPERTS,
    BenchInputError,
    Problem,
    _one_line,
    print_wide,
    cpu_banner,
    default_device,
    environment,
    json_safe,
    parse_batch_sizes,
    parse_dtype,
    parse_names,
    plan_backends,
    check_run_settings,
    prepare_out_dir,
    remove_if_empty,
    remove_superseded,
    resolve_problems,
    write_atomically,
)
from .inputs import input_seed, make_weights, make_x, uniform_routing
from .spec import BLOCK
from .weights import MoEWeights

DEFAULT_BATCH_SIZES = (1, 7, 64)
DEFAULT_SEEDS = 3
# check.json is written only by a complete run; an interrupted one writes what it measured under
# the other name, so that a partial report is never taken for a verdict
RESULT_FILE, PARTIAL_FILE = "check.json", "check.partial.json"
IDLE_EXPERTS_M = 8  # the case where only half of the experts may receive tokens
# Tokens of the routing check (route()'s kernel against its torch ops, routing.agreement), at
# least: the model's own expert count and rule, so a GPU checks what its layers run.
ROUTING_TOKENS = 256
ROUTING_NOT_CHECKED = "the routing kernel runs on a GPU (or under TRITON_INTERPRET=1): not checked here"
# Why `reference` is left out of a default check on a GPU (bench's reason, its timing, is not check's)
REFERENCE_NOT_CHECKED = (
    "the float32 ground truth, not a kernel a model runs: on the GPU checked against float64 only when "
    "named in --backends (the CPU tests check it)"
)

# ----------------------------------------------------------------------------- the thresholds
#
# Rounding of the formats involved (round to nearest, p significant bits): the error of one
# element is at most 2^-p relative; over the values of a binade its RMS is about 2^-p / sqrt(6)
# (uniform absolute error of +-half a spacing, averaged over 1/v^2 for v in [1, 2)).
#   bf16 (p = 8):      at most 2^-8 = 3.9e-3,  RMS ~ 1.6e-3
#   FP8 e4m3 (p = 4):  at most 2^-4 = 6.3e-2,  RMS ~ 2.6e-2 (2^-4 / sqrt(3) = 3.6e-2 at the top of a binade)
# An output element is a dot product of many such independently rounded terms, so a per-element
# relative noise of RMS r in its inputs becomes a relative error of about r in the output (the
# errors add in quadrature exactly as the terms do). Relative L2 therefore measures r directly.
#
# Classes of backends:
#   reference    float32 arithmetic on the same quantized values. Against float64 it differs by
#                float32 accumulation (~1e-6), the bf16 rounding of the output (RMS 1.6e-3, at most
#                3.9e-3 of the element) and, rarely, an intermediate element whose bf16 or FP8
#                rounding flips because float32 landed on the other side of a rounding boundary
#                (probability ~ 1e-6 / 2^-8 per element: invisible in the norms).
#                -> rel L2 <= 4e-3 (the per-element bound 2^-8, which also bounds the RMS);
#                   max rel <= 8e-3 (two bf16 steps of the largest element).
#   kernel       an FP8/bf16 kernel that quantizes as the scheme says (triton, cutlass, ...), compared
#                with the problem including the rounding points it adds by design (BACKEND_NUMERICS
#                below). Besides the reference's errors: another accumulation order (fp32 sums), the
#                per-pair GEMM2 outputs rounded to bf16 before the top-k combine (K more bf16
#                roundings, each of a smaller term: adds ~1.6e-3 RMS), and occasional flips of
#                intermediate FP8 roundings. A flipped element moves by one FP8 step (2^-3
#                relative); a fraction f of flips adds ~ 2^-3 * sqrt(f) to the output's relative
#                error, so 1e-2 tolerates f up to ~0.5 % of the intermediate while any real bug
#                (wrong expert, scale, row or missing quantization: >= 2.6e-2) fails.
#                -> rel L2 <= 1e-2; max rel <= 2.5e-2.
#   kernel-fast  a kernel that leaves FP8 sums to the tensor cores' own accumulator (the triton
#                backend with MOEKIT_FP8_ACCUMULATION=fast, vLLM's numerics). Hopper's FP8 MMA keeps
#                fewer bits than float32 in its running sum, so GEMM1's outputs carry a relative error
#                many times float32's, and far more intermediate values cross an FP8 rounding
#                boundary: measured 1.5-1.7e-2 rel L2 against float64 (H200, Mixtral-8x7B and
#                GLM-4.5V, 64+ row tiles; BENCHMARKS.md fifth session), 1.5-2.1e-2 for vLLM's and
#                CUTLASS's paths (BENCHMARKS.md, Reference points). 3e-2 is 1.4x the worst of those; a wrong expert,
#                scale or row (>= 1e-1) still fails. A missing intermediate quantization (~2.6e-2)
#                would not: the CPU tests check fast mode's code path at the kernel budget (the
#                interpreter sums exactly).
#                -> rel L2 <= 3e-2; max rel <= 6e-2.
#   dequantized  the `torch` backend: weights dequantized, activations NOT quantized. It differs
#                from the quantized problem by the FP8 quantization noise of both GEMM inputs:
#                x (RMS ~2.6e-2, reaching gate and up alike, so ~sqrt(2) x 2.6e-2 in their product
#                at most) and the intermediate (~2.6e-2): sqrt(2 + 1) x 2.6e-2 ~ 4.5e-2 expected,
#                up to ~6.2e-2 if every element sat at the top of its binade (3.6e-2 each).
#                -> rel L2 <= 1e-1; max rel <= 1.5e-1 (the largest output's own error is of the
#                   same relative size, plus the spread of a maximum over M*H Gaussian errors).
# For bf16 (unquantized) schemes no FP8 rounding exists: every class is bounded by the kernel
# budget (bf16 output and per-pair roundings), 1e-2 / 2.5e-2, and the reference by its own.
# fp16 activations round 8x finer than bf16, so these bounds hold for them a fortiori.
# Cosine similarity: 1 - cos ~ rel_l2^2 / 2 for a small error, so min cos = 1 - rel_l2_max^2
# (twice that slack) adds a scale-free check without becoming the binding one.


@dataclasses.dataclass(frozen=True)
class Threshold:
    rel_l2: float
    max_rel: float

    @property
    def min_cos(self) -> float:
        return 1.0 - self.rel_l2**2

    def to_json(self) -> dict:
        return {"rel_l2": self.rel_l2, "max_rel": self.max_rel, "min_cos": self.min_cos}


_REFERENCE = Threshold(rel_l2=4e-3, max_rel=8e-3)
_KERNEL = Threshold(rel_l2=1e-2, max_rel=2.5e-2)
_KERNEL_FAST = Threshold(rel_l2=3e-2, max_rel=6e-2)
_DEQUANTIZED = Threshold(rel_l2=1e-1, max_rel=1.5e-1)
_FP8 = {"reference": _REFERENCE, "kernel": _KERNEL, "kernel-fast": _KERNEL_FAST, "dequantized": _DEQUANTIZED}

THRESHOLDS: dict[str, dict[str, Threshold]] = {
    # also fp16 activations; no FP8 sums, so no fast-accumulation class of its own
    "bf16": {"reference": _REFERENCE, "kernel": _KERNEL, "kernel-fast": _KERNEL, "dequantized": _KERNEL},
    "fp8-tensor-static": _FP8,
    "fp8-tensor-dynamic": _FP8,
    "fp8-channel-token": _FP8,
    "fp8-block128": _FP8,
}
DERIVATION = (
    "Compared with float64 arithmetic on the same quantized problem. reference: bf16 output "
    "rounding, at most 2^-8 = 3.9e-3 per element (RMS 1.6e-3), float32 accumulation ~1e-6 -> "
    "rel L2 4e-3, max rel 8e-3. kernel (FP8/bf16 kernels quantizing as the scheme says): plus "
    "accumulation order, per-pair bf16 rounding before the combine and rare intermediate FP8 "
    "flips (one FP8 step = 2^-3; 1e-2 tolerates ~0.5% flipped elements) -> 1e-2, max rel 2.5e-2; "
    "each kernel is compared with the problem including the rounding points it adds by design "
    "(triton: 1x128-group intermediate for the token rule; cutlass: GEMM1 output stored in bf16 "
    "before SiLU, which alone would cost ~2e-2 against the problem without it). "
    "kernel-fast (FP8 sums in the tensor cores' own accumulator: triton with "
    "MOEKIT_FP8_ACCUMULATION=fast, as vLLM): 1.5-1.7e-2 measured, 1.5-2.1e-2 for vLLM and CUTLASS -> "
    "3e-2, max rel 6e-2. "
    "dequantized (the torch backend, activations not quantized): FP8 e4m3 activation "
    "quantization noise, RMS 2^-4/sqrt(6) = 2.6e-2 (at most 2^-4/sqrt(3) = 3.6e-2) per element, "
    "on x and on the intermediate: ~sqrt(3) x 2.6e-2 = 4.5e-2 -> 1e-1, max rel 1.5e-1. "
    "min cos = 1 - rel_l2^2. See moekit/check.py."
)

# How each backend computes (decides its threshold class); a backend may also say so itself
# with an `accuracy_class` attribute (a value, or a callable taking the scheme). Every other
# backend is a "kernel".
BACKEND_CLASS = {"reference": "reference", "torch": "dequantized"}
# Rounding points a backend adds to the problem, by design (a backend may say so itself with
# attributes of these names: a value, or a callable taking the scheme). Each backend is compared
# with the float64 computation of the problem WITH its own rounding points, so that its threshold
# stays tight enough to catch real bugs:
#   intermediate_granularity  how the GEMM2 input is quantized when not by the scheme's rule: the
#       triton backend declares its own (1x128 groups for the token and group rules, per row in
#       its fast accumulation mode: backends/triton/launch.py).
#   gemm1_output_rounded      GEMM1's output h is stored in the activations' dtype before SiLU: the
#       cutlass backend (its grouped GEMM writes bf16, backends/cutlass.py). Compared with the
#       problem WITHOUT that rounding, it moves the intermediate by ~2^-9 and flips ~1-2 % of its
#       FP8 roundings by one step: rel L2 ~2e-2 (1.8e-2 to 2.6e-2 measured on random layers; what
#       the anchors report for the vLLM and CUTLASS paths: BENCHMARKS.md, Reference points), above a kernel's budget.
BACKEND_NUMERICS: dict[str, dict[str, Any]] = {
    "cutlass": {"gemm1_output_rounded": True},
}


ACCURACY_CLASSES = ("reference", "kernel", "kernel-fast", "dequantized")


def backend_class(name: str, scheme) -> str:
    """The threshold class of backend `name` for `scheme` (its declaration, else BACKEND_CLASS)."""
    cls = _declared(name, "accuracy_class", scheme)
    return cls if cls in ACCURACY_CLASSES else BACKEND_CLASS.get(name, "kernel")


def _declared(name: str, attr: str, scheme):
    value = getattr(get_backend(name), attr, None)
    if callable(value):
        value = value(scheme)
    return value


def intermediate_granularity(name: str, scheme) -> str | None:
    """The rule by which backend `name` quantizes the GEMM2 input, when not the scheme's own."""
    if not scheme.is_fp8 or scheme.static_activation:
        return None
    rule = _declared(name, "intermediate_granularity", scheme)
    if not isinstance(rule, str):
        rule = BACKEND_NUMERICS.get(name, {}).get("intermediate_granularity", {}).get(scheme.activation)
    return None if rule == scheme.activation else rule


def gemm1_output_rounded(name: str, scheme) -> bool:
    """Whether backend `name` stores GEMM1's output in the activations' dtype before SiLU."""
    value = _declared(name, "gemm1_output_rounded", scheme)
    if not isinstance(value, bool):
        value = bool(BACKEND_NUMERICS.get(name, {}).get("gemm1_output_rounded", False))
    return value


def threshold_for(scheme_name: str, cls: str) -> Threshold:
    return THRESHOLDS.get(scheme_name, _FP8)[cls]


# ----------------------------------------------------------------------- float64 computation


def _dequantize_activation64(q: torch.Tensor, scale: torch.Tensor, granularity: str) -> torch.Tensor:
    q, scale = q.double(), scale.double()
    if granularity == "tensor":
        return q * scale
    if granularity == "token":
        return q * scale[:, None]
    if granularity == "group":
        return q * quant._expand_groups(scale, q.shape[1], 1)
    raise ValueError(f"unknown activation granularity {granularity!r}")


def _quantized64(x: torch.Tensor, granularity: str, static_scale: torch.Tensor | None) -> torch.Tensor:
    """The float64 values of x after the scheme's FP8 quantization (same bits as moekit.quant)."""
    q, scale = quant.quantize_activation(x, granularity, static_scale)
    return _dequantize_activation64(q, scale, granularity)


def _expert_weights64(weights: MoEWeights, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's w13 [2N, H] and w2 [H, N] in float64: q * scale, the product taken in float64."""
    g = weights.scheme.weight
    out = []
    for q, scale in ((weights.w13[e], weights.w13_scale), (weights.w2[e], weights.w2_scale)):
        q = q.double()
        if g is None:
            out.append(q)
        elif g == "tensor":
            out.append(q * scale[e].double())
        elif g == "channel":
            out.append(q * scale[e].double()[:, None])
        elif g == "block":
            s = scale[e].double()
            out.append(q * quant._expand_groups(quant._expand_groups(s, q.shape[0], 0), q.shape[1], 1))
        else:
            raise ValueError(f"unknown weight granularity {g!r}")
    return out[0], out[1]


@torch.no_grad()
def float64_moe(
    x: torch.Tensor,
    weights: MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    intermediate_granularity: str | None = None,
    round_gemm1_output: bool = False,
    input_granularity: str | None = None,
) -> torch.Tensor:
    """The layer's quantized problem computed in float64 between its rounding points: [M, H] float64.

    Rounding points (the problem's definition, as `reference_moe`): x quantized by the scheme's
    activation rule; the intermediate stored in x's dtype, then quantized by the activation rule
    (or `intermediate_granularity`); with `round_gemm1_output`, GEMM1's output too is stored in
    x's dtype before SiLU (a backend's own rounding point). `input_granularity` quantizes x by
    another rule than the scheme's (a diagnostic: which rule does a kernel really apply?).
    Everything else is float64."""
    scheme = weights.scheme
    M, K = topk_ids.shape
    N, H = weights.n, weights.hidden
    xq = _quantized64(x, input_granularity or scheme.activation, weights.a13_scale) if scheme.is_fp8 else x.double()
    act = torch.zeros(M * K, N, dtype=torch.float64, device=x.device)
    experts = list(expert_groups(topk_ids, weights.num_experts))
    for e, pairs in experts:
        w13, _ = _expert_weights64(weights, e)
        h = xq[pairs // K] @ w13.T  # [pairs, 2N]
        if round_gemm1_output:
            h = h.to(x.dtype).double()
        act[pairs] = torch.nn.functional.silu(h[:, :N]) * h[:, N:]
    act = act.to(x.dtype)  # the intermediate as every kernel stores it
    if scheme.is_fp8:
        act64 = _quantized64(act, intermediate_granularity or scheme.activation, weights.a2_scale)
    else:
        act64 = act.double()
    out = torch.zeros(M * K, H, dtype=torch.float64, device=x.device)
    for e, pairs in experts:
        _, w2 = _expert_weights64(weights, e)
        out[pairs] = act64[pairs] @ w2.T  # [pairs, H]
    return (out.view(M, K, H) * topk_weights.double()[:, :, None]).sum(dim=1)


def metrics(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """rel_l2, max_rel (max |err| / max |ref|) and cos of out against ref, in float64."""
    out, ref = out.double().reshape(-1), ref.double().reshape(-1)
    err = out - ref
    ref_norm = float(ref.norm())
    out_norm = float(out.norm())
    rel = float(err.norm()) / max(ref_norm, 1e-300)
    max_rel = float(err.abs().max()) / max(float(ref.abs().max()), 1e-300) if ref.numel() else 0.0
    cos = float(out @ ref) / max(out_norm * ref_norm, 1e-300)
    if not all(map(math.isfinite, (rel, max_rel, cos))):
        rel, max_rel, cos = math.inf, math.inf, -1.0
    return {"rel_l2": rel, "max_rel": max_rel, "cos": cos}


# ------------------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    batch_size: int
    seed: int
    pool: tuple[int, ...] | None = None  # experts allowed to receive tokens (None: all)

    @property
    def label(self) -> str:
        idle = f", routed within {len(self.pool)} experts" if self.pool is not None else ""
        return f"M={self.batch_size}, seed {self.seed}{idle}"


def make_cases(batch_sizes: Sequence[int], seeds: int, base_seed: int, num_experts: int, top_k: int) -> list[Case]:
    """Every batch size x every seed, plus one case per seed where some experts get no tokens
    (routing restricted to a random half of the experts; impossible when top-k = E)."""
    cases = []
    for s in range(seeds):
        seed = base_seed + s
        cases += [Case(M, seed) for M in batch_sizes]
        pool_size = max(top_k, num_experts // 2)
        if pool_size < num_experts:
            g = torch.Generator().manual_seed(seed + 7919)
            pool = tuple(sorted(torch.randperm(num_experts, generator=g)[:pool_size].tolist()))
            cases.append(Case(IDLE_EXPERTS_M, seed, pool))
    return cases


# ------------------------------------------------------------------------------------- check


@dataclasses.dataclass
class CheckOptions:
    models: list[str]
    tp: int = 1
    scheme: str | None = None
    batch_sizes: list[str] | None = None
    backends: list[str] | None = None
    seeds: int = DEFAULT_SEEDS
    seed: int = 0
    out: str | None = None
    dtype: str = "bf16"
    overwrite: bool = False  # replace an earlier run's report in `out`
    argv: list[str] | None = None


@dataclasses.dataclass
class CheckReport:
    passed: bool
    out_dir: Path
    files: list[Path]
    report: dict
    interrupted: bool = False  # Ctrl-C: `files` is PARTIAL_FILE, with the cases checked before it


def run_check(opts: CheckOptions, console=None) -> CheckReport:
    """The whole `moekit check`; BenchInputError for bad input (nothing written)."""
    from rich.console import Console

    console = console or Console()
    device = default_device()
    check_run_settings(opts.seed)
    if not isinstance(opts.seeds, int) or opts.seeds < 1:
        raise BenchInputError(f"--seeds must be a positive integer, got {opts.seeds!r}")
    dtype = parse_dtype(opts.dtype)
    batch_sizes = parse_batch_sizes(opts.batch_sizes, DEFAULT_BATCH_SIZES)
    problems = resolve_problems(opts.models, opts.tp, opts.scheme, device)
    requested = parse_names(opts.backends)
    if requested and "auto" in requested:
        raise BenchInputError("--backends: check runs named backends; 'auto' is not one (it runs one of them)")
    plan = plan_backends(problems, requested, device, dtype, include_auto=False, reference_note=REFERENCE_NOT_CHECKED)
    out_dir, created = prepare_out_dir(opts.out, "check", results=(RESULT_FILE, PARTIAL_FILE), overwrite=opts.overwrite)
    try:
        return _run(opts, console, device, dtype, batch_sizes, problems, plan, out_dir)
    except BaseException:
        if created:
            remove_if_empty([out_dir])
        raise


def _run(opts, console, device, dtype, batch_sizes, problems: list[Problem], plan, out_dir: Path) -> CheckReport:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if device.type != "cuda":
        # bench's banner, speaking of checks: check times nothing
        console.print(cpu_banner(batch_sizes, "checking on the CPU, on",
                                 ": the kernels a GPU runs, at the model's own shape, are not checked here"),
                      style="bold yellow", highlight=False)
    meta = environment(device, opts.argv)
    console.print(f"device: {meta['device']}; torch {meta['torch']}, moekit {meta['moekit']}", highlight=False)

    models_out = []
    all_passed = True
    unchecked: list[str] = []  # models no backend could be checked on: no pass without a check
    interrupted = False
    for pi, p in enumerate(problems):
        names = plan.per_problem[p.name]
        console.print(f"{p.describe()}: checking {', '.join(names) or 'no backend'}", highlight=False)
        if not names:
            unchecked.append(p.name)
            all_passed = False
        for name, reasons in plan.skipped[p.name].items():
            console.print(f"  skipped {name}: {'; '.join(reasons)}", highlight=False)
        cases = make_cases(batch_sizes, opts.seeds, opts.seed, p.shape.num_experts, p.shape.top_k)
        per_backend: dict[str, dict[str, Any]] = {
            name: {"class": backend_class(name, p.scheme),
                   "problem": {"intermediate_granularity": intermediate_granularity(name, p.scheme),
                               "gemm1_output_rounded": gemm1_output_rounded(name, p.scheme)},
                   "cases": [], "errors": []}
            for name in names
        }
        pair_worst: dict[tuple[str, str], float] = {}
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console, transient=True)
        weights = None
        try:
            weights = make_weights(p.shape, p.scheme, device, seed=opts.seed + 1000 * pi, dtype=dtype)
            with progress:
                task = progress.add_task(p.name, total=len(cases) * len(names))
                for case in cases:
                    x = make_x(case.batch_size, p.shape.hidden, device, seed=input_seed(case.seed, case.batch_size), dtype=dtype)
                    tw, ids = uniform_routing(case.batch_size, p.shape.num_experts, p.shape.top_k,
                                              seed=input_seed(case.seed, case.batch_size), pool=case.pool,
                                              renormalize=p.spec.routing.renormalize)
                    tw, ids = tw.to(device), ids.to(device)
                    used = int(ids.unique().numel())  # experts that got tokens (fewer than E at small M)
                    # Llama-4 scales the input, not the output: the truth is computed on the
                    # input fused_moe hands its backend, with weights of one
                    truth_x, truth_tw = p.backend_inputs(x, tw)
                    truths: dict[tuple, torch.Tensor] = {}
                    outputs: dict[str, torch.Tensor] = {}
                    for name in names:
                        progress.update(task, description=f"{p.name} {case.label} {name}")
                        info = per_backend[name]
                        variant = (info["problem"]["intermediate_granularity"], info["problem"]["gemm1_output_rounded"])
                        if variant not in truths:
                            truths[variant] = float64_moe(truth_x, weights, truth_tw, ids, *variant)
                        try:
                            with torch.no_grad():
                                out = fused_moe(x, weights, tw, ids, backend=name,
                                                apply_router_weight_on_input=p.apply_on_input)
                            if out.shape != x.shape:
                                raise ValueError(f"output has shape {tuple(out.shape)}, expected {tuple(x.shape)}")
                        except Exception as e:  # noqa: BLE001 - a backend that raises fails the check
                            info["errors"].append(f"{case.label}: {type(e).__name__}: {_one_line(e)[:200]}")
                            progress.advance(task)
                            continue
                        m = metrics(out, truths[variant])
                        thr = threshold_for(p.scheme.name, info["class"])
                        m["passed"] = m["rel_l2"] <= thr.rel_l2 and m["max_rel"] <= thr.max_rel and m["cos"] >= thr.min_cos
                        info["cases"].append({"batch_size": case.batch_size, "seed": case.seed,
                                              "experts_used": used,
                                              **m})
                        outputs[name] = out
                        progress.advance(task)
                    done = list(outputs)
                    for i, a in enumerate(done):
                        for b in done[i + 1 :]:
                            d = metrics(outputs[a], outputs[b])["rel_l2"]
                            pair_worst[(a, b)] = max(pair_worst.get((a, b), 0.0), d)
                    del x, tw, ids, truths, outputs
        except KeyboardInterrupt:  # report the cases checked so far (under PARTIAL_FILE), then stop
            interrupted = True
        weights = None
        if interrupted and not any(info["cases"] or info["errors"] for info in per_backend.values()):
            break  # nothing of this model was checked

        backends_out = []
        for name, info in per_backend.items():
            thr = threshold_for(p.scheme.name, info["class"])
            cs = info["cases"]
            worst = {
                "rel_l2": max((c["rel_l2"] for c in cs), default=None),
                "max_rel": max((c["max_rel"] for c in cs), default=None),
                "cos": min((c["cos"] for c in cs), default=None),
            }
            passed = not info["errors"] and bool(cs) and all(c["passed"] for c in cs)
            all_passed &= passed
            backends_out.append({
                "backend": name, "class": info["class"], "problem": info["problem"],
                "threshold": thr.to_json(), "worst": worst, "passed": passed, "errors": info["errors"],
                "cases": cs,
            })
        routing = None
        if not interrupted:
            try:
                routing = _check_routing(p, device, batch_sizes, opts.seed)
            except KeyboardInterrupt:  # as during the backends': this model's report, then stop
                interrupted = True
        if routing is not None and "passed" in routing:
            all_passed &= routing["passed"]
        models_out.append({
            **p.to_json(),
            "cases": [{"batch_size": c.batch_size, "seed": c.seed, "expert_pool": list(c.pool) if c.pool else None}
                      for c in cases],
            "backends": backends_out,
            "pairwise_rel_l2": [{"a": a, "b": b, "worst_rel_l2": v} for (a, b), v in pair_worst.items()],
            "skipped_backends": plan.skipped[p.name],
            "routing": routing,
        })
        _print_model(console, p, backends_out, pair_worst)
        if routing is not None:
            _print_routing(console, routing)
        if interrupted:
            break
    if interrupted and not models_out:
        raise KeyboardInterrupt  # nothing checked, nothing to write

    meta.update(tool="moekit check", dtype=opts.dtype, seeds=opts.seeds, seed=opts.seed, batch_sizes=batch_sizes,
                complete=not interrupted,
                cpu_scaled_down=device.type != "cuda", idle_experts_batch_size=IDLE_EXPERTS_M,
                max_experts_on_cpu=CPU_MAX_EXPERTS, block=BLOCK)
    report = {
        "metadata": meta,
        "passed": None if interrupted else all_passed,  # no verdict on part of the cases
        "thresholds": {s: {c: t.to_json() for c, t in d.items()} for s, d in THRESHOLDS.items()},
        "threshold_derivation": DERIVATION,
        "metrics": {
            "rel_l2": "||out - ref||_2 / ||ref||_2, ref = float64 computation of the same quantized problem",
            "max_rel": "max |out - ref| / max |ref|",
            "cos": "cosine similarity of out and ref",
        },
        "models": models_out,
    }

    def write_json(path: Path):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(json_safe(report), f, indent=2, ensure_ascii=False, allow_nan=False)
            f.write("\n")

    if interrupted:
        files = write_atomically(out_dir, {PARTIAL_FILE: write_json})
        remove_superseded(out_dir, (RESULT_FILE,), (PARTIAL_FILE,))  # an earlier complete run's (--overwrite)
        console.print(f"interrupted: wrote the cases checked so far to {files[0]} (no verdict)", highlight=False, markup=False,
                      soft_wrap=True)
        return CheckReport(False, out_dir, files, report, interrupted=True)
    files = write_atomically(out_dir, {RESULT_FILE: write_json})
    (out_dir / PARTIAL_FILE).unlink(missing_ok=True)  # an earlier interrupted run's (--overwrite): superseded
    wrong_routing = [m["name"] for m in models_out if (m["routing"] or {}).get("passed") is False]
    routing_note = f"; the routing kernel FAILS on {', '.join(wrong_routing)}" if wrong_routing else ""
    if all_passed:
        verdict = "[green]all backends pass[/]"
    elif all(b["passed"] for m in models_out for b in m["backends"]):
        reasons = ([f"no backend could be checked on {', '.join(unchecked)}"] if unchecked else []) + \
            ([f"the routing kernel FAILS on {', '.join(wrong_routing)}"] if wrong_routing else [])
        verdict = f"[red]FAIL: {'; '.join(reasons)}[/]"
    else:
        verdict = "[red]some backends FAIL[/]" + (f" (none checked on {', '.join(unchecked)})" if unchecked else "") \
            + routing_note
    console.print(f"{verdict}; wrote {escape(str(files[0]))}", highlight=False)
    return CheckReport(all_passed, out_dir, files, report)


def _check_routing(p: Problem, device: torch.device, batch_sizes: Sequence[int], seed: int) -> dict:
    """route()'s kernel against its torch ops at the model's own expert count and routing rule
    (routing.agreement), on max(batch sizes, ROUTING_TOKENS) tokens; where the kernel cannot run
    here, why not. A wrong expert or weight fails the check like a failing backend."""
    from . import env
    from .routing import agreement

    config, num_experts = p.spec.routing, p.spec.shape.num_experts
    if device.type != "cuda" and not env.interpreting():
        return {"skipped": ROUTING_NOT_CHECKED}
    try:
        result = agreement.check_route_kernel(config, num_experts, max(*batch_sizes, ROUTING_TOKENS), device, seed)
    except Exception as e:  # noqa: BLE001 - a kernel that raises fails the check
        return {"passed": False, "error": f"{type(e).__name__}: {_one_line(e)[:200]}"}
    return result.to_json()


def _fmt_rel(value) -> str:
    return "-" if value is None else format(value, ".1e")


def _print_routing(console, routing: dict) -> None:
    if "skipped" in routing:
        console.print(f"routing: {routing['skipped']}", highlight=False)
        return
    if "error" in routing:
        console.print(f"routing kernel: [red]FAIL[/] ({routing['error']})", highlight=False)
        return
    result = "[green]pass[/]" if routing["passed"] else "[red]FAIL[/]"
    console.print(
        f"routing kernel vs torch ops: the same experts on {routing['same']} of {routing['tokens']} tokens, "
        f"{routing['near_ties']} near-ties, {routing['disagree']} wrong; weights within "
        f"{_fmt_rel(routing['worst_weight_rel'])} (limit {routing['tolerances']['weight_rtol']:.0e}): {result}",
        highlight=False)


def _print_model(console, p: Problem, backends_out: list[dict], pair_worst: dict) -> None:
    from rich import box
    from rich.table import Table

    table = Table(title=escape(f"{p.name} ({p.scheme.name}, {p.shape.describe()}) vs float64"), box=box.SIMPLE_HEAD)
    for h in ("backend", "class", "own rounding", "worst rel L2", "limit", "worst max rel", "limit", "min cos",
              "limit", "result"):
        table.add_column(h, justify="left" if h in ("backend", "class", "own rounding", "result") else "right")

    def f(v, spec=".2e"):
        return "-" if v is None else format(v, spec)

    for b in backends_out:
        t, w = b["threshold"], b["worst"]
        result = "[green]pass[/]" if b["passed"] else "[red]FAIL[/]"
        if b["errors"]:
            result += f" ({len(b['errors'])} errors)"
        own = [f"{b['problem']['intermediate_granularity']} intermediate"] if b["problem"]["intermediate_granularity"] else []
        own += ["GEMM1 out in bf16"] if b["problem"]["gemm1_output_rounded"] else []
        table.add_row(b["backend"], b["class"], ", ".join(own) or "-", f(w["rel_l2"]), f(t["rel_l2"], ".0e"), f(w["max_rel"]),
                      f(t["max_rel"], ".1e"), f(w["cos"], ".6f"), f(t["min_cos"], ".6f"), result)
    print_wide(console, table)
    for b in backends_out:
        for err in b["errors"][:3]:
            console.print(f"  {b['backend']} error: {escape(err)}", highlight=False)
    if pair_worst:
        pairs = ", ".join(f"{a}~{b} {v:.1e}" for (a, b), v in pair_worst.items())
        console.print(f"pairwise agreement (worst rel L2): {pairs}", highlight=False)


__all__ = ["THRESHOLDS", "Threshold", "CheckOptions", "CheckReport", "float64_moe", "metrics", "run_check"]
