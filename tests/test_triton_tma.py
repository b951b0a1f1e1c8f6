"""EXPERIMENT (reverted in the next commit): TMA=1 weight tiles against the reference under the
interpreter (tile coordinates and padding rules)."""

import pytest

import moekit
from moekit.backends.triton import KernelConfig

from helpers import max_rel, random_routing, random_weights, random_x, rel_l2
from test_triton_backend import MAX_REL_TOL, REL_L2_TOL, SCHEMES, reference_for


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("accumulation", ["precise", "fast"])
def test_tma_weight_tiles_match_the_reference(scheme, accumulation, device, monkeypatch):
    monkeypatch.setenv("MOEKIT_FP8_ACCUMULATION", accumulation)
    n = 256 if scheme == "fp8-block128" else 208
    w = random_weights(5, 160, n, scheme, device=device)
    tw, ids = random_routing(9, 5, 2, device=device, experts=[0, 2, 4])
    x = random_x(9, 160, device=device)
    ref = reference_for(x, w, tw, ids)
    for block_n in (64, 128):
        cfg = KernelConfig(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=64 if scheme == "bf16" else 128, GROUP_M=2, TMA=1)
        out = moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg)
        assert rel_l2(out, ref) < REL_L2_TOL and max_rel(out, ref) < MAX_REL_TOL, (block_n, rel_l2(out, ref))
