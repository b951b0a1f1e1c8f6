"""The one timing harness of moekit: `time_graph` times one closure, `time_graphs` several,
interleaved (the same measurement for each). `moekit bench` times every backend of a batch size
through `time_graphs`; the tuner times its configs through `time_graph`, and its decision timing
(every backend at once) through `time_graphs`.

On a CUDA GPU (the method of BENCHMARKS.md and its reference points):
  1. `fn` runs eagerly a few times on a side stream (compilation, autotuning, allocator warm-up;
     torch requires the warm-up before a capture to happen off the default stream);
  2. one call of `fn` is captured into a `torch.cuda.CUDAGraph`;
  3. before every replay the L2 cache is flushed by zeroing a 512 MiB buffer (far larger than
     any L2: 50 MiB on H100, 60 MiB on H200), so each replay reads its weights from HBM
     (`flush_with="read"` reads the buffer instead: the L2 is then left holding clean lines, not
     the zeroing's dirty ones, whose write-back a replay's first reads would pay for; a
     diagnostic, scripts/diag_flush.py: every reference point was measured with the zeroing);
  4. CUDA events time every "flush, then replay" in two parts, `reps` times, in `rounds` blocks
     (several closures' blocks alternate, the order rotating each round), each block led by one
     untimed call, so the GPU is never idle at a start event: an event between the flush and the
     replay splits each sample, so each replay's time is its sample less that sample's own
     flush (the flush's cost subtracted sample by sample, not by a median measured apart: that
     median varied from 166 to 225 µs between timings on an H100, and every sample of the
     timing then read that much too fast; BENCHMARKS.md, twenty-sixth session);
  5. the median and the 20th / 80th percentiles of the replays' times are reported, and the
     flushes' median beside them.
If capture fails (a host synchronisation inside `fn`, an op that graphs cannot hold), the same
measurement is made with eager calls instead of replays, and `Timing.note` says so.

On the CPU: `time.perf_counter` around `fn()`, after the warm-up; no cache flush.

`eager_us_per_call` measures something else: the wall time of back-to-back eager calls, host
launch cost included (scripts/bench_route.py, bench_hf_router.py).
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
DEFAULT_ROUNDS = 5  # time_graphs: replays of several closures interleaved in this many rounds
# How a timing's flush cost is subtracted (step 4 above). The tuner's journal records it beside
# every timing, so that timings of the older harness (a flush median measured apart; their
# entries carry no such field) are told apart from this one's (tune.output.decision_candidates).
FLUSH_METHOD = "per-sample"
FLUSH_WITH = ("zero", "read")  # how the flush buffer empties the L2 (step 3 above); the first is the default

_flush_buffers: dict[int, torch.Tensor] = {}  # CUDA device index -> its flush buffer


@dataclasses.dataclass(frozen=True)
class Timing:
    """One measurement. Times in microseconds; `samples` are the corrected per-replay times."""

    median_us: float
    p20_us: float
    p80_us: float
    samples: tuple[float, ...]
    method: str  # "cuda-graph", "cuda-eager" (capture failed) or "cpu"
    flush_us: float | None = None  # median time of the L2 flushes before the replays, CUDA only
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
    rounds: int = DEFAULT_ROUNDS,
    flush_with: str = FLUSH_WITH[0],
) -> Timing:
    """Time `fn()` (a closure over inputs prepared beforehand). See the module docstring.

    Its replays are timed in `rounds` blocks, as time_graphs does for several closures."""
    result = time_graphs({"fn": fn}, reps=reps, warmup=warmup, flush_l2=flush_l2, device=device,
                         use_graph=use_graph, rounds=rounds, flush_with=flush_with)["fn"]
    if isinstance(result, BaseException):
        raise result
    return result


def time_graphs(
    fns: dict[str, Callable[[], object]],
    *,
    reps: int = DEFAULT_REPS,
    warmup: int = DEFAULT_WARMUP,
    flush_l2: bool = True,
    device: torch.device | str | None = None,
    use_graph: bool = True,
    rounds: int = DEFAULT_ROUNDS,
    before_each: Callable[[str], object] | None = None,
    flush_with: str = FLUSH_WITH[0],
) -> dict[str, Timing | Exception]:
    """Time several closures fairly against each other: each is warmed up and captured first,
    then their replays are interleaved in `rounds` rounds (the order rotating each round), so that
    every one of them sees the same GPU clocks. A GPU running a long compute-bound layer heats up
    and slows down by several percent within a second (p20-p80 spreads of ~10% at prefill sizes
    on an H200, 2026-12-03); timed one after the other, the last closure would pay for it.

    `before_each(name)`, when given, runs before every timed call of closure `name`, outside the
    timed span (after the warm-up and the capture): it may change the contents of the closures'
    input buffers, e.g. rotate through several routings (a captured graph reads its buffers anew
    at each replay). Given the name, it can give every closure the same sequence of inputs.

    `flush_with`: "zero" (the default, the method of every reference point) or "read" (step 3 of
    the module docstring).

    Returns each name's Timing, or the exception its warm-up raised."""
    if not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be a positive integer, got {reps!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    if flush_with not in FLUSH_WITH:
        raise ValueError(f"flush_with must be one of {', '.join(FLUSH_WITH)}, got {flush_with!r}")
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            flush = _flush(flush_with) if flush_l2 else None
            return _time_cuda(fns, reps, warmup, flush, use_graph, rounds, before_each)
    return _time_cpu(fns, reps, warmup, rounds, before_each)


def eager_us_per_call(fn: Callable[[], object], calls: int, warmup: int = 10) -> float:
    """Wall time per call of `calls` back-to-back eager calls after `warmup` (the GPU synchronised
    before and after): the host's launch cost included, what an eager decode step pays per call,
    which a graph replay hides."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def graph_and_eager(fns: dict[str, Callable[[], object]], *, rounds: int, eager_calls: int) -> dict[str, dict]:
    """Each closure timed both ways: in CUDA graphs (time_graphs, the closures interleaved in
    `rounds`) and as `eager_calls` back-to-back eager calls (eager_us_per_call); per name, the
    row fields graph_median_us, graph_p20_us, graph_p80_us and eager_us_per_call. A closure that
    failed raises its error (a benchmark script stops on it)."""
    rows = {}
    for name, t in time_graphs(fns, rounds=rounds).items():
        if isinstance(t, BaseException):
            raise t
        rows[name] = {"graph_median_us": t.median_us, "graph_p20_us": t.p20_us, "graph_p80_us": t.p80_us,
                      "eager_us_per_call": eager_us_per_call(fns[name], eager_calls)}
    return rows


def describe_graph_and_eager(row: dict) -> str:
    """One graph_and_eager row as the scripts print it."""
    return (f"graph {row['graph_median_us']:7.2f} us ({row['graph_p20_us']:.2f}-{row['graph_p80_us']:.2f}), "
            f"eager {row['eager_us_per_call']:7.1f} us/call")


def _round_sizes(reps: int, rounds: int) -> list[int]:
    """`reps` split over at most `rounds` rounds, as evenly as possible (no empty round)."""
    rounds = min(rounds, reps)
    base, extra = divmod(reps, rounds)
    return [base + (1 if i < extra else 0) for i in range(rounds)]


def _interleave(names: list[str], reps: int, rounds: int, measure: Callable[[str, int], list[float]],
                failed: dict[str, Exception]) -> dict[str, list[float]]:
    """measure(name, n) -> n samples; called round by round, the order rotating each round. A
    name whose measure raises is put in `failed` and left out of the later rounds: one backend
    failing on a later call (a routing of the rotation, no warm-up asked for) is its own row's
    error, not the end of the run."""
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r, n in enumerate(_round_sizes(reps, rounds)):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            if name in failed:
                continue
            try:
                samples[name] += measure(name, n)
            except Exception as e:  # noqa: BLE001 - reported for this name, the others go on
                if _cuda_context_broken():  # a sticky error (illegal address): no later timing means anything
                    raise
                failed[name] = e
    return {name: times for name, times in samples.items() if name not in failed}


def _cuda_context_broken() -> bool:
    """Whether the CUDA context is unusable after an error (a sticky error fails every later call,
    a synchronize first)."""
    if not torch.cuda.is_initialized():
        return False
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return True
    return False


# ------------------------------------------------------------------------------------- CPU


def _time_cpu(fns, reps: int, warmup: int, rounds: int, before_each=None) -> dict[str, Timing | Exception]:
    results: dict[str, Timing | Exception] = {}
    ready = []
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            ready.append(name)
        except Exception as e:  # noqa: BLE001 - reported for this name, the others are timed
            results[name] = e

    def measure(name: str, n: int) -> list[float]:
        out = []
        for _ in range(n):
            if before_each is not None:
                before_each(name)
            start = time.perf_counter()
            fns[name]()
            out.append((time.perf_counter() - start) * 1e6)
        return out

    for name, samples in _interleave(ready, reps, rounds, measure, results).items():
        results[name] = Timing.from_samples(samples, "cpu")
    return {name: results[name] for name in fns}


# ------------------------------------------------------------------------------------ CUDA


def flush_buffer() -> torch.Tensor:
    """The current CUDA device's 512 MiB flush buffer, allocated once."""
    index = torch.cuda.current_device()
    buf = _flush_buffers.get(index)
    if buf is None:
        buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=f"cuda:{index}")
        _flush_buffers[index] = buf
    return buf


def _flush(flush_with: str) -> Callable[[], object]:
    """The L2 flush of `flush_with` (FLUSH_WITH) over the current device's flush buffer."""
    buf = flush_buffer()
    if flush_with == "zero":
        return buf.zero_
    words = buf.view(torch.int32)
    return lambda: torch.amax(words)  # reads all 512 MiB, writes one word


def _event_times(body: Callable[[], None], reps: int, before_each: Callable[[], object] | None = None) -> list[float]:
    """GPU time of `body` in µs, `reps` times: one pair of events around each call
    (`before_each` runs before each, outside the events).

    One untimed call of `body` goes first: after the synchronisation the GPU is idle, so the
    first start event would fire as soon as it is recorded and the first sample would include
    the host's time to launch `body` (a few µs of Python and driver, on replays of ~10 µs at
    decode sizes). With the untimed call queued ahead (a 512 MiB flush: 100+ µs of GPU work) the
    host is ahead of the GPU by the first timed call, as it is for all the others."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    body()  # untimed: keeps the GPU busy while the host queues the first timed call
    for start, end in zip(starts, ends):
        if before_each is not None:
            before_each()
        start.record()
        body()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]  # ms -> µs


def _flushed_event_times(flush: Callable[[], None], run: Callable[[], None], reps: int,
                         before_each: Callable[[], object] | None = None) -> tuple[list[float], list[float]]:
    """(run's GPU time, flush's GPU time) in µs, `reps` times, of "flush, then run": three events
    per call, the middle one recorded between them, so each run's time excludes its own flush
    (whose time varies from call to call) and the run still finds the L2 cold. Led by one untimed
    call, as _event_times."""
    starts, mids, ends = ([torch.cuda.Event(enable_timing=True) for _ in range(reps)] for _ in range(3))
    torch.cuda.synchronize()
    flush()  # untimed: keeps the GPU busy while the host queues the first timed call
    run()
    for start, mid, end in zip(starts, mids, ends):
        if before_each is not None:
            before_each()
        start.record()
        flush()
        mid.record()
        run()
        end.record()
    torch.cuda.synchronize()
    runs = [m.elapsed_time(e) * 1e3 for m, e in zip(mids, ends)]  # ms -> µs
    flushes = [s.elapsed_time(m) * 1e3 for s, m in zip(starts, mids)]
    return runs, flushes


def _capture(fn) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _restore_generator(rng: torch.Generator, state: torch.Tensor) -> None:
    """The device's default CUDA generator as it was before a capture that failed. The capture
    marked it as capturing and, ended by an error, never unmarked it: every later random draw on
    the device then raised ("Offset increment outside graph capture encountered unexpectedly";
    the benchmark's own ceilings measurement was the first to). A fresh state replaces its own,
    and takes the seed and offset it had."""
    rng.graphsafe_set_state(torch.Generator(device=rng.device).graphsafe_get_state())
    rng.set_state(state)


def _prepare_cuda(fn, warmup: int, use_graph: bool):
    """Warm `fn` up and capture it: (what to replay, method, note, the graph to keep alive)."""
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
        rng = torch.cuda.default_generators[torch.cuda.current_device()]
        rng_state = rng.get_state()
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
            _restore_generator(rng, rng_state)
    run = graph.replay if graph is not None else fn
    return run, ("cuda-graph" if graph is not None else "cuda-eager"), note, graph


def _time_cuda(fns, reps: int, warmup: int, flush: Callable[[], object] | None, use_graph: bool, rounds: int,
               before_each=None) -> dict[str, Timing | Exception]:
    results: dict[str, Timing | Exception] = {}
    prepared = {}
    for name, fn in fns.items():
        try:
            prepared[name] = _prepare_cuda(fn, warmup, use_graph)
        except Exception as e:  # noqa: BLE001 - reported for this name, the others are timed
            results[name] = e
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - a broken context shows up in the next call
                pass
    if flush is not None and prepared:  # a flush that fails is no closure's error: nothing can be timed
        flush()
        torch.cuda.synchronize()
    flush_times: dict[str, list[float]] = {name: [] for name in prepared}

    def measure(name: str, n: int) -> list[float]:
        run = prepared[name][0]
        hook = None if before_each is None else (lambda: before_each(name))
        if flush is None:
            return _event_times(run, n, hook)
        runs, flushes = _flushed_event_times(flush, run, n, hook)
        flush_times[name] += flushes
        return runs

    samples = _interleave(list(prepared), reps, rounds, measure, results)
    for name, times in samples.items():
        _, method, note, _ = prepared[name]
        flush_us = float(np.median(flush_times[name])) if flush is not None else None
        results[name] = Timing.from_samples(times, method, flush_us, note)
    prepared.clear()  # frees the graphs
    return {name: results[name] for name in fns}


__all__ = ["Timing", "time_graph", "time_graphs", "flush_buffer", "FLUSH_BYTES", "FLUSH_WITH", "DEFAULT_REPS", "DEFAULT_WARMUP"]
