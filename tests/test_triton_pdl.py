"""Programmatic dependent launch (MOEKIT_PDL, backends/triton/launch.py): where it is on, and that
it changes no bit of any output (each kernel waits for its predecessor's writes before touching
memory), on its own and inside a CUDA graph with fresh routing."""

import pytest
import torch

import moekit
from moekit.backends.triton import KernelConfig
from moekit.backends.triton import launch
from moekit.backends.triton.launch import PDL_ENV, pdl_enabled

from helpers import assert_graph_replays_fresh_routing, random_routing, random_weights, random_x
from test_triton_backend import PRESET_SHAPES


def test_off_on_the_cpu_and_under_the_interpreter(monkeypatch):
    monkeypatch.setenv(PDL_ENV, "1")
    assert not pdl_enabled(torch.device("cpu"))


@pytest.mark.parametrize("raw", ["yes", "2", "on"])
def test_a_bad_value_names_the_variable_and_the_choices(raw, monkeypatch):
    monkeypatch.setenv(PDL_ENV, raw)
    with pytest.raises(ValueError, match=rf"{PDL_ENV}='{raw}'.*expected 1 .* or 0"):
        pdl_enabled(torch.device("cpu"))


@pytest.mark.parametrize("enabled", [True, False])
def test_a_kernel_taking_pdl_gets_it_and_the_launch_option_with_it(enabled, monkeypatch):
    """_launch passes PDL (and launch_pdl=True when on) to kernels that take a PDL argument,
    and leaves other kernels' arguments alone."""
    calls = []

    class Kernel:
        def __init__(self, arg_names):
            self.arg_names = arg_names

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(k)

    monkeypatch.setattr(launch, "pdl_enabled", lambda device: enabled)
    x = torch.zeros(2)
    launch._launch(Kernel(["x_ptr", "BLOCK", "PDL"]), (1,), x, BLOCK=4)
    launch._launch(Kernel(["x_ptr", "BLOCK"]), (1,), x, BLOCK=4)
    on = {"BLOCK": 4, "PDL": True, "launch_pdl": True}
    assert calls == [on if enabled else {"BLOCK": 4, "PDL": False}, {"BLOCK": 4}]


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
    assert pdl_enabled(x.device) == (torch.cuda.get_device_capability() >= (9, 0))
    for _ in range(3):
        assert torch.equal(run(x, tw, ids), off)
    assert_graph_replays_fresh_routing(run, x, tw, ids, E)
