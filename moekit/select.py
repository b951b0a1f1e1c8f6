"""Which backend runs a call: the `backend` argument, then MOEKIT_BACKEND, then auto.

A backend asked for by name (argument or environment) that cannot run raises
`BackendUnavailableError` with every reason; only `auto` chooses among backends.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Literal

import torch

from .backends.base import backend_names, get_backend
from .spec import MoEShape, QuantScheme

ENV_VAR = "MOEKIT_BACKEND"
log = logging.getLogger("moekit.select")

# Until measured decision tables exist, auto takes the first backend that can run, in this order.
# GPU: moekit's own fused kernels first, the CUTLASS grouped GEMM next, then plain torch.
# CPU: the torch backend (per-expert loop); Triton runs on the CPU only in the slow interpreter.
HEURISTIC_ORDER = {
    "cuda": ("triton", "cutlass", "torch", "reference"),
    "cpu": ("torch", "reference"),
}


class BackendUnavailableError(RuntimeError):
    """A backend asked for by name cannot run this problem."""

    def __init__(self, name: str, source: str, reasons: list[str], runnable: list[str]):
        self.name, self.reasons, self.runnable = name, reasons, runnable
        lines = "\n".join(f"  - {r}" for r in reasons)
        super().__init__(
            f"backend {name!r} (from {source}) cannot run this problem:\n{lines}\n"
            f"backends that can: {', '.join(runnable) or 'none'}"
        )


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend chosen for a call and why."""

    backend: str
    source: Literal["argument", "environment", "table", "heuristic"]
    detail: str
    refused: dict[str, list[str]]  # backend -> reasons it cannot run (only backends that cannot)

    def __str__(self) -> str:
        return f"{self.backend} ({self.source}: {self.detail})"


_supports_cache: dict[tuple, list[str]] = {}


def refusals(shape: MoEShape, scheme: QuantScheme, device: torch.device, dtype: torch.dtype) -> dict[str, list[str]]:
    """Every registered backend's reasons not to run (empty list: it can). Cached: it is static."""
    key = (shape, scheme, device, dtype, os.environ.get("TRITON_INTERPRET"))
    result = {}
    for name in backend_names():
        k = (name, *key)
        if k not in _supports_cache:
            _supports_cache[k] = get_backend(name).supports(shape, scheme, device, dtype)
        result[name] = _supports_cache[k]
    return result


def select_backend(
    shape: MoEShape,
    scheme: QuantScheme,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    num_tokens: int = 1,
    backend: str | None = "auto",
) -> Choice:
    """The backend that `fused_moe` would run for this problem, and where that choice came from."""
    device = torch.device(device)
    reasons = refusals(shape, scheme, device, dtype)
    refused = {name: r for name, r in reasons.items() if r}
    runnable = [name for name, r in reasons.items() if not r]

    requested, source = backend, "argument"
    if requested in (None, "auto") and os.environ.get(ENV_VAR, "auto") != "auto":
        requested, source = os.environ[ENV_VAR], "environment"
    if requested not in (None, "auto"):
        get_backend(requested)  # unknown names raise, listing the valid ones
        if refused.get(requested):
            where = "argument" if source == "argument" else f"{ENV_VAR}={requested}"
            raise BackendUnavailableError(requested, where, refused[requested], runnable)
        detail = "backend argument" if source == "argument" else f"{ENV_VAR}={requested}"
        choice = Choice(requested, source, detail, refused)
    else:
        choice = _auto(shape, scheme, device, num_tokens, runnable, refused)
    log.debug("moekit: M=%d %s %s -> %s", num_tokens, shape.describe(), scheme.name, choice)
    return choice


def _auto(shape, scheme, device, num_tokens, runnable, refused) -> Choice:
    order = HEURISTIC_ORDER.get(device.type, ("reference",))
    for name in order:
        if name in runnable:
            return Choice(name, "heuristic", f"first runnable of {', '.join(order)} on {device.type}", refused)
    return Choice("reference", "heuristic", "no faster backend can run this problem", refused)
