"""Shared test helpers: random problems and error metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moekit


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| scaled by max |ref| (catches a few badly wrong elements that L2 hides)."""
    out, ref = out.double(), ref.double()
    return float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def random_weights(E, H, N, scheme, *, dtype=torch.bfloat16, device="cpu", seed=0):
    """Random expert weights quantized to `scheme`, scaled so activations stay O(1)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w13 = torch.randn(E, 2 * N, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, N, generator=g) / N**0.5
    scheme = moekit.get_scheme(scheme)
    kw = {}
    if scheme.static_activation:
        kw["calibration"] = torch.randn(64, H, generator=g)
    if not scheme.is_fp8:
        w13, w2 = w13.to(dtype), w2.to(dtype)
    return moekit.quantize_weights(w13, w2, scheme, **kw).to(device)


def random_routing(M, E, K, *, device="cpu", seed=0, experts=None):
    """Random top-k routing (distinct experts per token). `experts` restricts the choice to a
    subset, so that the other experts receive no tokens."""
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    pool = torch.arange(E) if experts is None else torch.as_tensor(experts)
    if K > len(pool):
        raise ValueError("top-k larger than the expert pool")
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:K]] for _ in range(M)]) if M else torch.zeros(0, K, dtype=torch.long)
    weights = torch.rand(M, K, generator=g) + 0.1
    return weights.to(device), ids.to(torch.int32).to(device)


def random_x(M, H, *, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed + 2)
    return torch.randn(M, H, generator=g).to(dtype).to(device)


def capture_graph(fn, warmup: int = 2):
    """Warm `fn` up on a side stream (torch requires it before a capture: compilation, allocator),
    then capture one call into a CUDA graph. Returns (graph, the captured call's output), the
    output being the buffer every replay writes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def assert_graph_replays_fresh_routing(layer, x, tw, ids, num_experts, seeds=(2, 3)):
    """Capture `layer(x, tw, ids)` into a CUDA graph, then for each seed write a new routing and
    new inputs into the same buffers, replay, and compare with an eager call on those inputs."""
    graph, out = capture_graph(lambda: layer(x, tw, ids), warmup=1)
    (M, H), K = x.shape, ids.shape[1]
    for seed in seeds:
        tw2, ids2 = random_routing(M, num_experts, K, device=x.device, seed=seed)
        x2 = random_x(M, H, device=x.device, seed=seed)
        tw.copy_(tw2), ids.copy_(ids2), x.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, layer(x2, tw2, ids2))


def tiny_mixtral(tmp_path, *, experts: int, hidden: int, intermediate: int, layers: int) -> Path:
    """A model folder holding only a Mixtral-style config.json of these sizes (top-2), for the CLIs."""
    folder = Path(tmp_path) / "tiny-moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "num_local_experts": experts, "num_experts_per_tok": 2, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers,
    }))
    return folder


class RecordingKernel:
    """Stands in for a @triton.jit kernel given to launch._launch: it has the kernel's argument
    names and records the keyword arguments of each launch in `calls` instead of running."""

    def __init__(self, arg_names, calls):
        self.arg_names, self.calls = arg_names, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(kwargs)


REPO = Path(__file__).resolve().parent.parent


def compile_in_child(argv: list[str], timeout: int = 900) -> str:
    """Run `python argv...` (a script compiling kernels for a GPU target, without a GPU) in a
    process of its own, without TRITON_INTERPRET (under which Triton compiles nothing), with the
    repository importable; its stdout, once it exits 0. Skips the test where this triton ships no
    ptxas for sm_90."""
    from triton.backends.nvidia.compiler import get_ptxas

    if not os.path.exists(get_ptxas(90).path):
        pytest.skip("this triton ships no ptxas")
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def assert_child_stops_with(script: str, message: str, timeout: int = 300) -> None:
    """Run `script` (its GPU work, then a synchronize) in a process of its own, from the
    repository: a failed device-side assertion ends the CUDA context of the process it happens in.
    It must fail, with `message` in its output, and never reach its end."""
    done = subprocess.run([sys.executable, "-c", script + '\nprint("NO ASSERTION")\n'], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "NO ASSERTION" not in out, out[-2000:]
    assert message in out, out[-2000:]


def interpreter_asserts_on(monkeypatch) -> None:
    """Triton's CPU interpreter runs device_assert only when its builder's `debug` option is on (on
    a GPU moekit compiles the asserting kernels with Triton's `debug`): on, for one test."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))


def input_recording_backend():
    """A reference backend named "recording" that keeps the (x, topk_weights) of every call in
    `.inputs`: what fused_moe handed its backend (the routing weights moved onto x, say)."""
    from moekit.backends.reference import ReferenceBackend

    class InputRecordingBackend(ReferenceBackend):
        name = "recording"

        def __init__(self):
            self.inputs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def run(self, x, weights, topk_weights, topk_ids):
            # not while a CUDA graph is captured (bench tries one first): a clone made then is
            # filled only by a replay, and a capture that fails is never replayed (its zeros were
            # read as the inputs on an H100)
            if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                self.inputs.append((x.clone(), topk_weights.clone()))
            return super().run(x, weights, topk_weights, topk_ids)

    return InputRecordingBackend()
