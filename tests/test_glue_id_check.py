"""The glue's backends (cutlass, torch) check the expert ids in the glue's first kernel: on a GPU
glue.permute's _rank_kernel asserts that each id lies in [0, E), in the ids' own dtype (int32 or
int64: transformers' routers give int64), so fused_moe launches neither its own check nor a
narrowing for them (Backend.checks_expert_ids, reads_int64_ids), as for the triton backend
(test_triton_id_check.py).

On the CPU the interpreter runs device_assert only when its builder's `debug` option is on (on a
GPU the kernel is compiled with Triton's `debug`); the tests here turn it on, so a kernel that
stopped checking fails them. A failed assertion on a GPU ends the process's CUDA context, so the
GPU test runs it in a child process. test_triton_id_check.py compiles the glue's kernels that read
the ids for sm_90, with int32 and int64 ids, and finds the rank kernel's assertion there."""

import textwrap

import pytest
import torch

import moekit
from moekit.backends import torch_backend
from moekit.backends.glue import ops

from helpers import assert_child_stops_with, random_routing, random_weights, random_x

MESSAGE = r"topk_ids outside \[0, num_experts\)"


@pytest.mark.usefixtures("interpreter_asserts")
@pytest.mark.parametrize("M", [3, 70])  # 70 x 2 pairs: two chunks of the rank kernel
@pytest.mark.parametrize("dtype,bad", [(torch.int32, 5), (torch.int32, -1), (torch.int64, 2**32 + 3),
                                       (torch.int64, -(2**32) + 1)])
def test_permute_asserts_an_id_out_of_range(M, dtype, bad, device):
    """The last pair's id out of range (every chunk checks, not only the first); as int64, 2**32 + 3
    would be expert 3 and -(2**32) + 1 expert 1 if narrowed before the check."""
    if device.type != "cuda" and not ops.interpreting():
        pytest.skip("device_assert on CPU tensors runs only under TRITON_INTERPRET=1")
    if device.type == "cuda":
        pytest.skip("a failed assertion ends the CUDA context: the GPU test below runs it in a child")
    _, ids = random_routing(M, 5, 2)
    ids = ids.to(dtype)
    x = random_x(M, 64)
    ops.permute(x, ids, 5, impl="triton")  # in range: no assertion
    ids[M - 1, 1] = bad
    with pytest.raises(BaseException, match=MESSAGE):
        ops.permute(x, ids, 5, impl="triton")


@pytest.mark.parametrize("quant", [None, "token"])
def test_int64_ids_give_the_int32_layout_and_rows(quant, device):
    """Read as they are, int64 ids give bitwise the int32 ids' permuted rows, scales and layout."""
    _, ids = random_routing(70, 6, 3, experts=[0, 2, 3, 5])  # experts 1 and 4 get nothing
    ids, x = ids.to(device), random_x(70, 96, device=device)
    a32, s32, l32 = ops.permute(x, ids, 6, quant=quant, impl="triton")
    a64, s64, l64 = ops.permute(x, ids.long(), 6, quant=quant, impl="triton")
    for name in ("row_of_pair", "offs", "counts"):
        assert torch.equal(getattr(l64, name), getattr(l32, name)), name
    rows = l32.row_of_pair.long()  # padding rows are never written: not compared
    if quant:
        assert torch.equal(s64[rows], s32[rows])
        a32, a64 = a32.view(torch.uint8), a64.view(torch.uint8)
    assert torch.equal(a64[rows], a32[rows])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_strided_view_of_the_ids_reads_as_its_values(dtype, device):
    """A column slice of a router's ids (what moekit.hf passes for top-k weights applied on the
    input) is a view with row stride K: its layout and rows are the contiguous copy's."""
    _, ids = random_routing(9, 6, 3)
    ids, x = ids.to(device=device, dtype=dtype), random_x(9, 64, device=device)
    column = ids[:, 1:2]
    assert not column.is_contiguous()
    a, _, layout = ops.permute(x, column, 6, impl="triton")
    a_copy, _, layout_copy = ops.permute(x, column.contiguous(), 6, impl="triton")
    assert torch.equal(layout.row_of_pair, layout_copy.row_of_pair) and torch.equal(layout.counts, layout_copy.counts)
    rows = layout.row_of_pair.long()
    assert torch.equal(a[rows], x) and torch.equal(a_copy[rows], x)  # one pair per token, in token order


def test_the_rank_kernel_gets_the_flag_and_the_debug_option(monkeypatch):
    """On a GPU ops.permute launches _rank_kernel with CHECK_IDS and Triton's `debug` (without it
    device_assert compiles to nothing, and no CPU test would notice), and the glue's other kernels
    without `debug` (it would add overflow checks). Launches recorded, not run."""
    from moekit.backends.glue import _kernels as k

    from helpers import RecordingKernel

    calls = {}
    for name in ("_rank_kernel", "_scan_kernel", "_row_amax_kernel", "_permute_kernel"):
        kernel = getattr(k, name)
        monkeypatch.setattr(k, name, RecordingKernel(kernel.arg_names, calls.setdefault(name, [])))
    monkeypatch.setattr(ops, "interpreting", lambda: False)  # the options of a GPU launch
    monkeypatch.setattr(ops, "_resolve", lambda impl, device: "triton")  # (on these CPU tensors)
    _, ids = random_routing(5, 4, 2)
    ops.permute(random_x(5, 64), ids.long(), 4, quant="tensor", impl="triton")
    (rank,) = calls["_rank_kernel"]
    assert rank["CHECK_IDS"] is True and rank["debug"] is True and rank["enable_fp_fusion"] is True
    from triton.backends.nvidia.compiler import CUDAOptions

    if "sanitize_overflow" in CUDAOptions.__dataclass_fields__:
        assert rank["sanitize_overflow"] is False
    for name in ("_scan_kernel", "_row_amax_kernel", "_permute_kernel"):
        (launched,) = calls[name]
        assert "debug" not in launched and launched["enable_fp_fusion"] is True, name


def test_fused_moe_leaves_the_ids_to_the_glue_for_the_torch_backend(monkeypatch, device):
    """fused_moe on the device path (forced on CPU tensors) gives the torch backend int64 ids as
    they are, with no narrowing and no checking launch of its own (both counted here); the output
    is bitwise the int32 ids'. On the CPU the torch backend's loop is pointed at the triton glue,
    as on a GPU."""
    import moekit.api as api

    if device.type != "cuda":
        if not ops.interpreting():
            pytest.skip("the triton glue runs on CPU tensors only under TRITON_INTERPRET=1")
        monkeypatch.setattr(torch_backend, "_glue_impl", lambda device: "triton")
    launched = []
    monkeypatch.setattr(api, "_ids_checked_on_device", lambda ids: True)
    monkeypatch.setattr(api, "narrow_ids", lambda ids, E: launched.append("narrow") or ops.narrow_ids(ids, E))
    monkeypatch.setattr(api, "assert_ids_in_range", lambda ids, E: launched.append("check"))
    tw, ids = random_routing(5, 4, 2)
    x, w = random_x(5, 64, device=device), random_weights(4, 64, 32, "bf16", device=device)
    tw, ids = tw.to(device), ids.to(device)
    out32 = moekit.fused_moe(x, w, tw, ids, backend="torch")
    out64 = moekit.fused_moe(x, w, tw, ids.long(), backend="torch")
    assert launched == [] and torch.equal(out64, out32)
    moekit.fused_moe(x, w, tw, ids.long(), backend="reference")  # reference still gets both
    assert launched == ["narrow", "check"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend,scheme", [("cutlass", "fp8-channel-token"), ("torch", "bf16"),
                                            ("torch", "fp8-block128")])
def test_gpu_int64_ids_give_the_int32_output(backend, scheme):
    tw, ids = random_routing(70, 8, 2, device="cuda")
    x, w = random_x(70, 256, device="cuda"), random_weights(8, 256, 128, scheme, device="cuda")
    out32 = moekit.fused_moe(x, w, tw, ids, backend=backend)
    assert torch.equal(moekit.fused_moe(x, w, tw, ids.long(), backend=backend), out32)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,scheme", [("cutlass", "fp8-channel-token"), ("torch", "bf16")])
@pytest.mark.parametrize("bad", ["5", "2**32 + 3"])  # the second in int64 ids
def test_gpu_an_id_out_of_range_stops_the_layer_with_the_message(backend, scheme, bad):
    assert_child_stops_with(textwrap.dedent(f"""
        import sys, torch, moekit
        sys.path.insert(0, "tests")
        from helpers import random_routing, random_weights, random_x
        x, w = random_x(70, 256, device="cuda"), random_weights(5, 256, 128, {scheme!r}, device="cuda")
        tw, ids = random_routing(70, 5, 2, device="cuda")
        ids = ids.long() if {bad!r} != "5" else ids
        ids[69, 1] = {bad}
        moekit.fused_moe(x, w, tw, ids, backend={backend!r})
        torch.cuda.synchronize()
    """), "topk_ids outside [0, num_experts)")
