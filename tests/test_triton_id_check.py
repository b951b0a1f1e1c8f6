"""The triton backend checks the expert ids itself (Backend.checks_expert_ids): on every path, the
first kernel that reads topk_ids asserts on the device that each lies in [0, E), so fused_moe
launches no checking kernel of its own for it.

On the CPU the interpreter runs device_assert only when its builder's `debug` option is on (on a
GPU, launch.py compiles those kernels with Triton's `debug`); the tests here turn it on, so a
kernel that stopped checking fails them. A failed assertion on a GPU ends the process's CUDA
context, so the GPU test runs it in a child process."""

import dataclasses
import textwrap

import pytest
import torch

import moekit
from moekit.backends.triton import KernelConfig, launch

from helpers import RecordingKernel, assert_child_stops_with, compile_in_child, random_routing, random_weights, random_x


# the four ways the backend reads the routing first (launch.TritonBackend.run)
PATHS = {
    # (scheme, M, config)
    "GEMV path: gemv1": ("fp8-channel-token", 2, KernelConfig(16, 32, 256, 1, 2, 1, GEMV=1)),
    "decode prologue (align + quantize x)": ("fp8-channel-token", 2, KernelConfig(16, 32, 128, 1, 4, 2)),
    "one-program alignment": ("bf16", 2, KernelConfig(16, 32, 64, 1, 4, 2)),
    "multi-program alignment (count kernel)": ("bf16", 70, KernelConfig(16, 32, 64, 1, 4, 2)),  # 140 pairs
}


def _problem(scheme, M, E=5, H=128, N=96, K=2, device="cpu"):
    tw, ids = random_routing(M, E, K, device=device)
    return random_x(M, H, device=device), random_weights(E, H, N, scheme, device=device), tw, ids


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype,bad", [(torch.int32, 5), (torch.int32, -1), (torch.int32, 1000),
                                       (torch.int64, 5), (torch.int64, 2**32 + 3), (torch.int64, -(2**32) + 1)])
def test_each_path_asserts_an_id_out_of_range(path, dtype, bad, interpreter_asserts):
    """int64 ids too (transformers' routers give them; fused_moe hands them to this backend as
    they are, Backend.reads_int64_ids): 2**32 + 3 would be expert 3 if a kernel narrowed it before
    its check."""
    # CPU tensors in the interpreter only: without it (a GPU machine) they cannot reach the compiled
    # kernels, and on GPU tensors the assertion would end the CUDA context of every later test in
    # the process (test_gpu_an_id_out_of_range_stops_the_layer_with_the_message runs it in a child)
    if not launch._interpreting():
        pytest.skip("device_assert on CPU tensors runs only under TRITON_INTERPRET=1")
    scheme, M, cfg = PATHS[path]
    x, w, tw, ids = _problem(scheme, M)
    ids = ids.to(dtype)
    backend = moekit.get_backend("triton")
    backend.run(x, w, tw, ids, config=cfg)  # in range: no assertion (the same problem)
    ids[M - 1, 1] = bad  # the last pair: every chunk and program must check, not only the first
    with pytest.raises(BaseException, match=r"topk_ids outside \[0, num_experts\)"):
        backend.run(x, w, tw, ids, config=cfg)


def test_the_kernel_backends_say_they_check_and_reference_does_not():
    """triton checks in its own kernels, cutlass and torch in the glue's (test_glue_id_check.py)."""
    for name in ("triton", "cutlass", "torch"):
        assert moekit.get_backend(name).checks_expert_ids and moekit.get_backend(name).reads_int64_ids, name
    assert not moekit.get_backend("reference").checks_expert_ids
    assert not moekit.get_backend("reference").reads_int64_ids


@pytest.mark.parametrize("path", PATHS)
def test_int64_ids_run_as_they_are_with_the_int32_result(path, device, monkeypatch):
    """fused_moe gives the triton backend int64 ids without narrowing them (no glue.narrow_ids
    launch: counted here), and every path's output is bitwise the int32 ids' output. The
    reference backend still gets them narrowed. On the CPU the device path is forced."""
    import moekit.api as api
    from moekit.backends.glue import ops

    scheme, M, cfg = PATHS[path]
    x, w, tw, ids = _problem(scheme, M, device=device)
    narrowed = []
    monkeypatch.setattr(api, "_ids_checked_on_device", lambda ids: True)
    monkeypatch.setattr(api, "narrow_ids", lambda ids, E: (narrowed.append(ids.dtype), ops.narrow_ids(ids, E))[1])
    monkeypatch.setattr(moekit.get_backend("triton"), "config_for", lambda *args: cfg)
    out32 = moekit.fused_moe(x, w, tw, ids, backend="triton")
    out64 = moekit.fused_moe(x, w, tw, ids.long(), backend="triton")
    assert narrowed == [] and torch.equal(out64, out32)
    moekit.fused_moe(x, w, tw, ids.long(), backend="reference")
    assert narrowed == [torch.int64]


def test_checking_kernels_get_the_flag_and_the_debug_option(monkeypatch):
    """_launch passes CHECK_IDS=True to the kernels that take it, with Triton's `debug` on a GPU
    (without it device_assert compiles to nothing); other kernels get neither (only the FP fusion
    every launch on a GPU asks for)."""
    calls = []
    x = torch.zeros(2)
    monkeypatch.setattr(launch, "_interpreting", lambda: False)
    launch._launch(RecordingKernel(["ids_ptr", "CHECK_IDS"], calls), (1,), x)
    launch._launch(RecordingKernel(["x_ptr"], calls), (1,), x)
    monkeypatch.setattr(launch, "_interpreting", lambda: True)
    launch._launch(RecordingKernel(["ids_ptr", "CHECK_IDS"], calls), (1,), x)
    assert calls[0]["CHECK_IDS"] is True and calls[0]["debug"] is True
    from triton.backends.nvidia.compiler import CUDAOptions

    if "sanitize_overflow" in CUDAOptions.__dataclass_fields__:  # debug would add overflow checks everywhere
        assert calls[0]["sanitize_overflow"] is False
    assert calls[1] == {"enable_fp_fusion": True}  # every GPU launch asks for FP fusion (backends.triton_options)
    assert calls[2] == {"CHECK_IDS": True}  # the interpreter takes no compile options


_COMPILE_ID_READERS = """
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDAOptions
from triton.compiler import ASTSource
from moekit.backends.glue import _kernels as glue
from moekit.backends.triton import _gemv_kernels as g, _kernels as k, launch
from moekit.backends.triton_options import ASSERT_OPTIONS, compile_options

POINTERS = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "out_ptr": "*bf16"}
FLOATS = ("scale_ptr", "a_scale_ptr", "w_scale_ptr", "out_scale_ptr", "amax_ptr", "topk_weights_ptr")
common = {"CHECK_IDS": True, "PDL": True, "INTERPRET": False}
kernels = {
    "align_single_kernel": (k.align_single_kernel, {"BLOCK_M": 16, "CHUNK": launch.SINGLE_ALIGN_MAX_PAIRS,
                                                    "E_BLOCK": launch.E_BLOCK}),
    "align_count_kernel": (k.align_count_kernel, {"CHUNK": launch.CHUNK, "E_BLOCK": launch.E_BLOCK}),
    "align_scatter_kernel": (k.align_scatter_kernel, {"CHUNK": launch.CHUNK}),
    "decode_prologue_kernel": (k.decode_prologue_kernel, {"BLOCK_M": 16, "CHUNK": launch.SINGLE_ALIGN_MAX_PAIRS,
                               "E_BLOCK": launch.E_BLOCK, "MODE": 0, "BLOCK_H": 4096, "GROUP": 128}),
    "gemv1_kernel": (g.gemv1_kernel, {"A_SCALE": 3, "B_SCALE": 3, "OUT_MODE": 0, "ACT_DTYPE": tl.bfloat16,
                                      "BLOCK_N": 8, "GROUPS": 2, "STAGES": 1}),
    "gemv2_kernel": (g.gemv2_kernel, {"A_MODE": 0, "B_SCALE": 0, "K_TOP": 8, "K_POW2": 8, "BLOCK_N": 8,
                                      "GROUPS": 1, "STAGES": 1}),
    # the glue's (cutlass, torch: test_glue_id_check.py), as glue.ops.permute launches them
    "glue _rank_kernel": (glue._rank_kernel, {"BLOCK_P": 128, "BLOCK_E": 8}),
    "glue _permute_kernel": (glue._permute_kernel, {"QUANT": 1, "BLOCK_P": 128, "BLOCK_K": 8, "BLOCK_H": 256}),
}
options = {"num_warps": 4, **ASSERT_OPTIONS, **compile_options(False)}
if "launch_pdl" in CUDAOptions.__dataclass_fields__:
    options["launch_pdl"] = True
found = {}
for ids_type in ("*i32", "*i64"):
    for name, (kernel, constants) in kernels.items():
        signature, consts = {}, {}
        for i, param in enumerate(kernel.params):
            n = param.name
            if param.is_constexpr:
                signature[n] = "constexpr"
                consts[(i,)] = constants.get(n, common.get(n))
            elif n == "ids_ptr":
                signature[n] = ids_type
            elif n == "a_ptr" and name == "gemv2_kernel":  # its unquantized input (A_MODE 0)
                signature[n] = "*bf16"
            elif n == "w_ptr" and name == "gemv2_kernel":
                signature[n] = "*bf16"
            elif n in POINTERS or n in FLOATS or n.endswith("_ptr"):
                signature[n] = POINTERS.get(n, "*fp32" if n in FLOATS else "*i32")
            else:
                signature[n] = "i32"
        compiled = triton.compile(ASTSource(kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                                  options=options)
        found[f"{name} {ids_type}"] = "__assertfail" in compiled.asm["ptx"]
json.dump(found, sys.stdout)
"""


def test_the_kernels_reading_ids_compile_for_hopper_with_int64_ids():
    """Every kernel that reads topk_ids, compiled for sm_90 (without a GPU, in a process of its
    own: under TRITON_INTERPRET Triton compiles nothing) as launch.py launches it (Triton's
    `debug` for the check, PDL), with int32 and with int64 ids: each compiles, and those that
    check the ids (CHECK_IDS) keep the device-side assertion in their code."""
    import json

    found = json.loads(compile_in_child(["-c", _COMPILE_ID_READERS]))
    assert len(found) == 16
    checking = ("align_single_kernel", "align_count_kernel", "decode_prologue_kernel", "gemv1_kernel",
                "glue _rank_kernel")
    for key, asserts in found.items():
        assert asserts == key.startswith(checking), key


@pytest.mark.gpu
def test_gpu_fused_moe_leaves_the_check_to_the_triton_backend(monkeypatch):
    """fused_moe launches its own check only for backends that do not check (counted here), and
    the triton backend's output is unchanged by its check."""
    import moekit.api as api

    calls = []
    real = api.assert_ids_in_range
    monkeypatch.setattr(api, "assert_ids_in_range", lambda ids, E: (calls.append(E), real(ids, E)))
    x, w, tw, ids = _problem("fp8-channel-token", 3, device="cuda")
    out = moekit.fused_moe(x, w, tw, ids, backend="triton")
    assert calls == []
    ref = moekit.fused_moe(x, w, tw, ids, backend="reference")
    assert calls == [5]
    assert torch.isfinite(out).all() and out.shape == ref.shape


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", ["5", "2**32 + 3"])  # the second in int64 ids
def test_gpu_an_id_out_of_range_stops_the_layer_with_the_message(path, bad):
    scheme, M, cfg = PATHS[path]
    script = textwrap.dedent(f"""
        import sys, torch, moekit
        sys.path.insert(0, "tests")
        from helpers import random_routing, random_weights, random_x
        from moekit.backends.triton import KernelConfig
        x, w = random_x({M}, 128, device="cuda"), random_weights(5, 128, 96, {scheme!r}, device="cuda")
        tw, ids = random_routing({M}, 5, 2, device="cuda")
        ids = ids.long() if {bad!r} != "5" else ids
        ids[{M} - 1, 1] = {bad}
        cfg = KernelConfig(**{dataclasses.asdict(cfg)!r})
        moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)
        torch.cuda.synchronize()
    """)
    assert_child_stops_with(script, "topk_ids outside [0, num_experts)")
