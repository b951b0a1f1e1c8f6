"""torch.export of a MoELayer: the program runs in the exporting process, bitwise the eager layer,
and once its layer is gone it stops with an error that names torch.export (moekit's op names its
layer by a handle of the tracing process; README, torch.compile)."""

import gc

import pytest
import torch

import moekit

from helpers import random_weights, random_x


def test_an_exported_layer_runs_where_it_was_exported_and_says_why_not_elsewhere():
    w = random_weights(5, 128, 96, "bf16", device="cpu", seed=3)  # odd E and N: nothing a power of two but H
    layer = moekit.MoELayer(w, moekit.RoutingConfig(top_k=2), backend="reference")
    x, logits = random_x(3, 128, device="cpu", seed=4), torch.randn(3, 5, generator=torch.Generator().manual_seed(5))
    program = torch.export.export(layer, (x, logits))
    assert torch.equal(program.module()(x, logits), layer(x, logits))
    del layer  # what a program loaded in another process meets: no layer under its handle
    gc.collect()
    with pytest.raises(RuntimeError, match="torch.export program loaded in another process"):
        program.module()(x, logits)
