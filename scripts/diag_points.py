"""What the diag and bench scripts are asked to run: "model:tp[:scheme]" (parse_model) and
"model:tp:M[:scheme]" (parse_point), one parser for every script; and the problems of
`model:tp:M` points (layer_points): a model's weights made once for its run of points (the
generator drops them before making the next model's; a caller that still holds the last point's
tensors keeps them alive until its loop moves on), a fresh batch and uniform routing per point."""
import argparse
import json
from typing import Iterator, NamedTuple, Sequence

import torch

import moekit
from moekit.inputs import make_weights, make_x, uniform_routing
from moekit.models import ModelSpec, get_model
from moekit.spec import MoEShape, QuantScheme, get_scheme
from moekit.weights import MoEWeights


class Model(NamedTuple):
    name: str
    tp: int
    spec: ModelSpec  # the preset at that TP (its shape)
    scheme: QuantScheme  # the one asked for, else the preset's


def parse_model(text: str, scheme: str | None = None, *, scheme_field: bool = True) -> Model:
    """ "model:tp[:scheme]": a preset, its tensor-parallel size and the scheme to run it in (the one
    named there, else `scheme`, else the preset's). SystemExit naming the form for anything else.
    `scheme_field=False`: "model:tp" only (a script that runs one scheme, `scheme`)."""
    if scheme_field:
        name, tp, *rest = _fields(text, "model:tp[:scheme], e.g. glm-4.5v-fp8:2 or mixtral-8x7b:1:fp8-channel-token", 2, 3)
    else:
        name, tp, *rest = _fields(text, f"model:tp, e.g. glm-4.5v-fp8:2 (this script runs {scheme})", 2, 2)
    return _model(text, name, tp, rest[0] if rest else scheme)


def parse_point(text: str, scheme: str | None = None) -> tuple[Model, int]:
    """ "model:tp:M[:scheme]": parse_model's fields and a batch size M >= 1."""
    name, tp, M, *rest = _fields(text, "model:tp:M[:scheme], e.g. glm-4.5v-fp8:2:4096", 3, 4)
    if not M.isdigit() or int(M) < 1:
        raise SystemExit(f"{text!r}: M must be a positive integer, got {M!r}")
    return _model(text, name, tp, rest[0] if rest else scheme), int(M)


def _fields(text: str, form: str, least: int, most: int) -> list[str]:
    fields = text.split(":")
    if not least <= len(fields) <= most or not all(fields):
        raise SystemExit(f"{text!r}: expected {form}")
    return fields


def _model(text: str, name: str, tp: str, scheme: str | None) -> Model:
    if not tp.isdigit() or int(tp) < 1:
        raise SystemExit(f"{text!r}: tp must be a positive integer, got {tp!r}")
    try:
        spec = get_model(name, int(tp))
        return Model(name, int(tp), spec, get_scheme(scheme) if scheme else spec.scheme)
    except (KeyError, ValueError) as e:  # an unknown preset or scheme, a TP that does not divide it
        raise SystemExit(f"{text!r}: {e}") from None


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
    """Each "model:tp:M[:scheme]" of `points` as a Point, in the scheme it names, else `scheme`,
    else the preset's."""
    made_for, weights = None, None
    for point in points:
        (model, tp, preset, quant), M = parse_point(point, scheme)
        shape = preset.shape
        if made_for != (model, tp):
            weights = None  # dropped before the next model's are made
            torch.cuda.empty_cache()
            made_for, weights = (model, tp), make_weights(shape, quant, dev)
        x = make_x(M, shape.hidden, dev)
        tw, ids = (t.to(dev) for t in uniform_routing(M, shape.num_experts, shape.top_k))
        yield Point(model, tp, M, shape, quant, weights, x, tw.float(), ids)


def points_parser(default_points: Sequence[str], help: str | None = None) -> argparse.ArgumentParser:
    """A point script's command line: --points ("model:tp:M[:scheme]", default `default_points`)
    and --json (write_json's path); the script adds its own arguments."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", default=list(default_points), help=help or "model:tp:M[:scheme] points")
    ap.add_argument("--json", help="also write the results to this file")
    return ap


def cuda_triton():
    """(the CUDA device, the triton backend): what every point script runs on."""
    return torch.device("cuda"), moekit.get_backend("triton")


def gemv_config(backend, p: Point, dev: torch.device):
    """The config the triton backend runs at point `p` where that is a GEMV-path one, else
    space.GEMV_START: what the GEMV diag scripts take as their table's config."""
    from moekit.tune.space import GEMV_START

    cfg = backend.config_for(p.w, p.shape.top_k, p.M, dev)
    return cfg if cfg.GEMV else GEMV_START


def gemv_intermediate(p: Point, cfg) -> tuple:
    """(a, a_scale, act, act_scale, a_mode) at point `p` with the GEMV config `cfg`: x quantized as
    the GEMV path does it, and GEMM1's intermediate with the scale and A_MODE GEMM2 reads it with
    (gemv.gemv1, precise mode's group rule)."""
    from moekit.backends.triton import gemv

    a, a_scale = gemv.quantize_input(p.x, p.w)
    return (a, a_scale, *gemv.gemv1(a, a_scale, p.w, p.ids, p.x.dtype, cfg, False))


def tiled_points(points: Sequence[str], dev: torch.device, backend) -> Iterator[tuple[Point, object]]:
    """(point, the tiled config the triton backend runs there) for each of `points` (layer_points),
    saying which it skips: those where the table runs the GEMV path (no alignment, no tiles)."""
    for p in layer_points(points, dev):
        cfg = backend.config_for(p.w, p.shape.top_k, p.M, dev)
        if cfg.GEMV:
            print(f"\n{p.model} M={p.M}: the table runs the GEMV path here (no alignment, no tiles): skipped")
            continue
        yield p, cfg


def tiled_intermediate(p: Point, cfg) -> tuple:
    """(align, a, a_scale, act) at point `p` with the tiled config `cfg`: the pairs aligned, x
    quantized, and GEMM1's intermediate, as the triton backend's layer makes them before GEMM2."""
    from moekit.backends.triton import launch

    align = launch.align_pairs(p.ids, p.w.num_experts, cfg.BLOCK_M)
    a, a_scale = launch.quantize_input(p.x, p.w)
    return align, a, a_scale, launch.gemm1(a, a_scale, p.w, align, p.shape.top_k, p.x.dtype, cfg)


def print_gemm_times(times: dict, bytes1: int, bytes2: int, width: int = 22) -> Iterator[tuple[str, float]]:
    """Print each of time_graphs' results (median µs, p20-p80; for a label starting with "gemm1"
    or "gemm2", also that GEMM's bandwidth: the expert weights it must read, `bytes1` / `bytes2`,
    over its time, or FAILED and why) and yield (label, median µs) of those that ran."""
    for label, t in times.items():
        if isinstance(t, BaseException):
            print(f"  {label:{width}s} FAILED {str(t)[:120]}")
            continue
        nbytes = bytes1 if label.startswith("gemm1") else bytes2 if label.startswith("gemm2") else 0
        bw = f"{nbytes / t.median_us / 1e6:6.2f} TB/s" if nbytes else ""
        print(f"  {label:{width}s} {t.median_us:8.1f} us (p20 {t.p20_us:.1f} p80 {t.p80_us:.1f}) {bw}")
        yield label, t.median_us


def write_json(path: str | None, rows: list) -> None:
    """The scripts' --json: `rows` written to `path` (indented), where a path was given."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)

