"""`init_from_env`: join the process group that torchrun describes in the environment."""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # the process group's backend: "nccl" or "gloo"


def _env_int(name: str, default: int | None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"{name} is not set: launch with torchrun (torchrun --nproc-per-node N ...)")
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> DistEnv:
    """Initialise torch.distributed from torchrun's RANK, WORLD_SIZE, LOCAL_RANK (and
    MASTER_ADDR / MASTER_PORT), or return the group already initialised.

    backend: None picks "nccl" when CUDA is available (and sets this process's CUDA device to
    cuda:LOCAL_RANK first), "gloo" otherwise (device cpu). Without torchrun's variables (a plain
    `python script.py`) a one-process group is created on a free local port.
    """
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed")
    unset = [k for k in ("RANK", "WORLD_SIZE") if k not in os.environ]
    if len(unset) == 1:
        raise RuntimeError(f"{unset[0]} is not set but {({'RANK', 'WORLD_SIZE'} - set(unset)).pop()} is")
    single = len(unset) == 2
    rank = _env_int("RANK", 0 if single else None)
    world = _env_int("WORLD_SIZE", 1 if single else None)
    local_rank = _env_int("LOCAL_RANK", rank if single else None)

    if dist.is_initialized():
        pg_backend = dist.get_backend()
        device = torch.device(f"cuda:{torch.cuda.current_device()}") if pg_backend == "nccl" else torch.device("cpu")
        return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, pg_backend)

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend nccl needs CUDA GPUs; none is visible (use gloo on CPUs)")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    kw: dict = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
    if backend == "nccl":
        kw["device_id"] = device  # binds the communicator to this GPU (eager NCCL init)
    if single:
        kw.update(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    else:
        kw.update(init_method="env://", rank=rank, world_size=world)
    dist.init_process_group(**kw)
    return DistEnv(rank, world, local_rank, device, backend)
