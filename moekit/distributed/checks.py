"""Argument checks shared by tensor- and expert-parallel code: ranks and counts, and that a rank's
weights are the shard of that rank (`MoEWeights.shard`, set by shard_weights_tp / shard_weights_ep)."""

from __future__ import annotations

import operator

import torch

from ..weights import MoEWeights, Shard


def as_count(name: str, value) -> int:
    """value as a Python int (NumPy and torch integers accepted); TypeError for anything else,
    bool included."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def check_rank(rank, world_size) -> tuple[int, int]:
    """(rank, world_size) as ints; ValueError unless 0 <= rank < world_size."""
    rank, world_size = as_count("rank", rank), as_count("world_size", world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


def check_whole(weights) -> None:
    """What shard_weights_tp and shard_weights_ep take: a whole layer's MoEWeights (a shard's
    tag would no longer say what it holds if it were cut again)."""
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights must be a moekit.MoEWeights, got {type(weights).__name__}")
    if weights.shard is not None:
        raise ValueError(f"these weights are already a shard ({weights.shard}); shard the whole layer's weights")


def check_shard(weights: MoEWeights, parallel: str, rank: int, world_size: int) -> None:
    """ValueError where `weights` carry a shard tag that is not this rank's part under `parallel`
    ("tp" or "ep") over world_size ranks. Weights without a tag (sharded some other way, a
    checkpoint saved per rank) are taken as the caller says; a one-rank group needs no shard."""
    shard = weights.shard
    if shard is None:
        return
    if not isinstance(shard, Shard):
        raise TypeError(f"MoEWeights.shard must be a moekit.weights.Shard or None, got {type(shard).__name__}")
    want = f"{parallel} rank {rank} of {world_size}"
    got = f"{shard.parallel} rank {shard.rank} of {shard.world_size}"
    if (shard.parallel, shard.rank, shard.world_size) != (parallel, rank, world_size):
        raise ValueError(
            f"these weights are the shard for {got}, but this call runs as {want} of its process group "
            f"(shard the whole layer's weights with moekit.distributed.shard_weights_{parallel}(weights, "
            f"{rank}, {world_size}), or MoELayer.sharded)"
        )


def own_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy in memory of its own, for a shard. Not .contiguous(): a slice that is
    contiguous already (one rank's experts along dim 0, the whole of N over one rank) would come
    back as a view keeping the full weights alive."""
    return t.clone(memory_format=torch.contiguous_format)
