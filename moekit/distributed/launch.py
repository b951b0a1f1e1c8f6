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
    backend: str  # the process group's backend for `device`: "nccl" or "gloo"


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
    cuda:LOCAL_RANK first), "gloo" otherwise (device cpu); names are case-insensitive. Without
    torchrun's variables (a plain `python script.py`) a one-process group is created on a free
    local port. Joining a group is a rendezvous: every rank of it must call this.

    Where a default group exists already (made by the caller, by torchrun or by
    torch.multiprocessing and init_process_group), its rank, world size and backend are
    returned; LOCAL_RANK comes from the environment where set, else from the current CUDA device
    (nccl) or the rank (gloo: one host assumed). The backend is read from the group's
    configuration: a group made without one (dist.get_backend says 'undefined') or with several
    ('cpu:gloo,cuda:nccl') is a GPU group where it has nccl for CUDA (`backend="gloo"` picks the
    CPU side of a mixed one). A `backend` the group does not have is an error.
    """
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed")
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a string ('nccl' or 'gloo') or None, got {type(backend).__name__}")
        backend = backend.lower()
    if dist.is_initialized():
        return _existing_group(backend)
    unset = [k for k in ("RANK", "WORLD_SIZE") if k not in os.environ]
    if len(unset) == 1:
        raise RuntimeError(f"{unset[0]} is not set but {({'RANK', 'WORLD_SIZE'} - set(unset)).pop()} is")
    single = len(unset) == 2
    rank = _env_int("RANK", 0 if single else None)
    world = _env_int("WORLD_SIZE", 1 if single else None)
    local_rank = _env_int("LOCAL_RANK", rank if single else None)

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


def group_backends(group=None) -> dict[str, str]:
    """{device type: backend} of a process group (None: the default group), from its backend
    configuration: {"cuda": "nccl"} for nccl, {"cpu": "gloo", "cuda": "gloo"} for gloo,
    {"cpu": "gloo", "cuda": "nccl"} for a group made with "cpu:gloo,cuda:nccl". A group made
    without a backend (init_process_group() as torchrun users often write it) reads 'undefined'
    in dist.get_backend; its configuration says what torch chose for it."""
    config = str(dist.get_backend_config(group)).lower()
    pairs = [item.split(":", 1) for item in config.split(",") if ":" in item]
    return {device.strip(): backend.strip() for device, backend in pairs}


def _serves_cuda(backends: dict[str, str]) -> bool:
    """Whether a group with these backends takes its data on the GPU: it has nccl (a GPU-only
    backend) for cuda, and CUDA is there. A gloo group (it takes CUDA tensors too, through host
    copies) is taken as a CPU group, as init_from_env makes it."""
    return backends.get("cuda") == "nccl" and torch.cuda.is_available()


def group_device(group=None) -> torch.device:
    """The device a group's collectives take this process's tensors on, where no tensor says so:
    the current GPU for a group with nccl for CUDA (its only backend, or beside gloo for the
    CPU, or chosen by torch for a group made without a backend on a GPU host), else the CPU.
    Callers with data follow the data's device instead (a mixed group takes either)."""
    if _serves_cuda(group_backends(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _existing_group(backend: str | None) -> DistEnv:
    """The DistEnv of the default group made before (init_from_env's docstring). Its backend is
    read from its configuration (group_backends), so that a group made without a backend name
    ('undefined') or with several ('cpu:gloo,cuda:nccl') is understood: the device is the GPU
    where the group has nccl for CUDA, else the CPU, or the one `backend` names among the group's
    backends (gloo of a mixed group: the CPU); DistEnv.backend is the backend of that device."""
    backends = group_backends()
    if backend is not None and backend not in backends.values():
        names = set(backends.values())
        uses = names.pop() if len(names) == 1 else ",".join(f"{d}:{b}" for d, b in backends.items())
        raise ValueError(f"init_from_env(backend={backend!r}) but the process group already initialised uses {uses!r}")
    nccl = backend == "nccl" if backend is not None else _serves_cuda(backends)
    rank = dist.get_rank()
    default_local = torch.cuda.current_device() if nccl else rank
    local_rank = _env_int("LOCAL_RANK", default_local)
    device = torch.device(f"cuda:{local_rank}") if nccl else torch.device("cpu")
    return DistEnv(rank, dist.get_world_size(), local_rank, device, "nccl" if nccl else backends.get("cpu", "gloo"))
