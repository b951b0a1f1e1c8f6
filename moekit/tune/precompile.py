"""Compiling configs ahead of their measurement, in helper processes.

Compilation, not timing, is what a tuning run spends its time on (about one config per second on
an H200 host, 2026-12-03: Triton compiles GEMM1 and GEMM2 for every new config, one CPU core at a
time). Helper processes compile the configs the worker is about to measure, with
`compile_only()` (backends/compile_only.py: kernels built, never launched: no GPU time taken from the measurements),
into Triton's on-disk cache; the worker's own first call of a config then loads it from there.

The helpers see the same shapes, dtypes and strides as the worker (empty tensors of the same
sizes), so Triton specializes and names the kernels the same way. Anything going wrong in a
helper only costs the speed-up: the worker compiles what the helpers did not, as before.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent import futures

import torch

from ..backends.triton.config import KernelConfig
from ..spec import MoEShape, QuantScheme
from ..weights import empty_weights


def default_helpers(device: torch.device) -> int:
    """Half the CPU cores, at most 8 (each helper holds a CUDA context and a layer's worth of
    empty weights); none on the CPU, where the interpreter compiles nothing."""
    if device.type != "cuda":
        return 0
    return max(0, min(8, (os.cpu_count() or 2) // 2))


# ------------------------------------------------------------------- inside a helper process

_state: dict = {}


def _init(device: str, dtype: torch.dtype) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    _state.update(device=dev, dtype=dtype, weights={})


def _compile(shape: MoEShape, scheme: QuantScheme, M: int, config: dict) -> str | None:
    """Compile the triton backend's kernels for one config at batch size M; the error, if any."""
    from ..backends import get_backend
    from ..backends.compile_only import compile_only

    dev, dtype = _state["device"], _state["dtype"]
    key = (shape, scheme.name)
    if key not in _state["weights"]:
        _state["weights"] = {key: empty_weights(shape, scheme, dev, dtype)}  # one problem at a time
    weights = _state["weights"][key]
    x = torch.empty(M, shape.hidden, dtype=dtype, device=dev)
    topk_weights = torch.empty(M, shape.top_k, dtype=torch.float32, device=dev)
    topk_ids = torch.empty(M, shape.top_k, dtype=torch.int32, device=dev)
    try:
        with compile_only(), torch.no_grad():
            get_backend("triton").run(x, weights, topk_weights, topk_ids, config=KernelConfig.from_dict(config))
    except Exception as e:  # noqa: BLE001 - the worker meets (and records) the same error itself
        return f"{type(e).__name__}: {e}"[:300]
    return None


# ---------------------------------------------------------------------- in the tuning worker


class Precompiler:
    """A pool of helper processes compiling configs ahead; `submit` never blocks or raises."""

    def __init__(self, device: torch.device, dtype: torch.dtype, helpers: int, log=None):
        self._pool = None
        self._log = log or (lambda text: None)
        if helpers <= 0:
            return
        import torch.multiprocessing as mp

        try:
            self._pool = futures.ProcessPoolExecutor(
                max_workers=helpers, mp_context=mp.get_context("spawn"), initializer=_init,
                initargs=(str(device), dtype),
            )
        except Exception as e:  # noqa: BLE001 - e.g. no children allowed here: compile in the worker
            self._log(f"compiling in this process only (helper processes unavailable: {e})")

    def submit(self, shape: MoEShape, scheme: QuantScheme, M: int, configs: Sequence[KernelConfig]) -> list:
        """Queue the configs (in order); returns their futures (each: None, or the error met), for
        `cancel` once the worker stops measuring them."""
        if self._pool is None:
            return []
        submitted = []
        try:
            for cfg in configs:
                submitted.append(self._pool.submit(_compile, shape, scheme, M, cfg.to_dict()))
        except Exception as e:  # noqa: BLE001 - a broken pool: go on without it
            self._log(f"helper processes stopped ({type(e).__name__}: {e}); compiling in this process")
            self.close()
        return submitted

    @staticmethod
    def cancel(submitted: Sequence[futures.Future]) -> None:
        """Drop the compiles not started yet: a search that stopped (its share of the budget used
        up) must not leave a backlog that the next batch size's compiles wait behind. Started or
        finished ones are left alone (Future.cancel refuses them)."""
        for future in submitted:
            future.cancel()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
