"""Host cost of choosing a backend per call, and of MoELayer over fused_moe.

    python scripts/bench_select.py            # on the GPU if there is one, else on the CPU

Prints microseconds per call of:
  - select_backend: auto from the heuristic, auto from a decision table (a synthetic one written to
    a temporary MOEKIT_CONFIG_DIR), and a named backend; M cycles through 64 batch sizes, so the
    per-M memo is what is timed (the first call of a problem, which reads the table, is printed too);
  - fused_moe and MoELayer around a `null` backend (returns x): the whole host path of a call
    without any kernel (input checks, selection, dispatch), and MoELayer's extra over fused_moe.
Nothing here synchronises the GPU inside the timed loops; one synchronize ends each loop.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moekit  # noqa: E402
from moekit import select, tables  # noqa: E402
from moekit.backends.base import Backend, register  # noqa: E402
from moekit.models import ModelSpec  # noqa: E402
from moekit.routing import RoutingConfig  # noqa: E402
from moekit.spec import MoEShape, get_scheme  # noqa: E402


class NullBackend(Backend):
    name = "null"
    description = "returns x: times the host path alone"

    def supports(self, shape, scheme, device, dtype=torch.bfloat16):
        return []

    def run(self, x, weights, topk_weights, topk_ids):
        return x


def per_call_us(fn, n: int, sync) -> float:
    for _ in range(min(n, 200)):
        fn()
    sync()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    os.environ.pop(select.ENV_VAR, None)
    register(NullBackend())
    scheme = get_scheme("fp8-channel-token")
    # GLM-4.5V at tp 2 on a GPU; a small layer of the same kind on the CPU (weights are allocated)
    shape = MoEShape(128, 4096, 1408, 8, tp=2) if device.type == "cuda" else MoEShape(16, 256, 128, 8)
    sizes = [1 + 7 * i for i in range(64)]
    name = select.device_name(device)
    print(f"device: {name}, torch {torch.__version__}, shape {shape.describe()}, {scheme.name}")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "backends" / tables.table_name(shape, scheme, name)
        points = {str(m): {"us": {"null": 1.0, "reference": 100.0}, "winner": "null", "errors": {}} for m in (1, 16, 256)}
        meta = {"device_name": name, "num_experts": shape.num_experts, "hidden": shape.hidden,
                "intermediate": shape.n, "top_k": shape.top_k, "scheme": scheme.name, "dtype": "bfloat16",
                "routing": "uniform", "mode": "layer"}
        tables.write_json_atomically(path, {"format": "moekit-backend-table", "version": 1, "meta": meta, "batch_sizes": points})

        it = iter(())

        def cycling():
            nonlocal it
            try:
                return next(it)
            except StopIteration:
                it = iter(sizes)
                return next(it)

        def sel(backend="auto"):
            return lambda: select.select_backend(shape, scheme, device, torch.bfloat16, cycling(), backend)

        n = 20000
        print(f"select_backend, auto (heuristic, no table)   {per_call_us(sel(), n, sync):7.2f} us/call")
        os.environ[tables.CONFIG_DIR_ENV] = tmp
        t0 = time.perf_counter()
        first = select.select_backend(shape, scheme, device, torch.bfloat16, 3)
        cold = (time.perf_counter() - t0) * 1e6
        assert first.source == "table" and first.backend == "null", first
        print(f"select_backend, auto (table)                 {per_call_us(sel(), n, sync):7.2f} us/call"
              f"   (first call of the problem, reading the table: {cold:.0f} us)")
        print(f"select_backend, named backend                {per_call_us(sel('reference'), n, sync):7.2f} us/call")

        weights = moekit.quantize_weights(
            torch.randn(shape.num_experts, 2 * shape.n, shape.hidden, device=device) / shape.hidden**0.5,
            torch.randn(shape.num_experts, shape.hidden, shape.n, device=device) / shape.n**0.5, scheme,
        )
        spec = ModelSpec("bench", shape, scheme, RoutingConfig(top_k=shape.top_k), "bench")
        layer_auto = moekit.MoELayer.from_model(spec, weights)  # auto: the table says null
        layer_null = moekit.MoELayer.from_model(spec, weights, backend="null")
        M = 4
        x = torch.randn(M, shape.hidden, device=device, dtype=torch.bfloat16)
        logits = torch.randn(M, shape.num_experts, device=device)
        tw, ids = moekit.route(logits, shape.top_k)
        n = 5000
        fm = per_call_us(lambda: moekit.fused_moe(x, weights, tw, ids, backend="null"), n, sync)
        fm_auto = per_call_us(lambda: moekit.fused_moe(x, weights, tw, ids), n, sync)
        ln = per_call_us(lambda: layer_null(x, tw, ids), n, sync)
        la = per_call_us(lambda: layer_auto(x, tw, ids), n, sync)
        lr = per_call_us(lambda: layer_auto(x, logits), n, sync)
        route_us = per_call_us(lambda: moekit.route(logits, config=spec.routing), n, sync)
        print(f"fused_moe, null backend named (M={M})         {fm:7.2f} us/call  (input checks + selection + dispatch)")
        print(f"fused_moe, auto -> null from the table        {fm_auto:7.2f} us/call")
        print(f"MoELayer(x, tw, ids), backend='null'         {ln:7.2f} us/call  (overhead over fused_moe: {ln - fm:+.2f} us)")
        print(f"MoELayer(x, tw, ids), auto -> null           {la:7.2f} us/call  (overhead over fused_moe: {la - fm_auto:+.2f} us)")
        print(f"MoELayer(x, router_logits), auto -> null     {lr:7.2f} us/call  (route alone: {route_us:.2f} us)")
        os.environ.pop(tables.CONFIG_DIR_ENV, None)


if __name__ == "__main__":
    main()
