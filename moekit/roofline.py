"""The roofline of an MoE layer: what it must move and compute, and how fast the card can do either.

Counts (DESIGN.md, "Measuring"), for M tokens with top-k = K:
    flops = 2 * M * K * 3 * N * H            (GEMM1 [2N x H] and GEMM2 [H x N] per (token, expert))
    bytes = touched * 3 * N * H * weight bytes    (every expert that receives a token is read once:
                                                   1 byte per FP8 weight, 2 per bf16/fp16 weight)
          + touched * scale bytes per expert      (float32 weight scales; static activation scales)
          + M * H * 2 * activation bytes          (x read, out written)
          + M * K * 8                             (topk_ids int32 and topk_weights float32 read)
The intermediate [M*K, N] and any per-pair GEMM2 output are not counted: a fused kernel never
sends them to memory, so the floor stays the physical limit.

Ceilings, measured once per device and cached (JSON, keyed by device name + torch + triton):
    copy bandwidth: the faster of two ways to move 1 GiB through device memory, counting bytes
        read + written: cudaMemcpy (Tensor.copy_) and one elementwise pass (torch.neg, 16-byte
        accesses). cudaMemcpy alone measured 2.44 TB/s on an H100 where the anchors' copy reached
        3.00 and moekit's own GEMMs read faster than it (efficiencies above 1; BENCHMARKS.md,
        twenty-fourth session): a ceiling below what a kernel reaches bounds nothing;
    FP8 matmul rate: torch._scaled_mm 8192^3 with row-wise scales (bf16 output);
    bf16 matmul rate: torch.matmul 8192^3 in bf16 (the rate of the unquantized scheme, and the
        FP8 rate's stand-in on a card without FP8).
    floor_us = max(bytes / copy bandwidth, flops / matmul rate); efficiency = floor / time.
On the CPU nothing is measured: floors and efficiencies stay empty.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import tempfile
from pathlib import Path

import torch

from . import quant
from .spec import MoEShape, QuantScheme, get_scheme

CACHE_FILE = "ceilings.json"
# Part of the cache key: ceilings measured another way are measured again (cudaMemcpy alone, before
# 2026-12-05, gave a copy bandwidth below what kernels read).
CEILINGS_METHOD = "copy best of memcpy and elementwise"
_MATMUL_SIZE = 8192
_COPY_BYTES = 1024**3


# ------------------------------------------------------------------------------------ counts


@dataclasses.dataclass(frozen=True)
class Counts:
    flops: int
    bytes: int
    weight_bytes: int  # weights and scales of the touched experts
    activation_bytes: int  # x, out, routing
    experts_touched: float  # an expectation (float) when no routing was given


def expected_experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Experts that receive at least one token under uniform random top-k routing."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def scale_bytes_per_expert(shape: MoEShape, scheme: QuantScheme) -> int:
    """Bytes of one expert's float32 weight scales (w13 and w2), plus static activation scales."""
    if not scheme.is_fp8:
        return 0
    n, h = shape.n, shape.hidden
    per_expert = 0
    for rows, cols in ((2 * n, h), (h, n)):
        count = 1
        for size in quant.weight_scale_shape(scheme.weight, 1, rows, cols)[1:]:
            count *= size
        per_expert += 4 * count
    return per_expert + (8 if scheme.static_activation else 0)


def count(
    shape: MoEShape,
    scheme: QuantScheme | str,
    num_tokens: int,
    topk_ids: torch.Tensor | None = None,
    act_dtype: torch.dtype = torch.bfloat16,
) -> Counts:
    """Flops and bytes of one layer call. `topk_ids` gives the experts actually touched; without
    it the uniform-routing expectation is used."""
    scheme = get_scheme(scheme)
    M, K, N, H = num_tokens, shape.top_k, shape.n, shape.hidden
    if topk_ids is not None:
        touched: float = int(torch.unique(topk_ids).numel()) if topk_ids.numel() else 0
    else:
        touched = expected_experts_touched(shape.num_experts, K, M)
    weight_elem_bytes = 1 if scheme.is_fp8 else 2
    weight_bytes = touched * (3 * N * H * weight_elem_bytes + scale_bytes_per_expert(shape, scheme))
    act_bytes = M * H * 2 * torch.empty(0, dtype=act_dtype).element_size() + M * K * 8
    flops = 2 * M * K * 3 * N * H
    return Counts(flops, int(round(weight_bytes + act_bytes)), int(round(weight_bytes)), act_bytes, touched)


# ---------------------------------------------------------------------------------- ceilings


@dataclasses.dataclass(frozen=True)
class Ceilings:
    device: str
    copy_gbps: float  # device-to-device copy, bytes read + written, GB/s (1e9)
    bf16_tflops: float
    fp8_tflops: float | None  # None where no FP8 matmul ran
    torch: str
    triton: str
    measured: str  # ISO date of the measurement
    source: str = "measured"  # "measured" now, or "cache"
    copy_method: str = "memcpy"  # the way that gave copy_gbps (COPY_WAYS)

    def matmul_tflops(self, scheme: QuantScheme) -> float:
        """The rate that bounds this scheme's GEMMs."""
        if scheme.is_fp8 and self.fp8_tflops:
            return self.fp8_tflops
        return self.bf16_tflops

    def describe(self) -> str:
        fp8 = f"FP8 {self.fp8_tflops:.0f} TFLOP/s" if self.fp8_tflops else "no FP8 matmul"
        return (
            f"copy {self.copy_gbps / 1e3:.2f} TB/s ({self.copy_method}), {fp8}, bf16 {self.bf16_tflops:.0f} TFLOP/s "
            f"({self.source}, {self.measured})"
        )


def floor_us(counts: Counts, ceilings: Ceilings | None, scheme: QuantScheme) -> float | None:
    """The physical lower bound of one call in µs; None without ceilings (CPU)."""
    if ceilings is None:
        return None
    memory = counts.bytes / (ceilings.copy_gbps * 1e9)
    compute = counts.flops / (ceilings.matmul_tflops(scheme) * 1e12)
    return max(memory, compute) * 1e6


def cache_dir() -> Path:
    """MOEKIT_CACHE_DIR, else $XDG_CACHE_HOME/moekit, else ~/.cache/moekit."""
    if os.environ.get("MOEKIT_CACHE_DIR"):
        return Path(os.environ["MOEKIT_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moekit"


def _versions() -> tuple[str, str]:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - triton is optional off Linux
        triton_version = "none"
    return torch.__version__, triton_version


def cache_key(device_name: str) -> str:
    torch_v, triton_v = _versions()
    return f"{device_name} | torch {torch_v} | triton {triton_v} | {CEILINGS_METHOD}"


def _read_cache(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ceilings.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def get_ceilings(device: torch.device | str | None = None, *, refresh: bool = False) -> Ceilings | None:
    """The device's ceilings: from the cache, else measured now (a few seconds) and cached.
    None on the CPU. A cache that cannot be written is not an error: the values are still used."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    key = cache_key(name)
    path = cache_dir() / CACHE_FILE
    data = _read_cache(path)
    entry = data.get(key)
    if not refresh and isinstance(entry, dict):
        try:
            fields = {f.name for f in dataclasses.fields(Ceilings)}
            return Ceilings(**{**{k: v for k, v in entry.items() if k in fields}, "source": "cache"})
        except TypeError:
            pass  # an entry of an older layout: measure again
    ceilings = measure_ceilings(device)
    data[key] = dataclasses.asdict(ceilings)
    try:
        _write_cache(path, data)
    except OSError:
        pass
    return ceilings


# Ways to move a buffer through device memory (src, dst: float32 of one size), each reading it and
# writing it once: the copy ceiling is the fastest (module docstring).
COPY_WAYS = {
    "memcpy": lambda src, dst: dst.copy_(src),
    "elementwise": lambda src, dst: torch.neg(src, out=dst),
}


def best_copy(median_us: dict[str, float], bytes_moved: int) -> tuple[float, str]:
    """(GB/s, way) of the fastest way: `median_us` per COPY_WAYS name, `bytes_moved` read +
    written by each."""
    name = min(median_us, key=median_us.get)
    return bytes_moved / (median_us[name] * 1e-6) / 1e9, name


@torch.no_grad()
def measure_ceilings(device: torch.device) -> Ceilings:
    """Measure copy bandwidth and matmul rates on a CUDA device, with the shared harness."""
    from .timing import time_graph

    with torch.cuda.device(device):
        src = torch.empty(_COPY_BYTES // 4, dtype=torch.float32, device=device).uniform_()
        dst = torch.empty_like(src)
        # 1 GiB dwarfs any L2, so no flush is needed; graphs drop launch overheads
        times = {name: time_graph(lambda way=way: way(src, dst), reps=20, warmup=3, flush_l2=False,
                                  device=device).median_us
                 for name, way in COPY_WAYS.items()}
        copy_gbps, copy_method = best_copy(times, 2 * _COPY_BYTES)
        src = dst = None  # freed (not `del`: the timed lambdas above name them)

        s = _MATMUL_SIZE
        flops = 2 * s**3
        a = torch.randn(s, s, device=device, dtype=torch.bfloat16)
        b = torch.randn(s, s, device=device, dtype=torch.bfloat16)
        t = time_graph(lambda: a @ b, reps=20, warmup=3, flush_l2=False, device=device)
        bf16_tflops = flops / (t.median_us * 1e-6) / 1e12

        fp8_tflops = None
        try:
            a8 = a.to(quant.FP8_DTYPE)
            b8 = b.to(quant.FP8_DTYPE).t()  # column-major second operand, as _scaled_mm requires
            scale_a = torch.ones(s, 1, device=device, dtype=torch.float32)  # row-wise scales
            scale_b = torch.ones(1, s, device=device, dtype=torch.float32)

            def fp8_mm():
                return torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)

            fp8_mm()
            t = time_graph(fp8_mm, reps=20, warmup=3, flush_l2=False, device=device)
            fp8_tflops = flops / (t.median_us * 1e-6) / 1e12
        except Exception:  # noqa: BLE001 - no FP8 matmul on this card or build
            fp8_tflops = None
        a = b = None  # freed (see above)

    torch_v, triton_v = _versions()
    return Ceilings(
        device=torch.cuda.get_device_name(device),
        copy_gbps=copy_gbps,
        bf16_tflops=bf16_tflops,
        fp8_tflops=fp8_tflops,
        copy_method=copy_method,
        torch=torch_v,
        triton=triton_v,
        measured=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    )


__all__ = [
    "Counts",
    "Ceilings",
    "count",
    "expected_experts_touched",
    "floor_us",
    "get_ceilings",
    "measure_ceilings",
    "cache_dir",
]
