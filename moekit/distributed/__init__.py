"""Multi-process MoE: tensor parallel (every rank holds a slice of every expert) and expert parallel
(every rank holds whole experts), on top of any single-device backend of `moekit.fused_moe`.

    import moekit.distributed as md

    env = md.init_from_env()                                   # under torchrun: nccl on GPUs, gloo on CPUs
    # tensor parallel: every rank has the whole batch and routing, and a slice of N
    local = md.shard_weights_tp(weights, env.rank, env.world_size)
    out = md.tp_fused_moe(x, local, topk_weights, topk_ids)     # [M, H], the same on every rank
    # expert parallel: every rank has its own tokens, and experts [start, end)
    local = md.shard_weights_ep(weights, env.rank, env.world_size)
    out = md.ep_fused_moe(x_mine, local, tw_mine, ids_mine, num_experts=weights.num_experts)

Every function takes `group=` (a torch.distributed process group; None = the default group).
Tensors must live on the device the group's backend serves (CUDA for nccl, CPU for gloo).
"""

from .ep import (
    ep_comm_only,
    ep_fused_moe,
    expert_partition,
    expert_range,
    shard_weights_ep,
)
from .launch import DistEnv, init_from_env
from .tp import shard_weights_tp, tp_fused_moe

__all__ = [
    "DistEnv",
    "ep_comm_only",
    "ep_fused_moe",
    "expert_partition",
    "expert_range",
    "init_from_env",
    "shard_weights_ep",
    "shard_weights_tp",
    "tp_fused_moe",
]
