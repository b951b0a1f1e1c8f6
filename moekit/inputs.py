"""Seeded random inputs of an MoE layer, shared by bench, check and tune (and the diag scripts).

Weights are quantized to the scheme and scaled so that activations stay O(1); never zeros. The
same seed gives the same inputs in every command (`input_seed`), so that a point the tuner chose
can be re-measured by bench and checked by check on the very same activations and routing.
Routing kinds: uniform (K distinct experts per token, uniformly at random), skewed (Zipf-like
expert popularity), and recorded ids (a file's rows, tiled to M).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .spec import MoEShape, QuantScheme
from .weights import MoEWeights, quantize_weights

ZIPF_EXPONENT = 1.2  # popularity of the r-th most popular expert ~ 1 / r^1.2


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@torch.no_grad()
def make_weights(
    shape: MoEShape, scheme: QuantScheme, device: torch.device, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> MoEWeights:
    """Random expert weights quantized to `scheme`, scaled so that activations stay O(1).

    Generated a slice of experts at a time (float32 slices of at most ~1 GiB), so that a real
    model's layer never needs all its weights in float32 at once."""
    E, H, N = shape.num_experts, shape.hidden, shape.n
    g = _generator(device, seed)
    per_expert = 3 * N * H * 4
    chunk = max(1, min(E, (1 << 30) // per_expert))
    parts: list[MoEWeights] = []
    input_scales = None
    for start in range(0, E, chunk):
        count = min(chunk, E - start)
        w13 = torch.randn(count, 2 * N, H, device=device, generator=g) / math.sqrt(H)
        w2 = torch.randn(count, H, N, device=device, generator=g) / math.sqrt(N)
        if not scheme.is_fp8:
            parts.append(MoEWeights(scheme, w13.to(dtype), w2.to(dtype)))
            continue
        kw: dict[str, Any] = {}
        if scheme.static_activation:
            if input_scales is None:  # calibrate the static scales once, on the first slice
                kw["calibration"] = torch.randn(64, H, device=device, generator=g)
            else:
                kw["input_scales"] = input_scales
        part = quantize_weights(w13, w2, scheme, **kw)
        if scheme.static_activation and input_scales is None:
            input_scales = (part.a13_scale, part.a2_scale)
        parts.append(part)
        del w13, w2
    if len(parts) == 1:
        return parts[0]
    cat = {
        name: torch.cat([getattr(p, name) for p in parts])
        for name in ("w13", "w2", "w13_scale", "w2_scale")
        if getattr(parts[0], name) is not None
    }
    if scheme.static_activation:
        cat["a13_scale"], cat["a2_scale"] = input_scales
    return MoEWeights(scheme, **cat)


def make_x(M: int, H: int, device: torch.device, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, H, generator=g).to(dtype).to(device)


def _topk_weights(M: int, K: int, g: torch.Generator, renormalize: bool = True) -> torch.Tensor:
    """Random routing weights: each row summing to 1 (`renormalize`, the model's rule), else each
    weight in (0.05, 0.95) on its own, as a sigmoid router's unnormalized scores (Llama-4: a top-1
    weight of 1 would make scaling the input and scaling the output the same)."""
    w = torch.rand(M, K, generator=g)
    if not renormalize:
        return w * 0.9 + 0.05
    w = w + 0.1
    return w / w.sum(dim=1, keepdim=True)


def uniform_routing(M: int, E: int, K: int, *, seed: int = 0, pool: Sequence[int] | None = None,
                    renormalize: bool = True):
    """(topk_weights float32 [M, K], topk_ids int32 [M, K]) on the CPU: K distinct experts per
    token, uniformly at random (from `pool` only, if given); weights as _topk_weights says."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.arange(E) if pool is None else torch.as_tensor(list(pool))
    if K > len(experts):
        raise ValueError(f"top-k {K} exceeds the {len(experts)} experts to choose from")
    choice = torch.rand(M, len(experts), generator=g).topk(K, dim=1).indices
    ids = experts[choice]
    return _topk_weights(M, K, g, renormalize), ids.to(torch.int32)


def skewed_routing(M: int, E: int, K: int, *, seed: int = 0, renormalize: bool = True):
    """K distinct experts per token, drawn with Zipf-like popularity: the r-th most popular expert
    (a seeded permutation decides which) is chosen with weight 1 / r^ZIPF_EXPONENT."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.empty(E)
    ranks[torch.randperm(E, generator=g)] = torch.arange(1, E + 1, dtype=torch.float32)
    popularity = ranks.pow(-ZIPF_EXPONENT)
    ids = torch.multinomial(popularity.expand(M, E).contiguous(), K, replacement=False, generator=g)
    return _topk_weights(M, K, g, renormalize), ids.to(torch.int32)


def recorded_routing(ids: torch.Tensor, M: int, shape: MoEShape, *, seed: int = 0, renormalize: bool = True):
    """The first M rows of recorded ids (tiled when fewer), folded onto a scaled-down shape's
    experts (id mod E) and top-k (first columns) when the shape is smaller than the model's."""
    reps = -(-M // ids.shape[0])
    rows = ids.repeat(reps, 1)[:M]
    E = shape.num_experts
    rows = rows[:, : shape.top_k] % E
    # folding can send two of a token's experts onto one (ids 1 and 17 onto 16 experts), which
    # every backend would weight twice: each repeat moves on to the next expert the token lacks
    for j in range(1, rows.shape[1]):
        for _ in range(E):  # top-k <= E: a free expert is at most E - 1 steps on
            clash = (rows[:, j:j + 1] == rows[:, :j]).any(dim=1)
            if not clash.any():
                break
            rows[clash, j] = (rows[clash, j] + 1) % E
    g = torch.Generator().manual_seed(seed)
    return _topk_weights(M, shape.top_k, g, renormalize), rows.to(torch.int32)


def make_routing(kind: str, M: int, shape: MoEShape, *, seed: int = 0, recorded: torch.Tensor | None = None,
                 renormalize: bool = True):
    """One routing of batch size M: recorded ids, or `kind` ("uniform", "skewed"); weights as
    _topk_weights says (`renormalize`: the model's rule)."""
    if recorded is not None:
        return recorded_routing(recorded, M, shape, seed=seed, renormalize=renormalize)
    if kind == "skewed":
        return skewed_routing(M, shape.num_experts, shape.top_k, seed=seed, renormalize=renormalize)
    return uniform_routing(M, shape.num_experts, shape.top_k, seed=seed, renormalize=renormalize)


# Each layer point is timed over this many routings of the same batch size (replays cycle through
# them): with few experts a batch size lies near a multiple of a kernel's row tile, and whether a
# random routing pushes an expert over it moved one triton point by 12% (Mixtral-8x7B M = 728,
# tune and bench on two routings, H200, BENCHMARKS.md fifth session). auto chooses per batch
# size, not per routing, so it is judged, and its tables measured, over several.
DEFAULT_ROUTINGS = 4
ROUTING_SEED_STEP = 7919  # routing r of a point uses seed + r * this (r = 0: the point's own seed)


class RoutingRotation:
    """Several routings of one batch size behind one pair of input buffers: closures read
    `topk_weights` and `topk_ids`; `rotation(name)` (moekit.timing's before_each) copies the next
    routing of closure `name` into them, each closure cycling through the routings from the first,
    so that every closure is timed on the same mix; `reset` puts the first back."""

    def __init__(self, routings: list[tuple[torch.Tensor, torch.Tensor]]):
        if not routings:
            raise ValueError("a rotation needs at least one routing")
        self.routings = routings
        self.topk_weights, self.topk_ids = routings[0][0].clone(), routings[0][1].clone()
        self.calls: dict[str, int] = {}  # timed calls so far, per closure
        self.current = 0

    def __len__(self) -> int:
        return len(self.routings)

    def __call__(self, name: str = "") -> None:
        index = self.calls.get(name, 0) % len(self.routings)
        self.calls[name] = self.calls.get(name, 0) + 1
        self._load(index)

    def _load(self, index: int) -> None:
        if index != self.current:
            tw, ids = self.routings[index]
            self.topk_weights.copy_(tw)
            self.topk_ids.copy_(ids)
            self.current = index

    def reset(self) -> None:
        self._load(0)
        self.calls.clear()


def make_routings(kind: str, M: int, shape: MoEShape, count: int, *, seed: int = 0,
                  recorded: torch.Tensor | None = None, device=None, renormalize: bool = True) -> RoutingRotation:
    """`count` routings of batch size M (the first is make_routing's with `seed`) in a rotation.
    Recorded routing (a file) gives one: its rows are the file's, whatever the seed."""
    routings = []
    for r in range(1 if recorded is not None else count):
        tw, ids = make_routing(kind, M, shape, seed=seed + r * ROUTING_SEED_STEP, recorded=recorded,
                               renormalize=renormalize)
        routings.append((tw.to(device), ids.to(device)))
    return RoutingRotation(routings)


def input_seed(seed: int, M: int) -> int:
    """The seed of the inputs (activations, routing) at batch size M from --seed: bench, check and
    tune draw the same inputs for the same --seed."""
    return seed * 1_000_003 + M
