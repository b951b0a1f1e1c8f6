"""The one timing harness of moekit: `moekit bench` and the tuner both time through `time_graph`.

On a CUDA GPU (the method of shared/anchors/README.md):
  1. `fn` runs eagerly a few times on a side stream (compilation, autotuning, allocator warm-up;
     torch requires the warm-up before a capture to happen off the default stream);
  2. one call of `fn` is captured into a `torch.cuda.CUDAGraph`;
  3. before every replay the L2 cache is flushed by zeroing a 512 MiB buffer (far larger than
     any L2: 50 MiB on H100, 60 MiB on H200), so each replay reads its weights from HBM;
  4. CUDA events time "flush + replay" `reps` times, then "flush" alone `reps` times; the
     median of the flush-alone times is subtracted from every flush + replay sample;
  5. the median and the 20th / 80th percentiles of the corrected samples are reported.
If capture fails (a host synchronisation inside `fn`, an op that graphs cannot hold), the same
measurement is made with eager calls instead of replays, and `Timing.note` says so.

On the CPU: `time.perf_counter` around `fn()`, after the warm-up; no cache flush.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np
import torch

FLUSH_BYTES = 512 * 1024**2
DEFAULT_REPS = 30
DEFAULT_WARMUP = 5

_flush_buffers: dict[int, torch.Tensor] = {}  # CUDA device index -> its flush buffer


@dataclasses.dataclass(frozen=True)
class Timing:
    """One measurement. Times in microseconds; `samples` are the corrected per-replay times."""

    median_us: float
    p20_us: float
    p80_us: float
    samples: tuple[float, ...]
    method: str  # "cuda-graph", "cuda-eager" (capture failed) or "cpu"
    flush_us: float | None = None  # median time of the L2 flush alone (subtracted), CUDA only
    note: str | None = None

    @classmethod
    def from_samples(cls, samples_us, method: str, flush_us: float | None = None, note: str | None = None):
        samples = tuple(float(s) for s in samples_us)
        if not samples:
            raise ValueError("a timing needs at least one sample")
        p20, med, p80 = np.percentile(np.asarray(samples), [20, 50, 80])
        return cls(float(med), float(p20), float(p80), samples, method, flush_us, note)


def time_graph(
    fn: Callable[[], object],
    *,
    reps: int = DEFAULT_REPS,
    warmup: int = DEFAULT_WARMUP,
    flush_l2: bool = True,
    device: torch.device | str | None = None,
    use_graph: bool = True,
) -> Timing:
    """Time `fn()` (a closure over inputs prepared beforehand). See the module docstring."""
    if not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be a positive integer, got {reps!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            return _time_cuda(fn, reps, warmup, flush_l2, use_graph)
    return _time_cpu(fn, reps, warmup)


# ------------------------------------------------------------------------------------- CPU


def _time_cpu(fn, reps: int, warmup: int) -> Timing:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return Timing.from_samples(samples, "cpu")


# ------------------------------------------------------------------------------------ CUDA


def flush_buffer() -> torch.Tensor:
    """The current CUDA device's 512 MiB flush buffer, allocated once."""
    index = torch.cuda.current_device()
    buf = _flush_buffers.get(index)
    if buf is None:
        buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=f"cuda:{index}")
        _flush_buffers[index] = buf
    return buf


def _event_times(body: Callable[[], None], reps: int) -> list[float]:
    """GPU time of `body` in µs, `reps` times: one pair of events around each call."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    for start, end in zip(starts, ends):
        start.record()
        body()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]  # ms -> µs


def _capture(fn) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _time_cuda(fn, reps: int, warmup: int, flush_l2: bool, use_graph: bool) -> Timing:
    # Eager warm-up on a side stream, as torch requires before a capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph, note = None, None
    if use_graph:
        try:
            graph = _capture(fn)
            graph.replay()  # one replay before timing: first-replay costs stay out of the samples
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager timing
            graph = None
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            note = f"CUDA graph capture failed ({type(e).__name__}: {first_line[:120]}); timed eagerly"
            try:  # a failed capture can leave an error pending on the stream; clear it
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                pass
    run = graph.replay if graph is not None else fn
    method = "cuda-graph" if graph is not None else "cuda-eager"

    flush_us = None
    if flush_l2:
        buf = flush_buffer()
        flush = buf.zero_

        def body():
            flush()
            run()

        total = _event_times(body, reps)
        flush_only = _event_times(flush, reps)
        flush_us = float(np.median(flush_only))
        samples = [max(t - flush_us, 0.0) for t in total]
    else:
        samples = _event_times(run, reps)
    del graph
    return Timing.from_samples(samples, method, flush_us, note)


__all__ = ["Timing", "time_graph", "flush_buffer", "FLUSH_BYTES", "DEFAULT_REPS", "DEFAULT_WARMUP"]
