"""The problems of the diag scripts' `model:tp:M` points: a model's weights made once for its
run of points (the generator drops them before making the next model's; a caller that still
holds the last point's tensors keeps them alive until its loop moves on), a fresh batch and
uniform routing per point."""
from typing import Iterator, NamedTuple, Sequence

import torch

from moekit.bench import make_weights, make_x, uniform_routing
from moekit.models import get_model
from moekit.spec import MoEShape, QuantScheme, get_scheme
from moekit.weights import MoEWeights


class Point(NamedTuple):
    model: str
    tp: int
    M: int
    shape: MoEShape
    scheme: QuantScheme
    w: MoEWeights
    x: torch.Tensor
    tw: torch.Tensor  # float32 top-k weights
    ids: torch.Tensor


def layer_points(points: Sequence[str], dev: torch.device, scheme: str | None = None) -> Iterator[Point]:
    """Each "model:tp:M" of `points` as a Point, in the preset's scheme or `scheme`."""
    made_for, weights = None, None
    for point in points:
        try:
            model, tp, M = point.split(":")
            tp, M = int(tp), int(M)
        except ValueError:
            raise SystemExit(f"point {point!r}: expected model:tp:M, e.g. glm-4.5v-fp8:2:4096") from None
        preset = get_model(model, tp)
        shape, quant = preset.shape, get_scheme(scheme) if scheme else preset.scheme
        if made_for != (model, tp):
            weights = None  # dropped before the next model's are made
            torch.cuda.empty_cache()
            made_for, weights = (model, tp), make_weights(shape, quant, dev)
        x = make_x(M, shape.hidden, dev)
        tw, ids = (t.to(dev) for t in uniform_routing(M, shape.num_experts, shape.top_k))
        yield Point(model, tp, M, shape, quant, weights, x, tw.float(), ids)
