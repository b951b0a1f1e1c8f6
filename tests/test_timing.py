"""The shared timing harness (moekit.timing) and the roofline counts and ceilings (moekit.roofline)."""

import json
import math
import time

import numpy as np
import pytest
import torch

from moekit import roofline
from moekit.spec import BF16, FP8_BLOCK128, FP8_CHANNEL_TOKEN, FP8_TENSOR_STATIC, MoEShape
from moekit.timing import Timing, time_graph, time_graphs


# ------------------------------------------------------------------------------------ timing


def test_cpu_timing_returns_ordered_positive_percentiles():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.0005)

    t = time_graph(fn, reps=7, warmup=2, device="cpu")
    assert t.method == "cpu"
    assert len(calls) == 9  # warm-up + timed calls
    assert len(t.samples) == 7
    assert 0 < t.p20_us <= t.median_us <= t.p80_us
    assert t.median_us >= 500  # slept 0.5 ms per call
    assert t.flush_us is None


def test_timing_percentiles_from_samples():
    t = Timing.from_samples([5.0, 1.0, 3.0, 2.0, 4.0], "cpu")
    assert t.median_us == 3.0
    assert t.p20_us == pytest.approx(1.8)
    assert t.p80_us == pytest.approx(4.2)
    with pytest.raises(ValueError):
        Timing.from_samples([], "cpu")


@pytest.mark.parametrize("kw", [{"reps": 0}, {"reps": 2.5}, {"warmup": -1}])
def test_time_graph_rejects_bad_counts(kw):
    with pytest.raises(ValueError):
        time_graph(lambda: None, device="cpu", **kw)


def assert_well_formed(t: Timing, reps: int, method: str) -> None:
    """What a Timing promises, speed aside: its method, one sample per timed call, each finite and
    non-negative, percentiles ordered."""
    assert t.method == method and len(t.samples) == reps
    assert all(math.isfinite(s) and s >= 0 for s in t.samples)
    assert t.p20_us <= t.median_us <= t.p80_us
    assert t.median_us == pytest.approx(float(np.median(t.samples)))


def zero_one_matrix(n: int, seed: int) -> torch.Tensor:
    """float32 entries 0 or 1: every product and sum of a matmul is a small integer, exact in
    float32 (and TF32) in any order, so a replay's result can be compared bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.rand(n, n, device="cuda", generator=g) < 0.5).float()


@pytest.mark.gpu
def test_cuda_graph_timing_flushes_the_l2_before_each_replay():
    """The flush is what the module promises: a buffer of FLUSH_BYTES, at least the GPU's L2 cache,
    written over entirely before the replays (it is zeroed: filled with ones first, none survive);
    its measured time is reported (finite, positive); the replays run the captured work. Speed
    itself is not asserted (benchmarks measure it)."""
    from moekit.timing import FLUSH_BYTES, flush_buffer

    buf = flush_buffer()
    assert flush_buffer() is buf  # allocated once
    assert buf.numel() * buf.element_size() == FLUSH_BYTES >= torch.cuda.get_device_properties(buf.device).L2_cache_size
    buf.fill_(1)
    a = zero_one_matrix(2048, seed=0)
    out = torch.full_like(a, float("nan"))
    t = time_graph(lambda: torch.mm(a, a, out=out), reps=10, warmup=2)
    assert_well_formed(t, 10, "cuda-graph")
    assert t.note is None
    assert t.flush_us is not None and math.isfinite(t.flush_us) and t.flush_us > 0
    assert int(buf.count_nonzero()) == 0  # the whole buffer was written
    assert torch.equal(out, (a.double() @ a.double()).float())  # the replays ran the captured matmul
    buf.fill_(1)
    out.fill_(float("nan"))
    t = time_graph(lambda: torch.mm(a, a, out=out), reps=10, warmup=2, flush_with="read")
    assert_well_formed(t, 10, "cuda-graph")
    assert t.flush_us is not None and math.isfinite(t.flush_us) and t.flush_us > 0
    assert int(buf.count_nonzero()) == buf.numel()  # read, not written
    assert torch.equal(out, (a.double() @ a.double()).float())


@pytest.mark.gpu
def test_cuda_time_graphs_keeps_each_closures_own_time():
    """Interleaved replays of two graphs: each closure gets its own Timing, one sample per timed
    call (`before_each` runs once before each of them, with its name),
    each its own flushes' time, and each one's own graph is what replays for it (its hook clears
    its output just before its call; the replay writes its product back)."""
    ins = {"small": zero_one_matrix(1024, seed=1), "big": zero_one_matrix(2048, seed=2)}
    outs = {name: torch.empty_like(a) for name, a in ins.items()}
    calls = {name: 0 for name in ins}

    def before_each(name):
        calls[name] += 1
        outs[name].fill_(float("nan"))

    fns = {name: (lambda name=name: torch.mm(ins[name], ins[name], out=outs[name])) for name in ins}
    t = time_graphs(fns, reps=10, warmup=2, before_each=before_each)
    assert list(t) == ["small", "big"] and calls == {"small": 10, "big": 10}
    for name, a in ins.items():
        assert_well_formed(t[name], 10, "cuda-graph")
        assert torch.equal(outs[name], (a.double() @ a.double()).float())  # its graph ran after its hook
    assert all(math.isfinite(t[name].flush_us) and t[name].flush_us > 0 for name in ins)


@pytest.mark.gpu
def test_cuda_timing_falls_back_to_eager_when_capture_fails():
    a = torch.randn(256, 256, device="cuda")

    def syncs():
        return (a @ a).sum().item()  # a host sync: cannot be captured

    torch.cuda.manual_seed(7)
    want = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(7)
    t = time_graph(syncs, reps=5, warmup=1)
    assert t.method == "cuda-eager"
    assert "capture failed" in t.note
    assert t.median_us > 0
    # the failed capture left the device's generator marked as capturing: every later random
    # draw raised (bench's ceilings measurement after a backend that syncs); it is as it was
    assert torch.equal(torch.rand(4, device="cuda"), want)


# ------------------------------------------------------------------------------------ counts


def test_flops_and_bytes_follow_the_formulas():
    shape = MoEShape(8, 256, 128, 2)
    ids = torch.tensor([[0, 1], [1, 2], [0, 2]], dtype=torch.int32)  # 3 experts touched
    c = roofline.count(shape, FP8_CHANNEL_TOKEN, 3, ids)
    assert c.flops == 2 * 3 * 2 * 3 * 128 * 256
    assert c.experts_touched == 3
    scales = (2 * 128 + 256) * 4  # channel scales of w13 and w2, float32
    assert c.weight_bytes == 3 * (3 * 128 * 256 * 1 + scales)
    assert c.activation_bytes == 3 * 256 * 2 * 2 + 3 * 2 * 8
    assert c.bytes == c.weight_bytes + c.activation_bytes
    bf16 = roofline.count(shape, BF16, 3, ids)
    assert bf16.weight_bytes == 3 * 3 * 128 * 256 * 2


def test_scale_bytes_per_scheme():
    shape = MoEShape(4, 256, 256, 2)
    assert roofline.scale_bytes_per_expert(shape, BF16) == 0
    assert roofline.scale_bytes_per_expert(shape, FP8_TENSOR_STATIC) == 2 * 4 + 8
    assert roofline.scale_bytes_per_expert(shape, FP8_BLOCK128) == (4 * 2 + 2 * 2) * 4


def test_expected_experts_touched_without_routing():
    shape = MoEShape(128, 256, 128, 8)
    assert roofline.count(shape, BF16, 1).experts_touched == pytest.approx(8)
    assert roofline.count(shape, BF16, 4096).experts_touched == pytest.approx(128)


def test_floor_is_the_larger_of_memory_and_compute_time():
    shape = MoEShape(8, 4096, 14336, 2)
    c = roofline.count(shape, FP8_CHANNEL_TOKEN, 1)
    ceilings = roofline.Ceilings("fake", copy_gbps=3000.0, bf16_tflops=700.0, fp8_tflops=1400.0,
                                 torch="t", triton="t", measured="now")
    floor = roofline.floor_us(c, ceilings, FP8_CHANNEL_TOKEN)
    assert floor == pytest.approx(c.bytes / 3000e9 * 1e6)  # decode: memory bound
    big = roofline.count(shape, FP8_CHANNEL_TOKEN, 65536)
    assert roofline.floor_us(big, ceilings, FP8_CHANNEL_TOKEN) == pytest.approx(big.flops / 1400e12 * 1e6)
    big_bf16 = roofline.count(shape, BF16, 65536)  # bf16 weights: the bf16 matmul rate bounds them
    assert roofline.floor_us(big_bf16, ceilings, BF16) == pytest.approx(big_bf16.flops / 700e12 * 1e6)
    assert roofline.floor_us(c, None, FP8_CHANNEL_TOKEN) is None


# ---------------------------------------------------------------------------------- ceilings


def test_cache_dir_respects_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("MOEKIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert roofline.cache_dir() == tmp_path / "xdg" / "moekit"
    monkeypatch.setenv("MOEKIT_CACHE_DIR", str(tmp_path / "mine"))
    assert roofline.cache_dir() == tmp_path / "mine"


def test_no_ceilings_on_the_cpu():
    assert roofline.get_ceilings("cpu") is None


def test_ceilings_are_cached_per_device_and_versions(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEKIT_CACHE_DIR", str(tmp_path))
    measured = []

    def fake_measure(device):
        measured.append(device)
        return roofline.Ceilings("Fake GPU", 3000.0, 700.0, 1400.0, torch.__version__, "x", "2026-01-01")

    monkeypatch.setattr(roofline, "measure_ceilings", fake_measure)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    first = roofline.get_ceilings("cuda")
    second = roofline.get_ceilings("cuda")
    assert len(measured) == 1
    assert first.source == "measured" and second.source == "cache"
    assert second.copy_gbps == 3000.0 and second.fp8_tflops == 1400.0
    data = json.loads((tmp_path / "ceilings.json").read_text())
    (key,) = data
    assert "Fake GPU" in key and torch.__version__ in key and "triton" in key
    roofline.get_ceilings("cuda", refresh=True)
    assert len(measured) == 2


def test_copy_ceiling_is_the_fastest_way_and_says_which():
    """cudaMemcpy alone measured a copy bandwidth on an H100 that moekit's own GEMMs read faster
    than (efficiency above 1): the ceiling is the fastest of COPY_WAYS, each moving the buffer
    once each way, and the ceilings say which way gave it."""
    gib = 1024**3
    gbps, way = roofline.best_copy({"memcpy": 880.0, "elementwise": 716.0}, 2 * gib)
    assert way == "elementwise" and gbps == pytest.approx(2 * gib / 716e-6 / 1e9)  # 3.0 TB/s
    assert roofline.best_copy({"memcpy": 700.0, "elementwise": 716.0}, 2 * gib)[1] == "memcpy"
    # each way reads src and writes dst, the whole buffer, and nothing else
    src, dst = torch.randn(1000), torch.zeros(1000)
    for name, way in roofline.COPY_WAYS.items():
        dst.zero_()
        way(src, dst)
        assert torch.equal(dst.abs(), src.abs()), name
    ceilings = roofline.Ceilings("fake", 3000.0, 700.0, 1400.0, "t", "t", "now", copy_method="elementwise")
    assert "copy 3.00 TB/s (elementwise)" in ceilings.describe()
    assert roofline.CEILINGS_METHOD in roofline.cache_key("Fake GPU")  # older caches measure again


def test_time_graphs_interleaves_rounds_with_rotating_order():
    """Several closures are timed in rounds, the order rotating, so that none is always last
    (on a GPU: none always meets the hottest, slowest clocks)."""
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    result = time_graphs(fns, reps=5, warmup=1, rounds=3, device="cpu")
    warm, timed = calls[:3], calls[3:]
    assert warm == ["a", "b", "c"]
    # 5 reps in 3 rounds: 2, 2, 1 per closure; round r starts at closure r
    assert timed == ["a"] * 2 + ["b"] * 2 + ["c"] * 2 + ["b"] * 2 + ["c"] * 2 + ["a"] * 2 + ["c", "a", "b"]
    assert all(len(t.samples) == 5 and t.method == "cpu" for t in result.values())


def test_graph_and_eager_gives_each_closure_both_times_and_raises_a_failure():
    """The route and transformers-router benchmark scripts' one timing step (they had a loop each)."""
    from moekit.timing import describe_graph_and_eager, graph_and_eager

    calls = {"a": 0, "b": 0}

    def count(name):
        def fn():
            calls[name] += 1
        return fn

    rows = graph_and_eager({"a": count("a"), "b": count("b")}, rounds=2, eager_calls=7)
    assert list(rows) == ["a", "b"]
    for name, row in rows.items():
        assert set(row) == {"graph_median_us", "graph_p20_us", "graph_p80_us", "eager_us_per_call"}
        assert row["graph_p20_us"] <= row["graph_median_us"] <= row["graph_p80_us"] and row["eager_us_per_call"] > 0
        assert calls[name] > 7 + 10  # the timed calls, then the eager ones after their warm-up
        assert describe_graph_and_eager(row).startswith("graph ") and "us/call" in describe_graph_and_eager(row)

    def broken():
        raise RuntimeError("out of resources")

    with pytest.raises(RuntimeError, match="out of resources"):
        graph_and_eager({"ok": lambda: None, "broken": broken}, rounds=1, eager_calls=1)


def test_time_graphs_reports_a_failing_closure_and_times_the_others():
    def broken():
        raise RuntimeError("out of resources")

    result = time_graphs({"ok": lambda: None, "broken": broken}, reps=3, warmup=1, device="cpu")
    assert list(result) == ["ok", "broken"]
    assert isinstance(result["broken"], RuntimeError) and "out of resources" in str(result["broken"])
    assert len(result["ok"].samples) == 3
    with pytest.raises(RuntimeError, match="out of resources"):
        time_graph(broken, reps=2, warmup=1, device="cpu")


@pytest.mark.parametrize("bad", [{"rounds": 0}, {"reps": 0}, {"warmup": -1}])
def test_time_graphs_rejects_bad_counts(bad):
    with pytest.raises(ValueError):
        time_graphs({"a": lambda: None}, device="cpu", **{"reps": 2, "warmup": 0, "rounds": 1, **bad})


def test_before_each_runs_before_every_timed_call_and_never_inside_the_warm_up():
    events = []
    fns = {"a": lambda: events.append("a"), "b": lambda: events.append("b")}
    time_graphs(fns, reps=4, warmup=2, device="cpu", rounds=2, before_each=lambda name: events.append("+" + name))
    assert events[:4] == ["a", "a", "b", "b"]  # the warm-ups, without the hook
    timed = events[4:]
    assert len(timed) == 16 and all(timed[i] == "+" + timed[i + 1] for i in range(0, 16, 2))
    assert timed.count("+a") == timed.count("+b") == 4  # told which closure runs next


class _FakeDevice:
    """A CPU model of one CUDA stream: the host pays a launch cost per call, the GPU runs the
    queued work in order, an event takes the GPU's time when the stream reaches it (µs)."""

    LAUNCH_US, RECORD_US = 10.0, 2.0

    def __init__(self):
        self.host = 0.0
        self.busy_until = 0.0

    def launch(self, duration_us: float) -> None:
        self.host += self.LAUNCH_US
        self.busy_until = max(self.busy_until, self.host) + duration_us

    def record(self) -> float:
        self.host += self.RECORD_US
        return max(self.busy_until, self.host)

    def synchronize(self) -> None:
        self.host = max(self.host, self.busy_until)

    def event_class(self):
        device = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = device.record()

            def elapsed_time(self, end):
                return (end.t - self.t) / 1e3  # ms, as torch.cuda.Event

        return Event


def test_event_times_exclude_the_hosts_launch_of_the_first_call(monkeypatch):
    """After the synchronisation the GPU is idle: without work queued ahead, the first start event
    fires at once and the first sample includes the host's launch of the body (10 µs here on a
    100 µs body). Every sample must be the body's GPU time alone."""
    from moekit import timing

    device = _FakeDevice()
    monkeypatch.setattr(timing.torch.cuda, "Event", device.event_class())
    monkeypatch.setattr(timing.torch.cuda, "synchronize", device.synchronize)
    hooks = []
    samples = timing._event_times(lambda: device.launch(100.0), 6, before_each=lambda: hooks.append(1))
    assert samples == pytest.approx([100.0] * 6)
    assert len(hooks) == 6  # the untimed call runs without the hook: the hook's sequence is the timed calls'


def test_each_replay_is_timed_apart_from_its_own_flush(monkeypatch):
    """The flush's time varies from call to call (a median of flushes timed apart varied from 166
    to 225 µs between timings on an H100, and that excess read as a faster config): each sample
    must be its replay's GPU time alone, whatever its flush took, and the flushes' own times come
    back beside them."""
    from moekit import timing

    device = _FakeDevice()
    monkeypatch.setattr(timing.torch.cuda, "Event", device.event_class())
    monkeypatch.setattr(timing.torch.cuda, "synchronize", device.synchronize)
    flush_us = iter([300.0, 166.0, 225.0, 170.0, 200.0, 166.0, 180.0])  # the untimed call's first
    hooks = []
    runs, flushes = timing._flushed_event_times(lambda: device.launch(next(flush_us)), lambda: device.launch(50.0),
                                                6, before_each=lambda: hooks.append(1))
    assert runs == pytest.approx([50.0] * 6)
    assert flushes == pytest.approx([166.0, 225.0, 170.0, 200.0, 166.0, 180.0])
    assert len(hooks) == 6


def test_each_closure_is_reported_without_its_flushes(monkeypatch):
    """_time_cuda's wiring, on the fake device: two closures in rounds, flushes of varying length
    before each replay; each closure's time is its own replay's, its flush_us the median of the
    flushes before its replays. A flush that fails is no closure's error: it raises."""
    import itertools

    from moekit import timing

    device = _FakeDevice()
    monkeypatch.setattr(timing.torch.cuda, "Event", device.event_class())
    monkeypatch.setattr(timing.torch.cuda, "synchronize", device.synchronize)
    lengths = itertools.cycle([166.0, 225.0, 170.0, 166.0])

    class Buffer:
        def zero_(self):
            device.launch(next(lengths))

    monkeypatch.setattr(timing, "_prepare_cuda", lambda fn, warmup, use_graph: (fn, "cuda-graph", None, None))
    fns = {"a": lambda: device.launch(50.0), "b": lambda: device.launch(80.0)}
    t = timing._time_cuda(fns, 8, 1, Buffer().zero_, True, 2)
    assert t["a"].samples == pytest.approx((50.0,) * 8) and t["b"].samples == pytest.approx((80.0,) * 8)
    assert all(166.0 <= t[name].flush_us <= 225.0 for name in fns)

    class Broken:
        def zero_(self):
            raise RuntimeError("the flush failed")

    with pytest.raises(RuntimeError, match="the flush failed"):
        timing._time_cuda(fns, 8, 1, Broken().zero_, True, 2)


def test_the_read_flush_reads_every_word_of_the_buffer(monkeypatch):
    """flush_with="read" reduces the whole flush buffer: one nonzero word anywhere in it (the
    first, the last, odd and even ones) is found, and the buffer is left as it was (a review's
    mutants reading only the last word, or every other one, passed the test below)."""
    from moekit import timing

    buf = torch.zeros(4096, dtype=torch.uint8)
    monkeypatch.setattr(timing, "flush_buffer", lambda: buf)
    read = timing._flush("read")
    for word in (0, 1, 510, 1023):
        buf.zero_()
        buf[4 * word : 4 * word + 4] = 1
        assert int(read()) == 0x01010101, word
        assert int(buf.count_nonzero()) == 4


def test_flush_with_reads_or_zeroes_the_flush_buffer(monkeypatch):
    """flush_with picks the flush: "zero" writes the whole buffer, "read" reads all of it and writes
    none of it (a CPU tensor stands in for the GPU's buffer); anything else is refused naming the
    choices, before anything runs."""
    from moekit import timing

    buf = torch.arange(64, dtype=torch.uint8)
    monkeypatch.setattr(timing, "flush_buffer", lambda: buf)
    read = timing._flush("read")
    assert int(read()) == int(buf.view(torch.int32).max())  # it reduced the whole buffer...
    assert torch.equal(buf, torch.arange(64, dtype=torch.uint8))  # ...and left it as it was
    timing._flush("zero")()
    assert int(buf.count_nonzero()) == 0
    with pytest.raises(ValueError, match="flush_with must be one of zero, read, got 'memset'"):
        time_graph(lambda: None, flush_with="memset")


def test_eager_us_per_call_counts_warmup_apart(monkeypatch):
    """Each call costs 2 ms of (fake) wall time: the result is 2000 µs per call, the warm-up calls
    run but are not counted."""
    from moekit import timing

    clock = [0.0]
    calls = []

    def fn():
        calls.append(1)
        clock[0] += 2e-3

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    assert timing.eager_us_per_call(fn, calls=7, warmup=3) == pytest.approx(2000.0)
    assert len(calls) == 10


def test_one_closure_is_timed_in_rounds(monkeypatch):
    """time_graph times its closure in rounds like time_graphs (on a GPU each block starts with an
    untimed call and a synchronisation: a disturbance of one block is one round's samples)."""
    from moekit import timing

    seen = []
    real = timing._interleave

    def spy(names, reps, rounds, measure, failed):
        seen.append((list(names), reps, rounds))
        return real(names, reps, rounds, measure, failed)

    monkeypatch.setattr(timing, "_interleave", spy)
    t = time_graph(lambda: None, reps=10, warmup=0, device="cpu")
    assert len(t.samples) == 10 and seen == [(["fn"], 10, timing.DEFAULT_ROUNDS)]
    time_graph(lambda: None, reps=10, warmup=0, device="cpu", rounds=1)
    assert seen[-1][2] == 1
