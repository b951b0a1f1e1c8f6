"""Reading a layer's experts straight from a safetensors checkpoint, one tensor at a time.

Per-expert checkpoint tensors (compressed-tensors, DeepSeek-style quant_method "fp8", fbgemm_fp8,
and unquantized per-expert checkpoints), for expert e of the experts module at PREFIX:
    PREFIX.{e}.{gate|up|down}.weight          FP8 e4m3fn (or bf16/fp16 when unquantized), [out, in]
    PREFIX.{e}.{proj}.weight_scale            compressed-tensors / fbgemm / per-tensor "fp8"
    PREFIX.{e}.{proj}.weight_scale_inv        DeepSeek-style block "fp8" (a multiplier, as weight_scale)
    PREFIX.{e}.{proj}.input_scale             static activation scale (fp8-tensor-static)
Fused unquantized checkpoints (transformers v5 / Llama-4) hold PREFIX.gate_up_proj and
PREFIX.down_proj instead; they are read one expert at a time through safetensors slices.
fbgemm_fp8 Llama-4 checkpoints hold them fused in FP8 ([E, H, 2N] and [E, N, H]) with per-channel
PREFIX.gate_up_proj_scale [E, 1, 2N] and PREFIX.down_proj_scale [E, H, 1] (`_read_fused_fp8`).

Scale shapes accepted per Linear [out, in]: tensor [] or [1]; channel [out] or [out, 1];
block [ceil(out/128), ceil(in/128)]. Scales of any float dtype are read as float32.
Into moekit's layout (see moekit.weights):
    tensor   gate and up of one expert share one w13 scale: vLLM's rule, the larger of the two,
             the other half requantized to it (one [N, H] matrix at a time, in float32);
    channel  w13_scale[e] = cat(gate [N], up [N]);  block  cat along the 128-row blocks;
    static   a13 = max over experts of the gate/up input scales, a2 = max of the down ones
             (vLLM's rule for fused experts: one input scale per GEMM).
No bf16 copy of the experts is ever made: FP8 tensors are copied into the preallocated FP8 w13/w2.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from .. import quant, weights
from ..spec import BLOCK, QuantScheme
from ..weights import MoEWeights, check_intermediate
from .families import Family, UnsupportedModelError

log = logging.getLogger("moekit.hf")

_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
    "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8,
    "F8_E5M2": torch.float8_e5m2, "BOOL": torch.bool, "I16": torch.int16,
}
_SCALE_NAMES = ("weight_scale", "weight_scale_inv")
_TENSOR_NAMES = ("weight", "weight_scale", "weight_scale_inv", "input_scale", "weight_zero_point",
                 "input_zero_point")
ROLES = ("gate", "up", "down")
# fused experts: unquantized (transformers v5, Llama-4) or fbgemm_fp8 Llama-4 (with the scales)
FUSED_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_scale", "down_proj_scale")


class CheckpointError(UnsupportedModelError):
    """A checkpoint tensor is missing, misnamed or of the wrong shape or dtype."""


class Checkpoint:
    """The safetensors files of a model folder: which file holds which tensor, read lazily."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self._safe_open = safe_open
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.key_file = {k: self.folder / f for k, f in weight_map.items()}
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{str(self.folder)!r} holds no *.safetensors file")
            self.key_file = {}
            for path in files:
                with safe_open(path, "pt") as f:
                    for key in f.keys():
                        self.key_file[key] = path
        self._handles: dict[Path, object] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.key_file

    def keys(self):
        return self.key_file.keys()

    def _open(self, key: str):
        path = self.key_file[key]
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = self._safe_open(path, "pt")
        return handle

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype | str]:
        sl = self._open(key).get_slice(key)
        dtype = sl.get_dtype()
        return tuple(sl.get_shape()), _DTYPES.get(dtype, dtype)

    def get(self, key: str) -> torch.Tensor:
        return self._open(key).get_tensor(key)

    def get_row(self, key: str, index: int) -> torch.Tensor:
        return self._open(key).get_slice(key)[index]

    def close(self) -> None:
        self._handles.clear()


# ------------------------------------------------------------------------------- finding experts


def find_experts(ckpt: Checkpoint, family: Family) -> dict[str, dict]:
    """Checkpoint experts prefix -> {"experts": {e: {role: {tensor: key}}}} or {"fused": {...}}."""
    gate, up, down = family.projections
    roles = {gate: "gate", up: "up", down: "down"}
    per_expert = re.compile(
        r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>" + "|".join(map(re.escape, roles))
        + r")\.(?P<tensor>[A-Za-z_]+)$"
    )
    fused = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<name>" + "|".join(FUSED_NAMES) + r")$")
    found: dict[str, dict] = {}
    for key in ckpt.keys():
        m = per_expert.match(key)
        if m:
            tensor = m["tensor"]
            if tensor not in _TENSOR_NAMES:
                raise CheckpointError(
                    f"checkpoint tensor {key!r}: moekit reads {', '.join(_TENSOR_NAMES[:4])} of an "
                    f"expert projection, not {tensor!r}"
                )
            entry = found.setdefault(m["prefix"], {"experts": {}})
            entry.setdefault("experts", {}).setdefault(int(m["e"]), {}).setdefault(roles[m["proj"]], {})[tensor] = key
            continue
        m = fused.match(key)
        if m:
            found.setdefault(m["prefix"], {}).setdefault("fused", {})[m["name"]] = key
    return found


# ---------------------------------------------------------------------------------- reading


def _key(prefix: str, e: int, proj: str, tensor: str) -> str:
    return f"{prefix}.{e}.{proj}.{tensor}"


def _scale(ckpt: Checkpoint, key: str, granularity: str, out: int, inp: int) -> torch.Tensor:
    """A Linear's weight scale in moekit's per-matrix form: tensor [], channel [out], block [ro, ci]."""
    t = ckpt.get(key)
    if not t.is_floating_point() or t.dtype == torch.float8_e4m3fn:
        raise CheckpointError(f"checkpoint tensor {key!r} has dtype {t.dtype}; a scale must be a float tensor")
    t = t.float()
    if granularity == "tensor":
        if t.numel() != 1:
            raise CheckpointError(f"checkpoint tensor {key!r} has shape {tuple(t.shape)}; a per-tensor scale has 1 element")
        return t.reshape(())
    if granularity == "channel":
        if t.numel() != out or (t.dim() == 2 and t.shape[1] != 1) or t.dim() > 2:
            raise CheckpointError(
                f"checkpoint tensor {key!r} has shape {tuple(t.shape)}; a per-channel scale of this "
                f"projection is [{out}, 1] or [{out}]"
            )
        return t.reshape(out)
    want = (-(-out // BLOCK), -(-inp // BLOCK))
    if tuple(t.shape) != want:
        raise CheckpointError(
            f"checkpoint tensor {key!r} has shape {tuple(t.shape)}; the 128x128 block scales of a "
            f"[{out}, {inp}] projection are {list(want)}"
        )
    return t


def _weight(ckpt: Checkpoint, key: str, shape: tuple[int, int], dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    got_shape, got_dtype = ckpt.info(key)
    if got_dtype not in dtypes:
        raise CheckpointError(
            f"checkpoint tensor {key!r} has dtype {got_dtype}; expected {' or '.join(map(str, dtypes))}"
        )
    if got_shape != tuple(shape):
        raise CheckpointError(
            f"checkpoint tensor {key!r} has shape {got_shape}; the model expects {tuple(shape)} "
            f"([out, in] of this expert projection)"
        )
    return ckpt.get(key)


def experts_dtype(ckpt: Checkpoint, entry: dict, prefix: str) -> torch.dtype:
    """The dtype the checkpoint stores this module's expert weights in."""
    if "experts" in entry and entry["experts"]:
        e = min(entry["experts"])
        for role in ROLES:
            key = entry["experts"][e].get(role, {}).get("weight")
            if key:
                return ckpt.info(key)[1]
    fused = entry.get("fused", {})
    for name in ("gate_up_proj", "down_proj"):
        if name in fused:
            return ckpt.info(fused[name])[1]
    raise CheckpointError(f"checkpoint holds no expert weights under {prefix!r}")


def _expert_keys(entry: dict, prefix: str, E: int, projections, needed: tuple[str, ...]) -> dict:
    experts = entry.get("experts", {})
    extra = sorted(e for e in experts if e >= E)
    if extra:
        raise CheckpointError(
            f"checkpoint has experts {extra[:5]} under {prefix!r} but the model has {E} experts (0..{E - 1})"
        )
    names = dict(zip(ROLES, projections))
    for e in range(E):
        for role in ROLES:
            have = experts.get(e, {}).get(role, {})
            for tensor in needed:
                options = _SCALE_NAMES if tensor == "weight_scale" else (tensor,)
                if not any(t in have for t in options):
                    raise CheckpointError(
                        f"checkpoint has no tensor {_key(prefix, e, names[role], options[0])!r}"
                        + (f" (nor {_key(prefix, e, names[role], options[1])!r})" if len(options) > 1 else "")
                        + f" for expert {e} of {prefix!r}"
                    )
        for role in ROLES:
            zp = experts.get(e, {}).get(role, {})
            for tensor in ("weight_zero_point", "input_zero_point"):
                if tensor in zp:
                    entry.setdefault("_zero_points", []).append(zp[tensor])
    return experts


def read_fp8(ckpt: Checkpoint, entry: dict, prefix: str, family: Family, scheme: QuantScheme,
             E: int, H: int, N: int, device) -> MoEWeights:
    """The FP8 experts of one module, as stored (the tensor rule above aside)."""
    if entry.get("fused") and not entry.get("experts"):
        return _read_fused_fp8(ckpt, entry["fused"], prefix, family, scheme, E, H, N, device)
    needed = ("weight", "weight_scale") + (("input_scale",) if scheme.static_activation else ())
    experts = _expert_keys(entry, prefix, E, family.projections, needed)
    for key in entry.get("_zero_points", []):
        if bool(ckpt.get(key).float().abs().max() != 0):
            raise CheckpointError(f"checkpoint tensor {key!r} is a non-zero zero point: moekit runs symmetric FP8 only")
    g = scheme.weight
    try:
        check_intermediate(scheme, N)
    except ValueError as e:
        raise CheckpointError(f"{prefix!r}: {e}") from None
    fp8 = quant.FP8_DTYPE
    w13 = torch.empty(E, 2 * N, H, dtype=fp8, device=device)
    w2 = torch.empty(E, H, N, dtype=fp8, device=device)
    s13 = torch.empty(quant.weight_scale_shape(g, E, 2 * N, H), dtype=torch.float32, device=device)
    s2 = torch.empty(quant.weight_scale_shape(g, E, H, N), dtype=torch.float32, device=device)
    a13 = a2 = None
    requantized = 0
    for e in range(E):
        keys = experts[e]

        def scale_key(role):
            return next(keys[role][n] for n in _SCALE_NAMES if n in keys[role])

        wg = _weight(ckpt, keys["gate"]["weight"], (N, H), (fp8,))
        wu = _weight(ckpt, keys["up"]["weight"], (N, H), (fp8,))
        wd = _weight(ckpt, keys["down"]["weight"], (H, N), (fp8,))
        sg = _scale(ckpt, scale_key("gate"), g, N, H)
        su = _scale(ckpt, scale_key("up"), g, N, H)
        sd = _scale(ckpt, scale_key("down"), g, H, N)
        if g == "tensor":
            s = torch.maximum(sg, su)
            if bool(sg != su):  # one scale per w13: requantize the half with the smaller scale
                requantized += 1
                if bool(sg < s):
                    wg = quant.to_fp8(wg.float() * sg, s)
                else:
                    wu = quant.to_fp8(wu.float() * su, s)
            s13[e] = s
            s2[e] = sd
        else:
            s13[e] = torch.cat([sg, su], dim=0)
            s2[e] = sd
        w13[e, :N].copy_(wg)
        w13[e, N:].copy_(wu)
        w2[e].copy_(wd)
        if scheme.static_activation:
            ins = [_scale(ckpt, keys[r]["input_scale"], "tensor", 0, 0) for r in ROLES]
            up_in = torch.maximum(ins[0], ins[1]).to(device)
            a13 = up_in if a13 is None else torch.maximum(a13, up_in)
            a2 = ins[2].to(device) if a2 is None else torch.maximum(a2, ins[2].to(device))
    if requantized:
        log.info("%s: %d experts had different gate/up weight scales; the smaller half was requantized to "
                 "the larger scale (one scale per w13, as vLLM does)", prefix, requantized)
    if scheme.static_activation:
        a13, a2 = a13.reshape(1), a2.reshape(1)
    return MoEWeights.from_fp8(scheme, w13, w2, s13, s2, a13, a2)


def _check_fused(ckpt: Checkpoint, fused: dict, prefix: str, shapes: dict[str, tuple[int, ...]],
                 dtypes: tuple[torch.dtype, ...], expected: str, missing_note: str = "") -> None:
    """Fused expert tensors {name: shape}: every one present (else "no tensor", + missing_note),
    then of its shape and one of `dtypes` (else what it is; `expected`, then the shape)."""
    for name in shapes:
        if name not in fused:
            raise CheckpointError(f"checkpoint has no tensor {prefix + '.' + name!r}{missing_note}")
    for name, shape in shapes.items():
        got_shape, got_dtype = ckpt.info(fused[name])
        if got_shape != shape or got_dtype not in dtypes:
            raise CheckpointError(f"checkpoint tensor {fused[name]!r} is {got_dtype} {got_shape}; {expected} {shape}")


def _read_fused_fp8(ckpt: Checkpoint, fused: dict, prefix: str, family: Family, scheme: QuantScheme,
                    E: int, H: int, N: int, device) -> MoEWeights:
    """fbgemm_fp8's Llama-4 experts (transformers' FbgemmFp8Llama4TextExperts), one expert at a
    time: gate_up_proj FP8 [E, H, 2N] (gate columns, then up), gate_up_proj_scale [E, 1, 2N] (one
    scale per output column), down_proj FP8 [E, N, H], down_proj_scale [E, H, 1]; activations
    dynamic per token. In moekit's layout: w13[e] = gate_up_proj[e].T, w13_scale[e] = the 2N scales."""
    if not family.transposed or scheme.weight != "channel" or scheme.static_activation:
        raise CheckpointError(
            f"{prefix!r}: fused FP8 experts ({', '.join(sorted(fused))}) are supported only in fbgemm_fp8's "
            f"Llama-4 layout (gate_up_proj [E, H, 2N] + per-channel gate_up_proj_scale, down_proj [E, N, H] + "
            f"down_proj_scale); this is family {family.name} with scheme {scheme.name}"
        )
    fp8 = quant.FP8_DTYPE
    note = " (fbgemm_fp8 fused experts)"
    _check_fused(ckpt, fused, prefix, {"gate_up_proj": (E, H, 2 * N), "down_proj": (E, N, H)}, (fp8,),
                 f"the model expects {fp8}", note)
    _check_fused(ckpt, fused, prefix, {"gate_up_proj_scale": (E, 1, 2 * N), "down_proj_scale": (E, H, 1)},
                 (torch.float32, torch.bfloat16, torch.float16), "the per-channel scales of these experts are float",
                 note)
    w13 = torch.empty(E, 2 * N, H, dtype=fp8, device=device)
    w2 = torch.empty(E, H, N, dtype=fp8, device=device)
    s13 = torch.empty(E, 2 * N, dtype=torch.float32, device=device)
    s2 = torch.empty(E, H, dtype=torch.float32, device=device)
    for e in range(E):
        w13[e].copy_(ckpt.get_row(fused["gate_up_proj"], e).t())
        w2[e].copy_(ckpt.get_row(fused["down_proj"], e).t())
        s13[e] = ckpt.get_row(fused["gate_up_proj_scale"], e).float().reshape(2 * N)
        s2[e] = ckpt.get_row(fused["down_proj_scale"], e).float().reshape(H)
    return MoEWeights.from_fp8(scheme, w13, w2, s13, s2)


def read_unquantized(ckpt: Checkpoint, entry: dict, prefix: str, family: Family, E: int, H: int, N: int,
                     dtype: torch.dtype, device, scheme: QuantScheme) -> MoEWeights:
    """bf16/fp16 experts of one module (per-expert or fused tensors), quantized to `scheme` one
    expert at a time when it is an FP8 scheme (only that expert is ever held in float)."""
    if scheme.static_activation:
        raise ValueError("fp8-tensor-static needs calibration: read the experts as bf16 first")
    floats = (torch.bfloat16, torch.float16, torch.float32)
    fused = entry.get("fused")
    if fused and not entry.get("experts"):
        gu_shape = (E, H, 2 * N) if family.transposed else (E, 2 * N, H)
        d_shape = (E, N, H) if family.transposed else (E, H, N)
        _check_fused(ckpt, fused, prefix, {"gate_up_proj": gu_shape, "down_proj": d_shape}, floats,
                     "the model expects a float tensor of shape")

        def expert(e):
            gu, d = ckpt.get_row(fused["gate_up_proj"], e), ckpt.get_row(fused["down_proj"], e)
            if family.transposed:
                gu, d = gu.t(), d.t()
            return gu, d
    else:
        experts = _expert_keys(entry, prefix, E, family.projections, ("weight",))

        def expert(e):
            k = experts[e]
            gu = torch.cat([_weight(ckpt, k["gate"]["weight"], (N, H), floats),
                            _weight(ckpt, k["up"]["weight"], (N, H), floats)], dim=0)
            return gu, _weight(ckpt, k["down"]["weight"], (H, N), floats)

    if not scheme.is_fp8:
        w13 = torch.empty(E, 2 * N, H, dtype=dtype, device=device)
        w2 = torch.empty(E, H, N, dtype=dtype, device=device)
        for e in range(E):
            gu, d = expert(e)
            w13[e].copy_(gu)
            w2[e].copy_(d)
        return MoEWeights(scheme, w13, w2)
    return quantize_per_expert(expert, E, H, N, scheme, device)


def quantize_per_expert(expert, E: int, H: int, N: int, scheme: QuantScheme, device,
                        input_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> MoEWeights:
    """moekit.weights.quantize_per_expert (experts `expert(e) -> (w13_e [2N, H], w2_e [H, N])`
    quantized one at a time), a scheme the layer cannot take refused as UnsupportedModelError
    before any expert is read."""
    try:
        check_intermediate(scheme, N)
    except ValueError as e:
        raise UnsupportedModelError(str(e)) from None
    return weights.quantize_per_expert(expert, E, H, N, scheme, device, input_scales)
