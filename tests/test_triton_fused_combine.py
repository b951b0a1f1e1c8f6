"""GEMM2 with the combine inside it (launch.FUSED_COMBINE, _kernels._combine_finished_tokens)
against the combine pass: the same rows summed in the same order, so bitwise the same output."""

import pytest
import torch

import moekit
from moekit.backends.triton import KernelConfig, launch

from helpers import assert_graph_replays_fresh_routing, random_routing, random_weights, random_x
from test_triton_backend import SCHEMES, assert_matches_reference


def both_ways(monkeypatch, x, w, tw, ids, cfg):
    outs = []
    for fused in (False, True):
        monkeypatch.setattr(launch, "FUSED_COMBINE", fused)
        outs.append(moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg))
    return outs


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(
    "E,H,N,M,K,experts",
    [
        (3, 144, 128, 5, 2, None),  # H not a multiple of the column block
        (5, 256, 128, 1, 1, None),  # M = 1, top-1 (nothing to combine: each token's only row)
        (5, 128, 256, 9, 2, [0, 2, 4]),  # experts 1 and 3 receive no tokens
        (3, 256, 128, 6, 1, [1]),  # all tokens on one expert
        (3, 256, 128, 6, 3, None),  # top-k = E
        (8, 160, 128, 7, 8, None),  # top-8
        (5, 128, 128, 0, 2, None),  # M = 0
    ],
)
def test_fused_combine_equals_the_combine_pass(scheme, E, H, N, M, K, experts, device, monkeypatch):
    w = random_weights(E, H, N, scheme, device=device, seed=E + M)
    tw, ids = random_routing(M, E, K, device=device, seed=M + K, experts=experts)
    x = random_x(M, H, device=device, seed=M)
    # BLOCK_N 64: several column blocks per token, each counted on its own; GEMM2 at another width
    cfg = KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64 if scheme == "bf16" else 128, GROUP_M=2)
    for c in (cfg, cfg.with_gemm2(BLOCK_N=128)):
        unfused, fused = both_ways(monkeypatch, x, w, tw, ids, c)
        assert fused.shape == (M, H) and fused.dtype == x.dtype
        assert torch.equal(fused, unfused), c
        if M:
            assert_matches_reference(fused, x, w, tw, ids)


def test_fused_combine_counts_every_column_block_of_every_token(device, monkeypatch):
    """A token whose rows were combined before all K were stored would miss a row: one row per
    token of E = 4 experts, with top-k weights that make each row's share distinct."""
    E, H, N, M, K = 4, 256, 128, 6, 4
    w = random_weights(E, H, N, "bf16", device=device)
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t)) for t in range(M)]).to(device)
    tw = torch.tensor([1.0, 10.0, 100.0, 1000.0], device=device).repeat(M, 1)
    x = random_x(M, H, device=device)
    unfused, fused = both_ways(monkeypatch, x, w, tw, ids, KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1))
    assert torch.equal(fused, unfused)
    assert_matches_reference(fused, x, w, tw, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["fp8-channel-token", "fp8-block128"])
def test_gpu_fused_combine_deterministic_and_graph_replay(scheme, monkeypatch):
    """On a GPU, where programs really race for the counters: bitwise equal to the combine pass
    over repeated runs, at a prefill-like size with top-8, and under CUDA-graph replay with fresh
    routing (the counters are zeroed inside the graph)."""
    E, H, N, M, K = 128, 2048, 768, 1024, 8
    w = random_weights(E, H, N, scheme, device="cuda")
    tw, ids = random_routing(M, E, K, device="cuda")
    x = random_x(M, H, device="cuda")
    cfg = KernelConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)
    unfused, fused = both_ways(monkeypatch, x, w, tw, ids, cfg)
    assert torch.equal(fused, unfused)
    for _ in range(5):
        assert torch.equal(moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg), fused)
    assert_graph_replays_fresh_routing(
        lambda x, tw, ids: moekit.get_backend("triton").run(x, w, tw.float(), ids, config=cfg), x, tw, ids, E)
