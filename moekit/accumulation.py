"""How the triton backend sums FP8 products (MOEKIT_FP8_ACCUMULATION), and which tables that needs.

"precise" (default): each partial product of at most 128 of K (a tile's K step, or a part of a
wider one) is added into a float32 accumulator, as DeepGEMM does. "fast": the tensor cores' own narrower accumulator over the whole K, as vLLM's
Triton kernel and torch's CUTLASS grouped GEMM run. Measured on an H200 (BENCHMARKS.md,
2026-12-03, fourth session): fast is 17% faster at Mixtral-8x7B M = 4096 (whole layer) and 8% at
GLM-4.5V, the same at decode sizes, but its error against float64 rose from 2.5e-3 to 1.4e-2 on
Mixtral (more intermediate values cross an FP8 rounding boundary), above `moekit check`'s 1e-2
limit; so precise is the default.

The mode changes which launch config is fastest (GEMM2 in fast mode wanted 3 stages where
precise's best had 4: 1.39x on GEMM2 at GLM-4.5V M = 8192, eighth session), so tables tuned in
fast mode are filed apart (moekit.tables.table_name) for the schemes the mode affects.
"""

from __future__ import annotations

import functools

from . import env
from .spec import QuantScheme

FP8_ACCUMULATION_ENV = "MOEKIT_FP8_ACCUMULATION"
FP8_ACCUMULATIONS = ("precise", "fast")


def fp8_accumulation() -> str:
    """The FP8 accumulation mode asked for in the environment (ValueError for another value).
    Read at every launch (a test or a user may change it; moekit.env.raw); parsed once per value."""
    return _parse_accumulation(env.raw(FP8_ACCUMULATION_ENV))


@functools.lru_cache(maxsize=8)
def _parse_accumulation(raw_value) -> str:
    raw = env.value(raw_value)
    mode = (raw or "").strip().lower() or "precise"
    if mode not in FP8_ACCUMULATIONS:
        raise ValueError(f"{FP8_ACCUMULATION_ENV}={raw!r}: expected one of {', '.join(FP8_ACCUMULATIONS)}")
    return mode


def accumulation_matters(scheme: QuantScheme) -> bool:
    """Whether the mode changes this scheme's kernels: FP8 schemes whose scales are constant along
    K. With 1x128 activation groups or 128x128 weight blocks each K step's product is scaled and
    added into float32 by the kernel itself in either mode."""
    return scheme.is_fp8 and scheme.activation != "group" and scheme.weight != "block"


def table_accumulation(scheme: QuantScheme) -> str:
    """The mode a table for this scheme is filed under now: 'fast' in fast mode where the mode
    matters, else 'precise' (the tables named without a mode)."""
    return "fast" if fp8_accumulation() == "fast" and accumulation_matters(scheme) else "precise"
