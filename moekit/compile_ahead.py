"""Compiling the triton backend's kernels before serving: `moekit.warmup`, `MoELayer.warmup` and
`moekit warmup`.

Triton compiles a kernel again for every new specialization of its arguments: an integer
argument is specialized on being 1 and on being a multiple of 16, and the launch code derives
compile-time constants from the batch size (the alignment's chunk count rounded to a power of
two, the GEMV or the tiled path, and the tuned config of the nearest batch size, each config its
own kernels). So a server meeting a batch size of a new class compiles during that request: a
few seconds per kernel on a Hopper host where Triton's on-disk cache does not have it yet.

`warmup` runs, at each batch size asked for, the launch code of the backend that size runs on
(auto's choice per size, or the one named) inside `compile_only()` (backends/compile_only.py):
every Triton kernel that size would launch is compiled (kept in this process and in Triton's
on-disk cache, where a later process finds it) and none is launched. That is the triton
backend's kernels, or for cutlass and torch the Triton glue they share (permutation and
quantization, SiLU-and-mul, combine; their GEMMs are torch's, built ahead of time and not run
here), and fused_moe's own id narrowing and range check where the backend needs them. The
inputs are empty tensors, nothing is computed, and a size whose kernels are all compiled
already costs host time only. MoELayer.warmup also runs moekit.route's kernel (warm_routing)
where the layer routes its own logits.

The kernels depend on the GPU model (its tuned tables pick the configs) and on the environment
(MOEKIT_FP8_ACCUMULATION, MOEKIT_PDL, MOEKIT_CONFIG_DIR, MOEKIT_BACKEND): warm on the serving GPU
model, with the server's environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from .weights import MoEWeights

# The largest batch size warmup takes: every size up to it is run, a few hundred µs of host time
# each once compiled, so 65536 is under a minute of host time.
MAX_WARMUP_BATCH = 65536


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    sizes: dict[str, tuple[int, ...]]  # backend -> the batch sizes that run on it (auto's choice, or the one named)
    # those whose own launch code ran, compiling (reference has no Triton kernels of its own; fused_moe's
    # id narrowing and check, which it needs on a GPU, are compiled for every backend that needs them)
    compiled: tuple[str, ...]
    # kernel variants this call added to this process's Triton caches: compiled, or loaded from
    # Triton's on-disk cache (a second process finds them there); None: this Triton's caches unreadable
    new_variants: int | None
    seconds: float

    @property
    def triton_sizes(self) -> tuple[int, ...]:
        """The sizes that run on the triton backend."""
        return self.sizes.get("triton", ())


def batch_sizes_to_warm(max_batch_size: int | None, batch_sizes: Sequence[int] | None) -> list[int]:
    """The sizes to run: 1 ... max_batch_size, or the ones given (sorted, once each). ValueError
    naming what is wrong: neither or both given, a size not a positive integer, or above
    MAX_WARMUP_BATCH."""
    if (max_batch_size is None) == (batch_sizes is None):
        raise ValueError("give max_batch_size (every size from 1 to it) or batch_sizes, not both or neither")
    sizes = list(range(1, _positive("max_batch_size", max_batch_size) + 1)) if batch_sizes is None else [
        _positive("batch size", m) for m in batch_sizes]
    if not sizes:
        raise ValueError("batch_sizes is empty: give at least one positive batch size")
    if max(sizes) > MAX_WARMUP_BATCH:
        raise ValueError(f"batch size {max(sizes)} is above {MAX_WARMUP_BATCH} (moekit.compile_ahead.MAX_WARMUP_BATCH)")
    return sorted(set(sizes))


def _positive(what: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def warmup(
    weights: MoEWeights,
    top_k: int,
    max_batch_size: int | None = None,
    *,
    batch_sizes: Sequence[int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    backend: str | None = "auto",
    ids_dtypes: torch.dtype | Sequence[torch.dtype] = (torch.int32, torch.int64),
    allow_weight_copies: bool = True,
    on_size: Callable[[int], object] | None = None,
) -> WarmupReport:
    """Compile every Triton kernel a `fused_moe(x, weights, ...)` call with `top_k` experts per
    token and x of `dtype` would launch at each batch size (1 ... max_batch_size, or
    `batch_sizes`), launching none (module docstring). `backend` as fused_moe takes it: "auto"
    (MOEKIT_BACKEND first) warms each size's choice; a name, that backend at every size.
    `ids_dtypes`: the dtype of the calls' topk_ids, or a sequence of them, each its own kernels
    (moekit's router gives int32, transformers' routers int64; both by default). `dtype` is
    refused (ValueError) where fused_moe would refuse x of it. `allow_weight_copies` as fused_moe takes
    it (a MoELayer's and transformers models' calls pass False). `on_size(M)` is called after each size
    (a progress bar). Largest size first: its workspace, freed, holds every smaller size's, so the
    caching allocator reserves no more than one call's."""
    from .api import check_weight_dtype, ids_for_backend
    from .backends import get_backend
    from .backends.compile_only import compile_only
    from .dtypes import as_torch_dtype, check_fused_moe_dtype
    from .select import select_backend

    dtype = as_torch_dtype(dtype)  # "bf16" as select_backend and MoELayer.warmup take it
    check_fused_moe_dtype(dtype)  # float64 was reported warmed on reference, for x fused_moe refuses
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights must be a moekit.MoEWeights, got {type(weights).__name__}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= weights.num_experts:
        raise ValueError(f"top_k must be an integer in [1, {weights.num_experts}] (the experts), got {top_k!r}")
    sizes = batch_sizes_to_warm(max_batch_size, batch_sizes)
    check_weight_dtype(dtype, weights)
    if isinstance(ids_dtypes, torch.dtype):  # one dtype, as `dtype` takes it (it failed as "not iterable")
        ids_dtypes = (ids_dtypes,)
    if isinstance(ids_dtypes, str) or not isinstance(ids_dtypes, Iterable):
        raise TypeError(f"ids_dtypes must be torch.int32, torch.int64 or a sequence of them, got "
                        f"{type(ids_dtypes).__name__} {ids_dtypes!r}")
    ids_dtypes = list(dict.fromkeys(ids_dtypes))
    if not ids_dtypes or any(d not in (torch.int32, torch.int64) for d in ids_dtypes):
        raise ValueError(f"ids_dtypes must name torch.int32 and/or torch.int64 (the topk_ids dtypes), got {ids_dtypes}")
    shape, device = weights.shape(top_k), weights.device
    by_backend: dict[str, list[int]] = {}
    for M in sizes:  # select_backend raises BackendUnavailableError, with reasons, for a named one that cannot run
        name = select_backend(shape, weights.scheme, device, dtype, M, backend,
                              allow_weight_copies=allow_weight_copies).backend
        by_backend.setdefault(name, []).append(M)
    start, before = time.perf_counter(), compiled_variants()
    largest = sizes[-1]
    x = torch.empty(largest, shape.hidden, dtype=dtype, device=device)
    topk_weights = torch.empty(largest, top_k, dtype=torch.float32, device=device)
    ids = {d: torch.empty(largest, top_k, dtype=d, device=device) for d in ids_dtypes}
    compiled = []
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device, compile_only(), torch.no_grad():  # Triton keeps kernels per current device
        for name, backend_sizes in by_backend.items():
            impl, ran = get_backend(name), False
            for M in reversed(backend_sizes):  # the first M rows: contiguous views, as a real call's inputs
                for topk_ids in ids.values():
                    ids_m = ids_for_backend(impl, topk_ids[:M], weights.num_experts)
                    ran = impl.compile_ahead(x[:M], weights, topk_weights[:M], ids_m) or ran
                if on_size is not None:
                    on_size(M)
            if ran:
                compiled.append(name)
    after = compiled_variants()
    new_variants = None if before is None or after is None else after - before
    return WarmupReport({k: tuple(v) for k, v in by_backend.items()}, tuple(compiled), new_variants,
                        time.perf_counter() - start)


def warm_routing(config, num_experts: int, sizes: Sequence[int], device: torch.device,
                 logits_dtypes: Sequence[torch.dtype], correction_bias: torch.Tensor | None = None) -> None:
    """Compile moekit.route's kernel for `config` at the batch-size classes among `sizes` (the
    kernel's only size-dependent argument is the token count: 1, a multiple of 16, or another)
    and each logits dtype, by running it on zero logits (a few µs each; it is launched: route has
    no compile-only path). Nothing on the CPU, where route runs its torch ops."""
    from .routing import route

    if device.type != "cuda":
        return
    with torch.no_grad():
        for dt in dict.fromkeys(logits_dtypes):
            for M in size_classes(sizes):
                route(torch.zeros(M, num_experts, dtype=dt, device=device), config=config,
                      correction_bias=correction_bias)


def size_classes(sizes: Sequence[int]) -> list[int]:
    """One size of each class Triton specializes an integer on (1; a multiple of 16; any other),
    the first of each among `sizes`."""
    classes: dict[tuple[bool, bool], int] = {}
    for M in sizes:
        classes.setdefault((M == 1, M % 16 == 0), M)
    return list(classes.values())


def compiled_variants() -> int | None:
    """How many compiled variants the triton backend's and the glue's kernels hold in this process (Triton's
    in-memory kernel caches, `JITFunction.device_caches`), or None where this Triton keeps them
    otherwise. Under the interpreter nothing is compiled: 0."""
    from .backends.glue import _kernels as _glue_kernels
    from .backends.triton import _gemv_kernels, _gluon_kernels, _kernels

    total, seen = 0, set()
    for module in (_kernels, _gluon_kernels, _gemv_kernels, _glue_kernels):
        for kernel in vars(module).values():
            caches = getattr(kernel, "device_caches", None)
            if caches is None or id(kernel) in seen:  # a kernel one module imports from another: once
                continue
            seen.add(id(kernel))
            if not isinstance(caches, dict):
                return None
            for entry in caches.values():
                cache = entry[0] if isinstance(entry, tuple) and entry else None
                if not isinstance(cache, dict):
                    return None
                total += len(cache)
    return total


__all__ = ["MAX_WARMUP_BATCH", "WarmupReport", "batch_sizes_to_warm", "compiled_variants", "size_classes", "warm_routing",
           "warmup"]
