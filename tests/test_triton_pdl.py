"""Programmatic dependent launch (MOEKIT_PDL, backends/triton/launch.py): where it is on, that
every kernel taking it waits for its predecessor before anything else, and that it changes no bit
of any output, on its own and inside a CUDA graph with fresh routing."""

import ast
import inspect

import pytest
import torch

import moekit
from moekit.backends.triton import KernelConfig
from moekit.backends.triton import _gemv_kernels, _kernels, launch
from moekit.backends.triton.launch import PDL_ENV, pdl_enabled

from helpers import RecordingKernel, assert_graph_replays_fresh_routing, random_routing, random_weights, random_x
from test_triton_backend import PRESET_SHAPES, SCHEMES


def test_off_on_the_cpu_and_under_the_interpreter(monkeypatch):
    monkeypatch.setenv(PDL_ENV, "1")
    assert not pdl_enabled(torch.device("cpu"))
    monkeypatch.setattr(launch, "_interpreting", lambda: True)
    assert not pdl_enabled(torch.device("cuda"))  # decided before any CUDA call


def _kernels_taking_pdl():
    for module in (_kernels, _gemv_kernels):
        tree = ast.parse(inspect.getsource(module))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args) \
                    and node.name.endswith("_kernel"):
                yield module.__name__.rsplit(".", 1)[1], node


def test_every_kernel_taking_pdl_waits_before_anything_else():
    """A kernel launched with launch_pdl may start before the one before it has finished: its first
    statement (after the docstring) must be _pdl_wait(PDL) or _pdl_enter(PDL), so that no load or
    store comes first on any path."""
    found = []
    for module, node in _kernels_taking_pdl():
        body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
            else node.body
        first = body[0]
        call = first.value if isinstance(first, ast.Expr) else None
        assert isinstance(call, ast.Call) and getattr(call.func, "id", None) in ("_pdl_wait", "_pdl_enter") \
            and [a.id for a in call.args] == ["PDL"], f"{module}.{node.name} does not start by waiting"
        found.append(node.name)
    # the kernels of a decode layer on both paths, and the GEMMs and combine at every size
    assert {"decode_prologue_kernel", "quantize_rows_kernel", "gemm1_kernel", "gemm2_kernel", "combine_kernel",
            "gemv1_kernel", "gemv2_kernel"} <= set(found)


@pytest.mark.parametrize("raw", ["yes", "2", "on"])
def test_a_bad_value_names_the_variable_and_the_choices(raw, monkeypatch):
    monkeypatch.setenv(PDL_ENV, raw)
    with pytest.raises(ValueError, match=rf"{PDL_ENV}='{raw}'.*expected 1 .* or 0"):
        pdl_enabled(torch.device("cpu"))


@pytest.mark.parametrize("enabled", [True, False])
def test_a_kernel_taking_pdl_gets_it_and_the_launch_option_with_it(enabled, monkeypatch):
    """_launch passes PDL (and launch_pdl=True when on) to kernels that take a PDL argument,
    and leaves other kernels' arguments alone."""
    from moekit.backends.triton_options import compile_options

    calls = []
    monkeypatch.setattr(launch, "pdl_enabled", lambda device: enabled)
    x = torch.zeros(2)
    launch._launch(RecordingKernel(["x_ptr", "BLOCK", "PDL"], calls), (1,), x, BLOCK=4)
    launch._launch(RecordingKernel(["x_ptr", "BLOCK"], calls), (1,), x, BLOCK=4)
    # every launch also gets the compile options (FP fusion without the interpreter, as on a GPU
    # machine; none under TRITON_INTERPRET=1): not this test's subject
    options = compile_options(launch._interpreting())
    on = {"BLOCK": 4, "PDL": True, "launch_pdl": True, **options}
    assert calls == [on if enabled else {"BLOCK": 4, "PDL": False, **options}, {"BLOCK": 4, **options}]


# ------------------------------------------------------------------------------------ GPU

TILED = KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
GEMV = KernelConfig(BLOCK_M=16, BLOCK_N=8, BLOCK_K=512, GROUP_M=1, num_warps=2, num_stages=1, GEMV=1)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [TILED, GEMV], ids=["tiled", "gemv"])
@pytest.mark.parametrize("name", ["glm-4.5v-fp8 tp2", "mixtral-8x7b", "deepseek-v3 tp8"])
def test_gpu_on_where_hopper_and_bitwise_the_same_as_off(cfg, name, monkeypatch):
    E, H, N, K, scheme = PRESET_SHAPES[name]
    w = random_weights(E, H, N, scheme, device="cuda")
    x = random_x(3, H, device="cuda")
    tw, ids = random_routing(3, E, K, device="cuda", seed=2)
    backend = moekit.get_backend("triton")

    def run(x, tw, ids):
        return backend.run(x, w, tw.float(), ids, config=cfg)

    monkeypatch.setenv(PDL_ENV, "0")
    assert not pdl_enabled(x.device)
    off = run(x, tw, ids)
    monkeypatch.setenv(PDL_ENV, "1")
    assert pdl_enabled(x.device) == (torch.cuda.get_device_capability() >= (9, 0) and _kernels.gdc_wait is not None)
    for _ in range(3):
        assert torch.equal(run(x, tw, ids), off)
    assert_graph_replays_fresh_routing(run, x, tw, ids, E)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M,E", [(3, 6), (80, 6), (80, 40)])  # 3: one-launch alignment and prologue; 80 x top-2 > 128
# pairs: the multi-launch alignment, its scan in one program with the starts (6 experts) or in three and the starts apart (40)
@pytest.mark.parametrize("accumulation", ["precise", "fast"])
def test_gpu_every_scheme_and_path_bitwise_the_same_as_off(scheme, M, E, accumulation, monkeypatch):
    """Every launch sequence a layer can take: dynamic per-tensor scales (a fill and two quantize
    passes), static scales, bf16, fast mode's per-row quantization of the intermediate, and the
    multi-launch alignment in both its forms (every launch with PDL since the thirty-third session)."""
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", accumulation)
    H, N, K = 512, 384, 2
    w = random_weights(E, H, N, scheme, device="cuda")
    x = random_x(M, H, device="cuda")
    tw, ids = random_routing(M, E, K, device="cuda", seed=M)
    backend = moekit.get_backend("triton")
    for cfg in (TILED, GEMV) if M == 3 else (TILED,):
        monkeypatch.setenv(PDL_ENV, "0")
        off = backend.run(x, w, tw.float(), ids, config=cfg)
        monkeypatch.setenv(PDL_ENV, "1")
        assert torch.equal(backend.run(x, w, tw.float(), ids, config=cfg), off)
