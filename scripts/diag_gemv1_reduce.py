"""Probe: where GEMM1 of the GEMV path loses time at decode sizes (GLM-4.5V TP2 M = 1 reads its
46 MB at about 1.65 TB/s on an H100, BENCHMARKS.md twenty-ninth session). Four kernels on the
same grid, channel-token FP8 only (per-token x scales, per-channel weight scales):

- `gemv1`: the backend's own (gemv.gemv1), which reduces each K step across its 128-wide rows
  (tl.sum per step) before adding it to the [BLOCK_N] sums;
- `late`: the same products added elementwise into [BLOCK_N, BLOCK_K] float32 accumulators, one
  reduction after the K loop (fewer cross-thread sums per step, more registers);
- `dot`: the same products on the tensor cores with the operands swapped (the pair's weight rows
  are the product's rows, its activation row the one non-zero column of a 16-column operand), one
  product per K step of 128 or 256 added into float32: far fewer instructions per weight byte
  than the CUDA cores' conversions and FMAs, at column blocks of 16-64;
- `read`: the same loads summed elementwise with no product and no activation: what this grid and
  access pattern can read at best, the ceiling for `gemv1` and `late`.

`late` and `read` over column blocks 1-8, K steps 256-4096 (at most 8192 values per accumulator),
2 or 4 warps and 1 or 3 stages; `dot` over column blocks 16-64, K steps 128 and 256, 2 or 4
warps, 3 or 4 stages; all in the same rounds. `late`'s and `dot`'s outputs are checked against
`gemv1`'s (5e-3 relative L2: the tensor cores sum each step's products in their own order and
precision). Not part of the package: a measurement to decide what to build (BENCHMARKS.md).

    PYTHONPATH=. python3 scripts/diag_gemv1_reduce.py [--points glm-4.5v-fp8:2:1 ...] [--json FILE]
"""
import itertools

import torch
import triton
import triton.language as tl

from moekit.backends.triton import gemv
from moekit.backends.triton._kernels import _to_dtype
from moekit.backends.triton.launch import _interpreting, _scale_strides
from moekit.timing import time_graphs

# scripts/ is on the path when a script runs
from diag_points import cuda_triton, gemv_config, layer_points, points_parser, print_gemm_times, write_json


@triton.jit
def _pair_columns(ids_ptr, N, K_TOP, BLOCK_N: tl.constexpr):
    """This program's pair, token, expert and BLOCK_N columns of N, as gemv1_kernel has them."""
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pair, (pair // K_TOP).to(tl.int64), tl.load(ids_ptr + pair).to(tl.int64), cols, cols < N


@triton.jit
def _store_activation(gs, us, a_scale_ptr, w_scale_ptr, out_ptr, pair, token, e, cols, col_ok, N,
                      stride_wse, stride_om, INTERPRET: tl.constexpr):
    """SiLU(gate) * up of the gate and up sums, with the token's and the columns' scales."""
    a_s = tl.load(a_scale_ptr + token)
    ws = w_scale_ptr + e * stride_wse
    gs *= a_s * tl.load(ws + cols, mask=col_ok, other=0.0)
    us *= a_s * tl.load(ws + N + cols, mask=col_ok, other=0.0)
    act = gs / (1.0 + tl.exp(-gs)) * us
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + cols, _to_dtype(act, out_ptr.dtype.element_ty, INTERPRET),
             mask=col_ok)


@triton.jit
def late_or_read_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, ids_ptr, N, H, K_TOP,
                        stride_am, stride_we, stride_wn, stride_wse, stride_om,
                        READ_ONLY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        STAGES: tl.constexpr, INTERPRET: tl.constexpr):
    pair, token, e, cols, col_ok = _pair_columns(ids_ptr, N, K_TOP, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + token * stride_am + ks
    gate_ptrs = w_ptr + e * stride_we + cols[:, None] * stride_wn + ks[None, :]
    up_ptrs = gate_ptrs + N * stride_wn
    g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        k_ok = ks < H - k0
        w_ok = col_ok[:, None] & k_ok[None, :]
        gate = tl.load(gate_ptrs, mask=w_ok, other=0.0).to(tl.float32)
        up = tl.load(up_ptrs, mask=w_ok, other=0.0).to(tl.float32)
        if READ_ONLY:
            g += gate
            u += up
        else:
            a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            g += gate * a
            u += up * a
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if READ_ONLY:
        tl.store(out_ptr + pair.to(tl.int64) * stride_om + cols,
                 _to_dtype(tl.sum(g, axis=1) + tl.sum(u, axis=1), out_ptr.dtype.element_ty, INTERPRET), mask=col_ok)
    else:
        _store_activation(tl.sum(g, axis=1), tl.sum(u, axis=1), a_scale_ptr, w_scale_ptr, out_ptr, pair, token, e,
                          cols, col_ok, N, stride_wse, stride_om, INTERPRET)


@triton.jit
def tensor_core_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, ids_ptr, N, H, K_TOP,
                       stride_am, stride_we, stride_wn, stride_wse, stride_om,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """The same products on the tensor cores, operands swapped: the pair's BLOCK_N weight rows are
    the product's 16+ rows and its activation row the only non-zero column of a 16-column operand
    (the smallest a dot takes), one product per K step added into float32."""
    pair, token, e, cols, col_ok = _pair_columns(ids_ptr, N, K_TOP, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    first_lane = tl.arange(0, 16)[None, :] == 0
    a_ptrs = a_ptr + token * stride_am + ks[:, None] + 0 * first_lane  # [BLOCK_K, 16], every column the row
    gate_ptrs = w_ptr + e * stride_we + cols[:, None] * stride_wn + ks[None, :]
    up_ptrs = gate_ptrs + N * stride_wn
    g = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    u = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        k_ok = ks < H - k0
        a = tl.load(a_ptrs, mask=k_ok[:, None] & first_lane, other=0.0)  # the row in column 0, zeros beside
        w_ok = col_ok[:, None] & k_ok[None, :]
        g += tl.dot(tl.load(gate_ptrs, mask=w_ok, other=0.0), a)
        u += tl.dot(tl.load(up_ptrs, mask=w_ok, other=0.0), a)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    _store_activation(tl.sum(g, axis=1), tl.sum(u, axis=1), a_scale_ptr, w_scale_ptr, out_ptr, pair, token, e,
                      cols, col_ok, N, stride_wse, stride_om, INTERPRET)  # column 0 alone is non-zero


def _launch_probe(kernel, a, a_scale, w, ids, out, block_n, warps, stages, **constexprs):
    """One of the probe kernels on GEMM1's grid: a program per (pair, block_n columns of N)."""
    M, K = ids.shape
    stride_wse, _ = _scale_strides(w.w13_scale)
    kernel[(M * K, triton.cdiv(w.n, block_n))](
        a, a_scale, w.w13, w.w13_scale, out, ids.reshape(-1), w.n, w.hidden, K,
        a.stride(0), w.w13.stride(0), w.w13.stride(1), stride_wse, out.stride(0),
        BLOCK_N=block_n, STAGES=stages, INTERPRET=_interpreting(), num_warps=warps, num_stages=stages, **constexprs)
    return out


def on_tensor_cores(a, a_scale, w, ids, out, block_n, block_k, warps, stages):
    return _launch_probe(tensor_core_kernel, a, a_scale, w, ids, out, block_n, warps, stages, BLOCK_K=block_k)


def probe(a, a_scale, w, ids, out, block_n, block_k, warps, stages, read_only):
    return _launch_probe(late_or_read_kernel, a, a_scale, w, ids, out, block_n, warps, stages, BLOCK_K=block_k,
                         READ_ONLY=read_only)


def tiles():
    """(BLOCK_N, BLOCK_K): the backend's GEMV tiles, and narrow ones reading rows end to end."""
    for block_n, block_k in itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048, 4096)):
        if block_n * block_k <= 8192 and (block_n >= 4 or block_k >= 1024):
            yield block_n, block_k


def main():
    ap = points_parser(["glm-4.5v-fp8:2:1", "glm-4.5v-fp8:2:4",
                        "mixtral-8x7b:1:1:fp8-channel-token"])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    args = ap.parse_args()
    dev, backend = cuda_triton()
    results = []
    for p in layer_points(args.points, dev):
        if p.w.scheme.name != "fp8-channel-token":
            raise SystemExit(f"{p.model}: this probe runs fp8-channel-token only, not {p.w.scheme.name}")
        cfg = gemv_config(backend, p, dev)
        a, a_scale = gemv.quantize_input(p.x, p.w)
        expected = gemv.gemv1(a, a_scale, p.w, p.ids, p.x.dtype, cfg, False)[0]
        out = torch.empty_like(expected)
        late = " late" if cfg.GEMV == 2 else ""  # the table's GEMM1 may reduce late itself
        fns = {f"gemm1 table N{cfg.BLOCK_N} K{cfg.BLOCK_K} w{cfg.num_warps} s{cfg.num_stages}{late}":
               lambda: gemv.gemv1(a, a_scale, p.w, p.ids, p.x.dtype, cfg, False)}
        variants = [("read" if r else "late", b, k, nw, s) for (b, k), nw, s, r in itertools.product(
            tiles(), args.warps, args.stages, (False, True))]
        variants += [("dot", b, k, nw, s) for b, k, nw, s in itertools.product(
            (16, 32, 64), (128, 256), args.warps, (3, 4))]
        for kind, block_n, block_k, warps, stages in variants:
            tag = f"gemm1 {kind} N{block_n} K{block_k} w{warps} s{stages}"
            read_only = kind == "read"

            def fn(kind=kind, b=block_n, k=block_k, nw=warps, s=stages, a=a, a_scale=a_scale, p=p, out=out):
                if kind == "dot":
                    return on_tensor_cores(a, a_scale, p.w, p.ids, out, b, k, nw, s)
                return probe(a, a_scale, p.w, p.ids, out, b, k, nw, s, kind == "read")
            try:
                got = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # out of registers or shared memory: reported, not timed
                print(f"  {tag}: cannot run: {str(exc)[:160]}")
                continue
            if not read_only:
                rel = float((got.float() - expected.float()).norm() / expected.float().norm())
                if rel > 5e-3:
                    print(f"  {tag}: differs from the backend's GEMM1, rel L2 {rel:.1e}: not timed")
                    continue
            fns[tag] = fn
        times = time_graphs(fns, reps=20, warmup=2, rounds=4)
        nbytes = int(torch.unique(p.ids).numel()) * 2 * p.w.n * p.w.hidden
        print(f"\n{p.model} tp{p.tp} M={p.M}: GEMM1 reads {nbytes / 1e6:.1f} MB", flush=True)
        table = next(iter(fns))
        for kind in ("late", "dot", "read"):  # the eight fastest of each kernel, and the table's
            ranked = sorted(((k, v) for k, v in times.items() if k.startswith(f"gemm1 {kind}")
                             and not isinstance(v, BaseException)), key=lambda kv: kv[1].median_us)[:8]
            for label, us in print_gemm_times(dict(ranked), nbytes, 0, width=30):
                results.append({"model": p.model, "tp": p.tp, "M": p.M, "what": label, "us": us})
        for label, us in print_gemm_times({table: times[table]}, nbytes, 0, width=30):
            results.append({"model": p.model, "tp": p.tp, "M": p.M, "what": label, "us": us})
        torch.cuda.empty_cache()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
