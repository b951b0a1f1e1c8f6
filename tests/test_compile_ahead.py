"""moekit.warmup / MoELayer.warmup / `moekit warmup`: the triton kernels compiled ahead, none launched."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import random_weights

import moekit
from moekit import compile_ahead, select
from moekit.backends.compile_only import compiling_only
from moekit.backends.triton import _kernels, launch
from moekit.cli import _ranges, main
from moekit.compile_ahead import MAX_WARMUP_BATCH, batch_sizes_to_warm, compiled_variants, size_classes, warmup
from moekit.routing import RoutingConfig
from moekit.select import BackendUnavailableError, Choice

CUDA = torch.cuda.is_available()
E, H, N, K = 4, 128, 128, 2


@pytest.fixture
def weights(device):
    return random_weights(E, H, N, "fp8-channel-token", device=device)


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch of the triton backend: (kernel name, compile-only at the time, M, the
    arguments as Triton specializes them)."""
    seen: list[tuple[str, bool, int, tuple]] = []
    real_launch, real_run = launch._launch, launch.TritonBackend.run
    current = {"M": None}

    def spy_launch(kernel, grid, *args, **kwargs):
        seen.append((getattr(kernel, "__name__", str(kernel)), compiling_only(), current["M"],
                     specialization(args, kwargs)))
        return real_launch(kernel, grid, *args, **kwargs)

    def spy_run(self, x, weights, topk_weights, topk_ids, config=None):
        current["M"] = x.shape[0]
        return real_run(self, x, weights, topk_weights, topk_ids, config)

    monkeypatch.setattr(launch, "_launch", spy_launch)
    monkeypatch.setattr(launch.TritonBackend, "run", spy_run)
    import moekit.backends.triton.gemv as gemv

    monkeypatch.setattr(gemv, "_launch", spy_launch)
    return seen


@pytest.fixture
def glue_launches(monkeypatch):
    """Every launch of the glue's kernels (cutlass's and torch's, fused_moe's id narrowing and
    check): (kernel name, grid, compile-only at the time, the arguments as Triton specializes them)."""
    from moekit.backends.compile_only import launch as real_launch
    from moekit.backends.glue import ops

    seen: list[tuple[str, tuple, bool, tuple]] = []

    def spy(kernel, grid, *args, **kwargs):
        seen.append((getattr(kernel, "__name__", str(kernel)), tuple(grid), compiling_only(),
                     specialization(args, kwargs)))
        return real_launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(ops, "launch", spy)
    return seen


def specialization(args, kwargs) -> tuple:
    """What Triton compiles a kernel for, per argument: a tensor's dtype and whether its address is
    16-byte aligned, an integer's being 1 or a multiple of 16, the value of anything else (the
    constexprs and options)."""
    def one(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", str(v.dtype), v.data_ptr() % 16 == 0)
        if isinstance(v, bool) or not isinstance(v, int):
            return repr(v)
        return ("int", v == 1, v % 16 == 0)

    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def test_the_calls_after_warmup_need_no_other_kernel(weights, launches, monkeypatch):
    """Every kernel and specialization a real call launches at a size was reached by warmup at
    that size: int32 ids (moekit's router) and int64 ids (transformers' routers), real inputs
    against warmup's empty views."""
    from helpers import random_routing, random_x

    from moekit import api

    # ids checked on the device, as on a GPU: int64 ids reach the triton backend as they are (on
    # the CPU fused_moe checks them on the host and passes int32)
    monkeypatch.setattr(api, "_ids_checked_on_device", lambda ids: True)

    sizes = [1, 3, 16, 17, 40]
    warmup(weights, K, batch_sizes=sizes, backend="triton")
    warmed = {(name, m, sig) for name, _, m, sig in launches}
    launches.clear()
    for M in sizes:
        x = random_x(M, H, device=weights.device, seed=M)
        tw, ids = random_routing(M, E, K, device=weights.device, seed=M)
        for topk_ids in (ids, ids.long()):
            moekit.fused_moe(x, weights, tw, topk_ids, backend="triton")
    real = {(name, m, sig) for name, _, m, sig in launches}
    assert real and real <= warmed, sorted(real - warmed)[:3]


def test_warmup_reaches_a_tuned_gemv_entry_with_its_own_gemm2_launch(weights, launches, monkeypatch):
    """A table's GEMV entry with GEMM2 on a column block and warps of its own (KernelConfig's
    BLOCK_N2 / num_warps2) is warmed as the calls run it: gemv2_kernel on GEMM2's block and warps,
    and the tiled entry beyond the GEMV path's bound."""
    from helpers import random_routing, random_x

    from moekit import tables
    from moekit.backends.triton import KernelConfig, config

    gemv = KernelConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=2, num_stages=1, GEMV=1)
    own = gemv.with_gemm2(BLOCK_N=64, num_warps=4)
    monkeypatch.setattr(config, "tuned_configs", lambda *a: ({1: own, 16: KernelConfig(16, 64, 128, 1, 4, 2)}, None))
    # a device name for the lookup, as on a GPU (on the CPU the backend reads no table)
    monkeypatch.setattr(launch, "get_config", lambda shape, scheme, m, name: config.get_config(shape, scheme, m, "GPU"))
    from moekit.backends.triton import gemv as gemv_module

    gemv2_launches = []  # (BLOCK_N, num_warps, compile-only) of every gemv2_kernel launch
    spy = gemv_module._launch  # the `launches` fixture's

    def recording(kernel, grid, *args, **kwargs):
        if kernel is gemv_module.gk.gemv2_kernel:
            gemv2_launches.append((kwargs["BLOCK_N"], kwargs["num_warps"], compiling_only()))
        return spy(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(gemv_module, "_launch", recording)
    tables.clear_cache()
    try:
        sizes = [1, 16]
        warmup(weights, K, batch_sizes=sizes, backend="triton")
        warmed = {(name, m, sig) for name, _, m, sig in launches}
        launches.clear()
        for M in sizes:
            tw, ids = random_routing(M, E, K, device=weights.device, seed=M)
            moekit.fused_moe(random_x(M, H, device=weights.device, seed=M), weights, tw, ids, backend="triton")
        real = {(name, m, sig) for name, _, m, sig in launches}
        assert real and real <= warmed, sorted(real - warmed)[:3]
        # GEMM2's own block and warps, warmed (int32 and int64 ids) then run, at M = 1 only (the
        # tiled entry at 16)
        assert set(gemv2_launches) == {(64, 4, True), (64, 4, False)}
    finally:
        tables.clear_cache()  # the patched table must not outlive the test


def glue_signatures(glue_launches) -> set:
    """The kernels and specializations launched, with the grid's shape (its rank): the grid itself
    depends on the batch size, which both sides share."""
    return {(name, len(grid), sig) for name, grid, _, sig in glue_launches}


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_cutlass_warmup_reaches_every_glue_kernel_its_calls_launch(weights, glue_launches, ids_dtype):
    """cutlass's compile_ahead compiles the glue kernels (and specializations) that run_cutlass
    launches at the same size, on empty inputs, without running its GEMMs (an emulated grouped GEMM
    stands in for torch's on the CPU in the real calls)."""
    from helpers import random_routing, random_x
    from test_glue import emulated_scaled_grouped_mm

    from moekit.backends import cutlass
    from moekit.backends.compile_only import compile_only

    for M in (1, 3, 16, 40):
        glue_launches.clear()
        x = random_x(M, H, device=weights.device, seed=M)
        tw, ids = random_routing(M, E, K, device=weights.device, seed=M)
        cutlass.run_cutlass(x, weights, tw, ids.to(ids_dtype), gemm=emulated_scaled_grouped_mm)
        real = glue_signatures(glue_launches)
        glue_launches.clear()
        with compile_only():
            assert cutlass.CutlassBackend().compile_ahead(torch.empty_like(x), weights, torch.empty_like(tw),
                                                          torch.empty(M, K, dtype=ids_dtype, device=weights.device))
        assert glue_launches and all(only for _, _, only, _ in glue_launches)
        assert real and real <= glue_signatures(glue_launches), (M, sorted(real - glue_signatures(glue_launches))[:2])


def emulated_grouped_mm(a, b, offs):
    """torch's grouped_mm on the CPU: out[rows of e] = a[rows of e] @ b[e], groups ending at offs."""
    out = torch.zeros(a.shape[0], b.shape[-1], dtype=a.dtype, device=a.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = (a[start:end].float() @ b[e].float()).to(a.dtype)
        start = end
    return out


@pytest.mark.parametrize("path", ["loop", "grouped"])
def test_torch_backend_warmup_reaches_every_glue_kernel_its_calls_launch(glue_launches, monkeypatch, device, path):
    """The torch backend's glue, on both its paths (per-expert loop, grouped_mm: emulated on the
    CPU, where the Triton glue is patched in): after warmup, real fused_moe calls at the warmed
    sizes launch no glue kernel or specialization that warmup did not reach, int32 and int64 ids;
    and during warmup no GEMM ran, no offset was read and the weights were not prepared (the
    FP8 weights' dequantized copy: only their shapes are used)."""
    from helpers import random_routing, random_x

    from moekit import api
    from moekit.backends import torch_backend

    if device.type == "cpu":
        monkeypatch.setattr(torch_backend, "_glue_impl", lambda device: "triton")
        monkeypatch.setattr(api, "_ids_checked_on_device", lambda ids: True)  # int64 ids as on a GPU
        monkeypatch.setattr(torch_backend, "_use_grouped_mm", lambda x, w: path == "grouped")
        monkeypatch.setattr(torch_backend, "grouped_mm_fn", lambda: emulated_grouped_mm)
    elif path == "loop":
        pytest.skip("on a GPU bf16 takes the grouped path; the loop path is tested on the CPU")
    gemms = []
    real_mm = torch_backend._per_expert_mm
    monkeypatch.setattr(torch_backend, "_per_expert_mm", lambda a, w, ends, out: (gemms.append(list(ends)),
                                                                                  real_mm(a, w, ends, out)))
    warming, prepare = [True], torch_backend.prepared_weights

    def prepared_weights(*args):
        assert not warming[0], "warmup prepared the weights"
        return prepare(*args)

    monkeypatch.setattr(torch_backend, "prepared_weights", prepared_weights)
    w = random_weights(E, H, N, "fp8-channel-token", device=device)
    sizes = [1, 3, 16, 40]
    report = warmup(w, K, batch_sizes=sizes, backend="torch")
    assert report.sizes == {"torch": tuple(sizes)} and report.compiled == ("torch",)
    assert all(ends == [] for ends in gemms) and len(gemms) == (2 * 2 * len(sizes) if path == "loop" else 0)
    warming[0] = False
    warmed = glue_signatures(glue_launches)
    glue_launches.clear()
    for M in sizes:
        x = random_x(M, H, device=device, seed=M)
        tw, ids = random_routing(M, E, K, device=device, seed=M)
        for topk_ids in (ids, ids.long()):
            moekit.fused_moe(x, w, tw, topk_ids, backend="torch")
    real = glue_signatures(glue_launches)
    assert real and real <= warmed, sorted(real - warmed)[:2]


def test_every_size_runs_the_launch_code_compiling_only(weights, launches):
    report = warmup(weights, K, batch_sizes=[17, 1, 3, 3, 64], backend="triton")
    assert report.sizes == {"triton": (1, 3, 17, 64)} and report.compiled == ("triton",)
    assert report.triton_sizes == (1, 3, 17, 64)
    assert {entry[2] for entry in launches} == {1, 3, 17, 64}  # each size's own launch code ran
    assert launches and all(entry[1] for entry in launches)  # and launched nothing
    assert not compiling_only()  # left as it was
    if not CUDA:
        assert report.new_variants == 0  # the interpreter compiles nothing
    # max_batch_size: every size from 1; the dtype by name, as select_backend takes it
    launches.clear()
    assert warmup(weights, K, 5, backend="triton", dtype="bf16").triton_sizes == (1, 2, 3, 4, 5)


def test_auto_warms_each_size_on_the_backend_it_gives_it(weights, launches, glue_launches, monkeypatch):
    from moekit import api

    real = select.select_backend

    def pretend(shape, scheme, device, dtype=torch.bfloat16, num_tokens=1, backend="auto", **kw):
        if backend in (None, "auto") and num_tokens > 4:
            return Choice("cutlass", "table", "test: cutlass from 5 up", {})
        return real(shape, scheme, device, dtype, num_tokens, "triton", **kw)

    monkeypatch.setattr(select, "select_backend", pretend)
    report = warmup(weights, K, 8)
    assert report.sizes == {"triton": (1, 2, 3, 4), "cutlass": (5, 6, 7, 8)}
    assert report.compiled == ("triton", "cutlass")
    assert {entry[2] for entry in launches} == {1, 2, 3, 4}  # the triton backend's launch code at its sizes
    # cutlass's: the glue (the triton backend launches none), at its sizes: _permute_kernel has a
    # program per token, so its grid tells them
    assert {grid[0] for name, grid, _, _ in glue_launches if name == "_permute_kernel"} == {5, 6, 7, 8}
    assert glue_launches and all(only for _, _, only, _ in glue_launches)
    # a backend with no Triton kernels of its own: its sizes; of the glue only fused_moe's id
    # narrowing (int64 ids) and range check, which it needs where ids are checked on the device
    monkeypatch.setattr(select, "select_backend", lambda *a, **kw: Choice("reference", "argument", "named", {}))
    for on_device in (False, True):
        monkeypatch.setattr(api, "_ids_checked_on_device", lambda ids, on=on_device: on)
        launches.clear()
        glue_launches.clear()
        report = warmup(weights, K, 3, backend="reference")
        assert report.sizes == {"reference": (1, 2, 3)} and report.compiled == () and not launches
        kernels = sorted({name for name, *_ in glue_launches})
        assert kernels == (["_ids_in_range_kernel", "_narrow_ids_kernel"] if on_device else []), kernels
        assert all(only for _, _, only, _ in glue_launches)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "give max_batch_size .* or batch_sizes, not both or neither"),
    ({"max_batch_size": 4, "batch_sizes": [1]}, "not both or neither"),
    ({"max_batch_size": 0}, "max_batch_size must be a positive integer, got 0"),
    ({"max_batch_size": 2.0}, "max_batch_size must be a positive integer, got 2.0"),
    ({"batch_sizes": [1, -3]}, "batch size must be a positive integer, got -3"),
    ({"batch_sizes": []}, "batch_sizes is empty"),
    ({"batch_sizes": [MAX_WARMUP_BATCH + 1]}, f"above {MAX_WARMUP_BATCH}"),
])
def test_bad_sizes_are_refused(weights, kwargs, message):
    with pytest.raises(ValueError, match=message):
        warmup(weights, K, **kwargs)


def test_ids_dtypes_are_checked(weights, launches):
    with pytest.raises(ValueError, match="ids_dtypes must name torch.int32 and/or torch.int64"):
        warmup(weights, K, 2, ids_dtypes=(torch.int16,))
    with pytest.raises(ValueError, match="ids_dtypes must name"):
        warmup(weights, K, 2, ids_dtypes=())
    warmup(weights, K, batch_sizes=[5], backend="triton", ids_dtypes=(torch.int64,))
    assert launches and all(e[3][0] == ("tensor", "torch.int64", True) for e in launches if e[0] == "align_single_kernel")


def test_ids_dtypes_may_be_one_dtype(weights, launches):
    """warmup(ids_dtypes=torch.int32) raised "'torch.dtype' object is not iterable": one dtype
    is taken as `dtype` is, and warms what the one-element sequence warms."""
    warmup(weights, K, batch_sizes=[5], backend="triton", ids_dtypes=(torch.int64,))
    as_sequence = list(launches)
    launches.clear()
    warmup(weights, K, batch_sizes=[5], backend="triton", ids_dtypes=torch.int64)
    assert launches == as_sequence and launches
    for bad in ("int32", 5, None):
        with pytest.raises(TypeError, match=rf"^ids_dtypes must be torch.int32, torch.int64 or a sequence of them, "
                                            rf"got {type(bad).__name__} "):
            warmup(weights, K, 2, ids_dtypes=bad)


def test_bad_input_is_refused(weights):
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[1, 4\]"):
        warmup(weights, 5, 2)
    with pytest.raises(TypeError, match="weights must be a moekit.MoEWeights"):
        warmup(weights.w13, K, 2)
    bf16 = random_weights(E, H, N, "bf16", device=weights.device)
    with pytest.raises(ValueError, match="dtype"):
        warmup(bf16, K, 2, dtype=torch.float16)  # unquantized weights must have x's dtype
    with pytest.raises(ValueError, match="'fp8' is not an activation dtype name"):
        warmup(weights, K, 2, dtype="fp8")


@pytest.mark.skipif(CUDA, reason="cutlass runs on a GPU")
def test_a_named_backend_that_cannot_run_says_why(weights):
    with pytest.raises(BackendUnavailableError):
        warmup(weights, K, 2, backend="cutlass")


def test_moelayer_warmup_takes_its_top_k_and_backend(weights, launches):
    layer = moekit.MoELayer(weights, RoutingConfig(top_k=K), backend="triton")
    assert layer.warmup(3).triton_sizes == (1, 2, 3)
    assert {entry[2] for entry in launches} == {1, 2, 3}
    with pytest.raises(ValueError, match="top_k=1 differs from this layer's RoutingConfig top_k 2"):
        layer.warmup(3, top_k=1)
    bare = moekit.MoELayer(weights, backend="triton")
    with pytest.raises(ValueError, match="no RoutingConfig: pass top_k"):
        bare.warmup(3)
    assert bare.warmup(batch_sizes=[7], top_k=1).triton_sizes == (7,)


def test_moelayer_warmup_also_warms_its_routing(weights, monkeypatch):
    """A layer that routes its own logits runs route's kernel first: warmed at the size classes,
    for float32 logits and the activation dtype, with the layer's correction bias."""
    calls = []
    monkeypatch.setattr(compile_ahead, "warm_routing", lambda *a: calls.append(a))
    routing = RoutingConfig(top_k=K, scoring="sigmoid", use_correction_bias=True)
    layer = moekit.MoELayer(weights, routing, backend="triton", correction_bias=torch.rand(E))
    layer.warmup(batch_sizes=[2, 32], dtype=torch.bfloat16)
    [(config, experts, sizes, device, dtypes, bias)] = calls
    assert (config, experts, sizes, device) == (routing, E, [2, 32], weights.device)
    assert dtypes == (torch.float32, torch.bfloat16) and torch.equal(bias, layer._buffers["e_score_correction_bias"])
    calls.clear()
    moekit.MoELayer(weights, backend="triton").warmup(3, top_k=K)  # no RoutingConfig: no routing of its own
    assert calls == []


def test_size_classes_are_the_ones_triton_specializes_on():
    assert size_classes([1, 2, 3, 16, 17, 32]) == [1, 2, 16]
    assert size_classes([48, 5]) == [48, 5]


def test_moelayer_warmup_refuses_an_expert_parallel_layer(weights):
    layer = types.SimpleNamespace(parallel="ep")  # the check comes first: no process group needed
    with pytest.raises(ValueError, match="does not take an expert-parallel layer"):
        moekit.MoELayer.warmup(layer, 4)


def test_compiled_variants_counts_the_kernel_caches(monkeypatch):
    class Kernel:  # what Triton's JITFunction keeps per device: (kernel cache, ...)
        def __init__(self, n):
            self.device_caches = {0: ({f"key{i}": object() for i in range(n)}, None, None)}

    base = compiled_variants()
    assert base is not None
    one, two = Kernel(2), Kernel(3)
    monkeypatch.setattr(_kernels, "fake_one", one, raising=False)
    monkeypatch.setattr(_kernels, "fake_two", two, raising=False)
    monkeypatch.setattr(_kernels, "fake_one_again", one, raising=False)  # one kernel under two names: once
    assert compiled_variants() == base + 5
    monkeypatch.setattr(_kernels, "fake_odd", types.SimpleNamespace(device_caches=["not", "a", "dict"]), raising=False)
    assert compiled_variants() is None  # a Triton that keeps them otherwise: said, not guessed


def test_batch_sizes_to_warm_and_ranges():
    assert batch_sizes_to_warm(3, None) == [1, 2, 3]
    assert batch_sizes_to_warm(None, [8, 2, 8]) == [2, 8]
    assert _ranges([1, 2, 3, 5, 6, 9]) == "1-3, 5-6, 9" and _ranges([]) == ""


def test_cli_reads_vllms_name_of_the_largest_batch():
    from moekit.cli import build_parser

    args = build_parser().parse_args(["warmup", "--model", "mixtral-8x7b", "--max-num-batched-tokens", "2048"])
    assert args.max_batch_size == 2048


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_cli_refuses_without_a_gpu(capsys):
    assert main(["warmup", "--model", "glm-4.5v-fp8", "--tp", "2"]) == 2
    assert "no CUDA GPU is visible here" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--model", "glm-4.5v-fp8", "--batch-sizes", "0"], "--batch-sizes: 0 is not a positive integer"),
    (["--model", "glm-4.5v-fp8", "--batch-sizes", "x"], "--batch-sizes: 'x' is not an integer"),
    (["--model", "glm-4.5v-fp8", "--max-batch-size", str(MAX_WARMUP_BATCH + 1)], f"above {MAX_WARMUP_BATCH}"),
    (["--model", "glm-4.5v-fp8", "--tp", "0"], "--tp must be a positive integer"),
    (["--model", "glm-4.5v-fp8", "--max-batch-size", "0"], "--max-batch-size must be a positive integer, got 0"),
    (["--model", "glm-4.5v-fp8", "--scheme", "nope"], "unknown quantization scheme 'nope'"),
    (["--model", "qwen3-30b-a3b-fp8", "--tp", "4"], "multiple of 128"),  # block scales, N = 192 per GPU
    (["--model", "glm-4.5v-fp8", "--batch-sizes", "8", "--max-batch-size", "64"], "not both"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(["warmup", *args]) == 2
    out = capsys.readouterr().out
    assert message in " ".join(out.split()) and out.count("\n") == 1


@pytest.mark.gpu
def test_after_warmup_the_calls_compile_nothing(device):
    """On a GPU: warmup compiles what the calls at its sizes need (in this process), so those
    calls compile nothing more, and they compute as without it. A shape no other test uses, so
    that the kernels are not compiled already."""
    w = random_weights(6, 384, 256, "fp8-channel-token", device=device)
    sizes = [1, 2, 5, 16, 33, 100]
    report = warmup(w, 3, batch_sizes=sizes, backend="triton")
    assert report.new_variants is not None and report.new_variants > 0
    count = compiled_variants()
    from helpers import random_routing, random_x, rel_l2

    from moekit.backends.reference import reference_moe
    from moekit.check import intermediate_granularity

    for M in sizes:
        x = random_x(M, 384, device=device, seed=M)
        tw, ids = random_routing(M, 6, 3, device=device, seed=M)
        out = moekit.fused_moe(x, w, tw, ids, backend="triton")
        # the reference quantizes the intermediate by the backend's rule (per 1x128 group here), as
        # test_triton_backend.py's reference_for does; against the scheme's per-row rule a single
        # token differs by one FP8 rounding of its intermediate (1.8e-2 measured at M = 1)
        ref = reference_moe(x, w, tw, ids, intermediate_granularity=intermediate_granularity("triton", w.scheme))
        rel = rel_l2(out, ref)
        assert rel < 1e-2, (M, rel)  # test_triton_backend.REL_L2_TOL (derived there): compiled ahead, same kernels
    assert compiled_variants() == count
    assert warmup(w, 3, batch_sizes=sizes, backend="triton").new_variants == 0  # again: nothing left to compile


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cutlass", "torch"])
def test_after_warmup_the_glue_compiles_nothing(device, backend):
    """On a GPU: warmup compiles the glue kernels that cutlass's and torch's calls launch (their
    GEMMs are torch's), so calls at the warmed sizes compile no Triton kernel more. A shape no
    other test uses. (Their accuracy is tested in test_glue.py and test_cutlass_gpu.py.)"""
    from helpers import random_routing, random_x

    scheme = "fp8-channel-token" if backend == "cutlass" else "bf16"
    w = random_weights(6, 400, 272, scheme, device=device)
    sizes = [1, 2, 5, 16, 33, 100]
    report = warmup(w, 3, batch_sizes=sizes, backend=backend)
    assert report.compiled == (backend,) and report.new_variants is not None and report.new_variants > 0
    count = compiled_variants()
    for M in sizes:
        x = random_x(M, 400, device=device, seed=M)
        tw, ids = random_routing(M, 6, 3, device=device, seed=M)
        for topk_ids in (ids, ids.long()):
            assert torch.isfinite(moekit.fused_moe(x, w, tw, topk_ids, backend=backend)).all()
    assert compiled_variants() == count


def test_the_id_check_is_compiled_not_asserted_compiling_only(monkeypatch, device):
    """Compiling only, the range check's kernel is compiled but its result is never computed: the
    device assertion on it must not run (on a GPU it would assert on uninitialized memory)."""
    from moekit import api
    from moekit.backends.compile_only import compile_only

    asserted = []
    monkeypatch.setattr(torch, "_assert_async", lambda *a: asserted.append(a))
    ids = torch.zeros(3, 2, dtype=torch.int32, device=device)  # on CUDA there: the check's kernel reads it
    with compile_only():
        api.assert_ids_in_range(ids, 4)
    assert asserted == []
    api.assert_ids_in_range(ids, 4)  # outside: asserted as always
    assert len(asserted) == 1
