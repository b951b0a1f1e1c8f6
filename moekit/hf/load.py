"""Loading transformers MoE models with moekit experts: FP8 stays FP8.

    model = moekit.hf.from_pretrained("/models/Qwen3-30B-A3B-FP8-dynamic")      # FP8 as stored
    model = moekit.hf.from_pretrained("/models/Mixtral-8x7B", scheme="fp8-channel-token")
    model = moekit.hf.patch_model(model)                 # an already loaded model, experts via moekit

How `from_pretrained` keeps the experts out of transformers' hands: while transformers builds the
model, the family's experts class (Llama-4: its MoE block) is replaced through transformers'
own class-replacement registry (`transformers.monkey_patching`) by a `MoekitExperts` that has
no parameters. The checkpoint's expert tensors then match nothing in the model, so transformers
neither reads nor dequantizes them; everything else (attention, router, shared experts, norms,
embeddings, and the checkpoint's quantization of those) loads exactly as transformers loads it.
Then each experts module is filled from the safetensors files, one tensor at a time
(`checkpoint.py`), in moekit's layout.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

from ..models import parse_quantization_config
from ..select import environment_backend, select_backend
from ..spec import BF16, QuantScheme, get_scheme
from ..weights import MoEWeights
from ..weights import _calibrate  # quantize_weights' own measurement of static activation scales
from ..weights import _not_a_scale  # MoEWeights' rule for a weight scale it refuses
from . import checkpoint as ckpt_mod
from .experts import (IMPLEMENTATION, ExpertsError, MoekitExperts, _hf_weights, _is_silu, check_hf_experts,
                      experts_modules, fp8_experts_class, register, set_backend)
from .families import Family, UnsupportedModelError, family_of_config, family_of_module
from .routers import RoutedExperts, fuse_routers, routers_to_fuse, swap_routers

log = logging.getLogger("moekit.hf")


# ------------------------------------------------------------------------ module classes


def _dims(module: nn.Module, family: Family) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) from a transformers experts module's weight shapes."""
    gate_up = module.gate_up_proj
    if family.transposed:
        E, H, two_n = gate_up.shape
    else:
        E, two_n, H = gate_up.shape
    return E, H, two_n // 2


def _check_experts_math(hf_experts: nn.Module, family: Family, label: str | None = None) -> None:
    """ExpertsError unless moekit computes this transformers experts module's math (SiLU(gate) * up,
    no bias, ...; check_hf_experts, or the activation alone for Llama-4's transposed experts)."""
    if not family.transposed:
        check_hf_experts(hf_experts, label)
    elif not _is_silu(getattr(hf_experts, "act_fn", nn.SiLU())):
        act = hf_experts.act_fn
        raise ExpertsError(f"{label or type(hf_experts).__name__}: activation "
                           f"{getattr(act, '__name__', type(act).__name__)} is not SiLU")


def _empty_experts(hf_experts: nn.Module, family: Family, config=None) -> MoekitExperts:
    """A MoekitExperts without weights, shaped like this transformers experts module."""
    _check_experts_math(hf_experts, family)
    E, H, N = _dims(hf_experts, family)
    m = MoekitExperts(E, H, N, family=family.name, source_class=type(hf_experts).__name__,
                      apply_on_input=family.apply_on_input)
    m.config = config if config is not None else getattr(hf_experts, "config", None)
    return m


_CLASSES: dict[tuple[str, str], type] = {}


def placeholder_class(family: Family) -> type:
    """The class that stands in for the family's experts (or Llama-4 block) while loading."""
    key = (family.module, family.patched_class)
    if key in _CLASSES:
        return _CLASSES[key]
    if family.block_class is not None:
        cls = llama4_block_class(family)
    else:
        original = family.original_class(family.experts_class)

        def __init__(self, config, *args, **kwargs):
            with torch.device("meta"):
                reference = original(config, *args, **kwargs)
            template = _empty_experts(reference, family, config)
            MoekitExperts.__init__(self, template.num_experts, template.hidden_dim, template.intermediate_dim,
                                   family=family.name, source_class=original.__name__,
                                   apply_on_input=family.apply_on_input)
            self.config = config

        cls = type(f"Moekit{original.__name__}", (MoekitExperts,), {"__init__": __init__,
                                                                     "__module__": __name__})
    _CLASSES[key] = cls
    return cls


def llama4_block_class(family: Family) -> type:
    """Llama-4's MoE block with its routed experts run by moekit (router weight on the input)."""
    key = (family.module, "block")
    if key in _CLASSES:
        return _CLASSES[key]
    block = family.original_class(family.block_class)

    class MoekitLlama4TextMoe(block):
        takes_routed_experts = True  # a fused router's output (routers.py) as well as transformers'

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.experts = _empty_experts(self.experts, family, config)

        def forward(self, hidden_states):
            x = hidden_states.reshape(-1, self.hidden_dim)
            routed, router_logits = self.router(x)
            if isinstance(routed, RoutedExperts):  # a fused router (routers.py)
                weights, ids = routed
            else:  # transformers' router: scores [T, E], sigmoid of the top-k, 0 elsewhere
                ids = torch.topk(router_logits, self.top_k, dim=1).indices
                weights = routed.gather(1, ids)
            out = self.shared_expert(x)
            out.add_(self.experts(x, ids, weights))
            return out, router_logits

    MoekitLlama4TextMoe.__module__ = __name__
    MoekitLlama4TextMoe.__qualname__ = "MoekitLlama4TextMoe"  # pickle finds it by name (module __getattr__)
    _CLASSES[key] = MoekitLlama4TextMoe
    return MoekitLlama4TextMoe


@contextlib.contextmanager
def _placeholders(family: Family):
    """While transformers builds a model, the family's experts are empty MoekitExperts."""
    replacement = placeholder_class(family)
    try:
        from transformers.monkey_patching import get_patch_mapping, register_patch_mapping, unregister_patch_mapping
    except ImportError:  # older transformers 5.x: swap the class in its module by hand
        module = family.modeling_module()
        original = getattr(module, family.patched_class)
        setattr(module, family.patched_class, replacement)
        try:
            yield
        finally:
            setattr(module, family.patched_class, original)
        return
    key = f"^{family.patched_class}$"
    previous = get_patch_mapping().get(key)
    register_patch_mapping({key: replacement}, overwrite=True)
    try:
        yield
    finally:
        unregister_patch_mapping([key])
        if previous is not None:
            register_patch_mapping({key: previous})


class _DropLoadReport(logging.Filter):
    """transformers' load report lists the expert tensors moekit reads itself as unexpected:
    it is replaced by moekit's own account of what else was missing or unexpected."""

    def filter(self, record):
        return "LOAD REPORT" not in record.getMessage()


# ------------------------------------------------------------------------- checkpoint -> model


def _module_of_prefix(prefix: str, family: Family, renamings, module_names: set[str], base_prefix: str) -> str | None:
    """The model's experts module for a checkpoint experts prefix, through transformers' renamings."""
    from transformers.core_model_loading import rename_source_key

    probe = f"{prefix}.0.{family.projections[0]}.weight"
    renamed, _ = rename_source_key(probe, renamings, [])
    head = renamed[: renamed.rfind(".experts.")] + ".experts" if ".experts." in renamed else prefix
    for candidate in (head, prefix, head.removeprefix(base_prefix + "."), f"{base_prefix}.{head}"):
        if candidate in module_names:
            return candidate
    return None


def prefix_of_module(model: nn.Module, name: str, family: Family) -> str:
    """The checkpoint prefix of an experts module (transformers' renamings reversed)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = get_model_conversion_mapping(model, add_legacy=False)
    renamings = [c.reverse_transform() for c in conversions[::-1] if isinstance(c, WeightRenaming)]
    probe = f"{name}.0.{family.projections[0]}.weight"
    renamed, _ = rename_source_key(probe, renamings, [], reverse=True)
    return renamed[: renamed.rfind(".experts.")] + ".experts" if ".experts." in renamed else name


def _renamings(model):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    return [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightRenaming)]


def _ignored_by_transformers(model: nn.Module, prefix: str) -> bool:
    """Whether transformers' own load ignores this checkpoint prefix's tensors
    (the model's _keys_to_ignore_on_load_unexpected, searched as transformers does)."""
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    return any(re.search(p, f"{prefix}.") for p in patterns)


def _device_of(model: nn.Module, name: str) -> torch.device:
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    for p in parent.parameters():
        if p.device.type != "meta":
            return p.device
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def fill_from_checkpoint(model: nn.Module, folder: str | Path, family: Family, scheme: QuantScheme | None,
                         dtype: torch.dtype, schemes: dict[str, QuantScheme] | None = None,
                         raw: dict | None = None) -> dict[str, MoekitExperts]:
    """Load every MoekitExperts of `model` from the checkpoint at `folder`, each under the scheme
    its config gives that module (an `ignore` entry may name one layer's experts). `schemes`:
    {experts prefix: scheme} as `_checkpoint_schemes` worked them out for this checkpoint already
    (from_pretrained does, to refuse before the model is built); None: worked out here. `raw`:
    the folder's config.json as read already (None: read here)."""
    raw = _raw_config(Path(folder)) if raw is None else raw
    ckpt = ckpt_mod.Checkpoint(folder)
    try:
        found = _found_experts(ckpt, folder, family)
        modules = experts_modules(model)
        renamings = _renamings(model)
        base = getattr(model, "base_model_prefix", "model")
        by_module: dict[str, str] = {}
        ignored, unused = [], []
        for prefix in found:
            name = _module_of_prefix(prefix, family, renamings, set(modules), base)
            if name is None:
                # e.g. DeepSeek-V3's / GLM-4.5's multi-token-prediction layer (model.layers.61 / 46 / 92):
                # the model has no such layer, and transformers skips its tensors
                (ignored if _ignored_by_transformers(model, prefix) else unused).append(prefix)
                continue
            by_module[name] = prefix
        if ignored:
            log.info("%s: experts %s are not part of the model (transformers skips these layers): not read",
                     folder, ", ".join(sorted(ignored)))
        if unused:  # transformers reports checkpoint tensors the model has no place for, and loads the rest
            log.warning("%s: checkpoint experts %s belong to no experts module of the model (it has %s): not read",
                        folder, ", ".join(sorted(unused)),
                        ", ".join(sorted(modules)[:3]) + (", ..." if len(modules) > 3 else ""))
        unfilled = sorted(set(modules) - set(by_module))
        if unfilled:
            raise ckpt_mod.CheckpointError(
                f"checkpoint {str(folder)!r} has no expert tensors for {unfilled[0]}"
                + (f" (and {len(unfilled) - 1} more experts modules)" if len(unfilled) > 1 else "")
            )
        said_unquantized = False
        for name, module in modules.items():
            prefix = by_module[name]
            entry = found[prefix]
            E, H, N = module.num_experts, module.hidden_dim, module.intermediate_dim
            device = _device_of(model, name)
            stored = ckpt_mod.experts_dtype(ckpt, entry, prefix)
            ckpt_scheme = schemes[prefix] if schemes is not None else _module_scheme(raw, folder, prefix, entry, family, E)
            try:
                if stored == torch.float8_e4m3fn:
                    if not ckpt_scheme.is_fp8:
                        raise ckpt_mod.CheckpointError(
                            f"{prefix!r} holds FP8 expert weights but "
                            + ("the config has no quantization_config" if _quant_config(raw) is None else
                               "the config's quantization_config leaves them unquantized (its ignore list "
                               "names them, or no FP8 group targets them)")
                        )
                    if scheme is not None and scheme != ckpt_scheme:
                        raise UnsupportedModelError(
                            f"the checkpoint's experts are {ckpt_scheme.name}; moekit loads FP8 experts as "
                            f"stored and does not convert them to {scheme.name} (leave scheme=None)"
                        )
                    weights = ckpt_mod.read_fp8(ckpt, entry, prefix, family, ckpt_scheme, E, H, N, device)
                else:
                    if ckpt_scheme.is_fp8 and not said_unquantized:
                        log.warning("%s: quantization_config says %s but the experts are stored as %s; "
                                    "they are loaded as stored%s", folder, ckpt_scheme.name, stored,
                                    f" and quantized to {scheme.name}" if scheme and scheme.is_fp8 else
                                    f" (pass scheme={ckpt_scheme.name!r} to quantize them)")
                        said_unquantized = True
                    target = scheme or BF16
                    read_as = BF16 if target.static_activation else target
                    weights = ckpt_mod.read_unquantized(ckpt, entry, prefix, family, E, H, N, dtype, device, read_as)
            except ckpt_mod.CheckpointError as e:
                raise ckpt_mod.CheckpointError(f"{name}: {e}") from None
            except (UnsupportedModelError, ExpertsError):
                raise
            except ValueError as e:  # MoEWeights' own refusal of what was read (a NaN scale, say)
                where = _refused_tensors(ckpt, entry, prefix)
                raise ckpt_mod.CheckpointError(f"{name}: read from {where}: {e}") from None
            module.moekit_name = name
            module.load(weights)
        return modules
    finally:
        ckpt.close()


_SCALE_TENSORS = ("weight_scale", "weight_scale_inv", "input_scale", "gate_up_proj_scale", "down_proj_scale")


def _valid_scale(t: torch.Tensor) -> bool:
    return not bool(_not_a_scale(t.float()).any())  # MoEWeights' own rule


def _refused_tensors(ckpt: ckpt_mod.Checkpoint, entry: dict, prefix: str) -> str:
    """The checkpoint scale tensors of one experts module holding a value MoEWeights refuses (NaN,
    infinite or negative), read again once it has refused: its error names its own field and
    index (w13_scale at (5, 128)), which the checkpoint does not have. Where no one tensor is at
    fault (a static activation scale of 0: the largest of the experts'), the module's as a whole."""
    per_expert = entry.get("experts", {})
    keys = [key for e in sorted(per_expert) for role in ckpt_mod.ROLES
            for name, key in per_expert[e].get(role, {}).items() if name in _SCALE_TENSORS]
    keys += [key for name, key in sorted(entry.get("fused", {}).items()) if name in _SCALE_TENSORS]
    bad = [key for key in keys if not _valid_scale(ckpt.get(key))]
    if not bad:
        return f"checkpoint tensors {prefix + '.*'!r}"
    return f"checkpoint tensor {bad[0]!r}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")


# --------------------------------------------------------------------------- quantization


def _quantize_module(module: MoekitExperts, scheme: QuantScheme, calibration: torch.Tensor | None) -> None:
    """Requantize a bf16 MoekitExperts to `scheme` in place (one expert at a time)."""
    if module.scheme == scheme:
        return
    if module.scheme.is_fp8:
        raise UnsupportedModelError(
            f"{module.label}: experts are already {module.scheme.name}; moekit does not requantize FP8 experts "
            f"to {scheme.name}"
        )
    w = module.moe_weights()
    if scheme.static_activation:
        if calibration is None:
            raise UnsupportedModelError(
                f"{module.label}: scheme {scheme.name} needs static activation scales: pass calibration= "
                "(token ids, or text with a tokenizer in the model folder) to measure them"
            )
        # the activation scales measured as quantize_weights measures them (bitwise the same), here
        # so that a failure is an UnsupportedModelError naming the module
        a13, a2 = _calibrate(w.w13, w.w2, calibration)
        if not (bool(torch.isfinite(a13).all()) and bool(torch.isfinite(a2).all())):
            raise UnsupportedModelError(f"{module.label}: the calibration gave non-finite activation scales "
                                        f"(a13 {float(a13)}, a2 {float(a2)})")
    if scheme.is_fp8:
        new = ckpt_mod.quantize_per_expert(lambda e: (w.w13[e], w.w2[e]), w.num_experts, w.hidden, w.n, scheme,
                                           w.device, input_scales=(a13, a2) if scheme.static_activation else None)
    else:
        new = MoEWeights(scheme, w.w13, w.w2)
    module.load(new)


@torch.no_grad()
def _capture_inputs(model: nn.Module, modules: dict[str, MoekitExperts], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each experts module's input rows [T, H] on the calibration tokens."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
    hooks = []
    for name, m in modules.items():
        def hook(mod, args, name=name):
            seen[name].append(args[0].reshape(-1, args[0].shape[-1]).detach().float())
        hooks.append(m.register_forward_pre_hook(hook))
    try:
        device = next(p.device for p in model.parameters())
        ids = input_ids if input_ids.dim() == 2 else input_ids[None]
        model(input_ids=ids.to(device))
    finally:
        for h in hooks:
            h.remove()
    missing = [n for n, xs in seen.items() if not xs]
    if missing:
        raise UnsupportedModelError(f"calibration never reached {missing[0]}: no tokens were routed through it")
    return {n: torch.cat(xs) for n, xs in seen.items()}


def quantize_model(model: nn.Module, scheme: str | QuantScheme, calibration: torch.Tensor | None = None) -> None:
    """Requantize every bf16 MoekitExperts of `model` to `scheme` (static: calibrated on token ids).
    A model without moekit's experts (transformers' own, which this does not replace) is refused."""
    scheme = get_scheme(scheme)
    _check_calibration_scheme(calibration, scheme)
    if not experts_modules(model):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no moekit experts to quantize (transformers' own experts stay as they are): "
            f"call moekit.hf.patch_model(model, scheme={scheme.name!r}), which replaces and quantizes them"
        )
    _quantize_modules(model, scheme, _calibration_inputs(model, scheme, calibration))


def _check_calibration_scheme(calibration, scheme: QuantScheme | None) -> None:
    """ValueError for calibration= that nothing would read (a user who passes it believes static
    scales are measured): only fp8-tensor-static takes it, as quantize_weights refuses it."""
    if calibration is None or (scheme is not None and scheme.static_activation):
        return
    why = ("without scheme= the experts are not quantized (an FP8 checkpoint's load as stored)" if scheme is None
           else f"scheme {scheme.name} computes its activation scales per call" if scheme.is_fp8
           else f"scheme {scheme.name} does not quantize")
    raise ValueError(f"calibration: only for scheme fp8-tensor-static (static activation scales); {why}")


def _calibration_inputs(model: nn.Module, scheme: QuantScheme, calibration: torch.Tensor | None) -> dict:
    """{experts module name: its inputs} from a calibration forward, for a static scheme's scales
    (empty for the others): quantize_model's first half, which runs the model."""
    if not (scheme.static_activation and calibration is not None):
        return {}
    modules = experts_modules(model)
    return _capture_inputs(model, {n: m for n, m in modules.items() if m.scheme != scheme}, calibration)


def _quantize_modules(model: nn.Module, scheme: QuantScheme, inputs: dict) -> None:
    """quantize_model's second half: each experts module in turn, its originals released as it goes."""
    for name, m in experts_modules(model).items():
        _quantize_module(m, scheme, inputs.get(name) if scheme.static_activation else None)


# -------------------------------------------------------------------------------- patching


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _check_bf16_experts(hf: nn.Module, family: Family, name: str) -> None:
    """What _hf_to_moekit refuses, checked without building anything (patch_model: every module
    before the first is replaced)."""
    _check_experts_math(hf, family, name)
    _check_in_memory(hf, name)
    if hf.gate_up_proj.dtype not in (torch.bfloat16, torch.float16):
        raise ExpertsError(f"{name}: experts are {hf.gate_up_proj.dtype}; moekit needs bf16/fp16 "
                           "(load with dtype=torch.bfloat16)")


def _check_in_memory(hf: nn.Module, name: str) -> None:
    """ExpertsError for experts whose weights accelerate offloaded (device_map with "cpu" or
    "disk" offload): they are meta tensors that accelerate's hook on the layer loads for each
    forward, and the MoekitExperts put in their place would hold the meta tensors themselves."""
    meta = [k for k, t in (*hf.named_parameters(), *hf.named_buffers()) if t.device.type == "meta"]
    if meta:
        raise ExpertsError(f"{name}: the experts' {meta[0]} is on the meta device (offloaded by accelerate's "
                           "device_map to 'cpu' or 'disk'); moekit needs the experts' weights in memory: load "
                           "the model with every layer on a device (no offloading)")


def _hf_to_moekit(hf: nn.Module, family: Family, name: str) -> MoekitExperts:
    """A bf16 MoekitExperts over a transformers experts module's weights (no copy unless transposed)."""
    _check_bf16_experts(hf, family, name)
    new = _empty_experts(hf, family)
    gate_up, down = hf.gate_up_proj.detach(), hf.down_proj.detach()
    if family.transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    new.moekit_name = name
    new.load(MoEWeights(BF16, gate_up, down))
    return new


def _fp8_experts_family(hf: nn.Module, model: nn.Module, name: str) -> Family:
    """The family of transformers' own FP8Experts (one class for every family: the model's), once
    moekit can run the module (what _hf_fp8_to_moekit refuses, checked without building anything)."""
    family = family_of_config(model.config)
    if family.transposed:
        raise UnsupportedModelError(f"{name}: transformers' FP8Experts in a {family.name} model: moekit runs "
                                    f"{family.name}'s experts from its checkpoint (patch_model(checkpoint=...))")
    _check_experts_math(hf, family, name)
    _check_in_memory(hf, name)
    _hf_weights(hf, name)  # the tensors' own checks (block size, scales), remembered on the module
    return family


def _hf_fp8_to_moekit(hf: nn.Module, model: nn.Module, name: str) -> tuple[Family, MoekitExperts]:
    """An FP8 MoekitExperts over transformers' own FP8Experts (quant_method "fp8" loaded on a GPU),
    its weights and scales as they are."""
    family = _fp8_experts_family(hf, model, name)
    new = _empty_experts(hf, family)
    new.moekit_name = name
    new.load(_hf_weights(hf, name))
    return family, new


def _refuse_before_change(model: nn.Module) -> None:
    """Raise what _to_moekit_modules would raise for any experts module, before it replaces the
    first: a refusal at layer 5 left layers 0-4 replaced (a half-patched model)."""
    for name, module in model.named_modules():
        if isinstance(module, MoekitExperts):
            continue
        if _is_fp8_experts(module):
            _fp8_experts_family(module, model, name)
            continue
        fam = family_of_module(module)
        if fam is None or fam.block_class is not None and type(module).__name__ != fam.block_class:
            continue
        experts, label = (module.experts, f"{name}.experts") if fam.block_class is not None else (module, name)
        if not isinstance(experts, (nn.ModuleList, MoekitExperts)):
            _check_bf16_experts(experts, fam, label)


def _is_fp8_experts(module: nn.Module) -> bool:
    cls = fp8_experts_class()
    return cls is not None and isinstance(module, cls)


def _to_moekit_modules(model: nn.Module) -> tuple[Family | None, dict[str, MoekitExperts], list[tuple[str, nn.Module]]]:
    """Replace every transformers experts module (Llama-4: block) of a supported family, and
    transformers' own FP8Experts, by a MoekitExperts over the same weights. Returns (family,
    moekit modules, replaced originals)."""
    family = None
    replaced = []
    for name, module in list(model.named_modules()):
        if isinstance(module, MoekitExperts):
            continue
        if _is_fp8_experts(module):
            family, new = _hf_fp8_to_moekit(module, model, name)
            _replace(model, name, new)
            replaced.append((name, module))
            continue
        fam = family_of_module(module)
        if fam is None:
            continue
        family = fam
        if fam.block_class is not None and type(module).__name__ == fam.block_class:
            module.__class__ = llama4_block_class(fam)  # same router and shared expert, moekit experts
            experts_name = f"{name}.experts"
            if isinstance(module.experts, nn.ModuleList):  # per-expert MLPs (transformers' quantized Llama-4)
                mlp = module.experts[0]
                empty = MoekitExperts(len(module.experts), mlp.gate_proj.in_features, mlp.gate_proj.out_features,
                                      family=fam.name, source_class=type(module.experts).__name__,
                                      apply_on_input=fam.apply_on_input)
                empty.moekit_name = experts_name
                module.experts = empty  # filled from checkpoint= (patch_model raises otherwise)
            elif not isinstance(module.experts, MoekitExperts):
                module.experts = _hf_to_moekit(module.experts, fam, experts_name)
            replaced.append((experts_name, module))
        elif fam.block_class is None:
            _replace(model, name, _hf_to_moekit(module, fam, name))
            replaced.append((name, module))
    modules = experts_modules(model)
    for name, m in modules.items():
        m.moekit_name = name
        if family is None and m.family:
            from .families import family_of

            family = family_of(m.family)
    return family, modules, replaced


def _set_implementation(model: nn.Module) -> None:
    set_impl = getattr(model, "set_experts_implementation", None)
    if callable(set_impl):
        try:
            set_impl("moekit")
        except Exception as e:  # a model that cannot switch: its experts are moekit's anyway
            log.debug("set_experts_implementation('moekit') not applied: %s", e)


def _check_backend_name(backend: str | None) -> None:
    """ValueError for a backend name that is no backend, before anything loads or changes: the
    argument's, or for "auto" MOEKIT_BACKEND's (which the experts would read at their first
    forward; select.environment_backend's error names the variable)."""
    if backend in (None, "auto"):
        environment_backend()
    else:
        from ..backends import get_backend

        get_backend(backend)  # lists the valid names


def _check_backend(modules: dict[str, MoekitExperts], backend: str | None, dtype: torch.dtype,
                   scheme: QuantScheme | None = None) -> None:
    """Raise BackendUnavailableError now (not at the first forward) for a backend that cannot run
    the experts with activations of `dtype`, the model's (what its layers hand the experts): the
    one named, or for "auto" the one MOEKIT_BACKEND names, resolved by select_backend as each
    forward resolves it (its error names the variable). `scheme`: the experts' scheme to be
    (patch_model asks before it quantizes them), else their own."""
    if not modules or (backend in (None, "auto") and environment_backend() is None):
        return
    m = next(iter(modules.values()))
    w = m.moe_weights()
    select_backend(w.shape(1), scheme or w.scheme, w.device, dtype, 1, backend)


def _model_dtype(model: nn.Module, modules: dict[str, MoekitExperts]) -> torch.dtype:
    """The dtype of the model's activations: transformers' `model.dtype` (its first floating
    parameter's), else unquantized experts' dtype, else bf16."""
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype != torch.float8_e4m3fn:
        return dtype
    return next((m.moe_weights().w13.dtype for m in modules.values() if m.loaded and not m.scheme.is_fp8),
                torch.bfloat16)


def patch_model(model: nn.Module, scheme: str | QuantScheme | None = None, backend: str | None = "auto", *,
                checkpoint: str | Path | None = None, calibration: torch.Tensor | None = None,
                fused_routing: bool = False) -> nn.Module:
    """Run the routed experts of an already loaded transformers model through moekit.

    Every experts module of a supported family (Llama-4: its MoE block) is replaced by a
    `MoekitExperts`; routers, shared experts and everything else are untouched.
    - checkpoint=None: the model's own expert weights, kept as they are (scheme None or "bf16",
      no copy) or quantized to `scheme` one experts module at a time, each releasing its bf16
      originals, after every check (below).
      fp8-tensor-static measures its activation scales on `calibration` (token ids [B, T]);
      calibration for another scheme is refused, not ignored.
    - checkpoint=PATH: the experts are (re)loaded from that checkpoint's safetensors files, FP8
      as stored (e.g. a model that transformers loaded with dequantized experts).
    - fused_routing=True: the routers run through moekit.route too (routers.py), each checked
      against transformers' own first.
    Anything refused (a backend that cannot run, the argument's or MOEKIT_BACKEND's, a checkpoint
    that does not fit, calibration ids or the calibration forward, experts that accelerate
    offloaded) leaves the model as it was; refilling experts that are moekit's already from a
    checkpoint holds their former tensors until every module is read, for that. The patched
    model's transformers save_pretrained is refused (_SaveRefused): save it with
    moekit.hf.save_pretrained. Returns the model.
    """
    register()
    # refused before anything changes; the experts are checked to be moekit's once they are
    routers = routers_to_fuse(model, experts_patched=False) if fused_routing else []
    if checkpoint is None:
        weightless = _experts_without_weights(model)
        if weightless:
            raise UnsupportedModelError(f"{weightless}: these experts hold no weights moekit can use (per-expert "
                                        "layers of transformers' quantized Llama-4); pass checkpoint=")
    else:
        _raw_config(Path(checkpoint))  # not a model folder: refused before anything changes
    want = get_scheme(scheme) if scheme is not None else None
    _check_calibration_scheme(calibration, want)
    calibration = _calibration_ids(calibration, vocab_size=_vocab_size(getattr(model, "config", None)))
    _check_backend_name(backend)
    _refuse_before_change(model)
    # what needs the experts in moekit's form (a backend that cannot run them, a checkpoint tensor
    # missing at the last layer) is refused once they are: the model is then put back as it was
    with _restored_on_error(model):
        family, modules, _ = _to_moekit_modules(model)
        if not modules:
            from .families import FAMILIES

            raise UnsupportedModelError(
                f"{type(model).__name__} has no experts module of a family moekit runs "
                f"({', '.join(f.name for f in FAMILIES)})"
            )
        _set_implementation(model)  # before a calibration forward, which runs the experts
        if checkpoint is not None:
            dtype = next((m.moe_weights().w13.dtype for m in modules.values()
                          if m.loaded and not m.scheme.is_fp8), torch.bfloat16)
            fill_from_checkpoint(model, checkpoint, family, want, dtype)
            # each module holds the scheme the config gives it (an ignore list may leave some bf16)
            target = want if want is not None and any(m.scheme != want for m in modules.values()) else None
        else:
            empty = [name for name, m in modules.items() if not m.loaded]
            if empty:
                raise UnsupportedModelError(f"{empty[0]}: these experts hold no weights moekit can use; "
                                            "pass checkpoint=")
            target = want
        _check_backend(modules, backend, _model_dtype(model, modules), target)  # before quantizing in vain
        inputs = _calibration_inputs(model, target, calibration) if target is not None else {}
        swap_routers(routers, model)
    # quantizing comes last, once everything that can be refused was: one module at a time, each
    # releasing its originals as it goes (inside the block above they would be held for the
    # rollback, the experts' memory twice over); an error here (out of memory) leaves the modules
    # quantized so far quantized, each whole
    if target is not None:
        _quantize_modules(model, target, inputs)
    set_backend(model, backend)
    _refuse_transformers_save(model)
    return model


class _SaveRefused:
    """Stands in for transformers' save_pretrained (which push_to_hub calls too) on a model whose
    experts are moekit's: it would write their buffers under moekit's names (experts.w13, w2,
    scales) and no quantization_config, a checkpoint that transformers reloads with random experts
    and moekit cannot read. An object, not a bound method, so torch.save and deepcopy keep it."""

    def __init__(self, owner: str, experts: str):
        self.owner, self.experts = owner, experts

    def __call__(self, *args, **kwargs):
        raise UnsupportedModelError(
            f"{self.owner}.save_pretrained: transformers would write moekit's experts ({self.experts}) under "
            "moekit's internal tensor names (w13, w2, ...), which neither transformers nor moekit loads; use "
            "moekit.hf.save_pretrained(model, path), a checkpoint both load, or save the model before moekit "
            "patches it"
        )


def _refuse_transformers_save(model: nn.Module) -> None:
    """Put _SaveRefused in place of save_pretrained on every transformers model (the model and
    any PreTrainedModel inside it, such as model.model) that holds moekit's experts."""
    for module in model.modules():
        if callable(getattr(type(module), "save_pretrained", None)):
            inside = experts_modules(module)
            if inside:
                module.__dict__["save_pretrained"] = _SaveRefused(type(module).__name__, next(iter(inside)) +
                                                                  (", ..." if len(inside) > 1 else ""))


def _shallow_state(obj) -> dict:
    """An object's attributes as {name: (value, a copy of its contents where it is a container)}:
    a module's _modules, _buffers, _forward_hooks, _non_persistent_buffers_set, ... What
    patch_model changes is which tensor or module sits where, never a tensor's values."""
    return {k: (v, copy.copy(v) if isinstance(v, (dict, set, list)) else None) for k, v in vars(obj).items()}


def _restore_state(obj, cls: type, state: dict) -> None:
    """_shallow_state's object as it was: its class, its attributes, and each container the same
    object refilled with what it held (a hook's RemovableHandle holds its module's hook dict
    weakly: a copy put in its place would leave the handle unable to remove the hook)."""
    obj.__class__ = cls
    vars(obj).clear()
    for name, (value, contents) in state.items():
        if contents is not None:
            value.clear()
            value.extend(contents) if isinstance(value, list) else value.update(contents)
        vars(obj)[name] = value


@contextlib.contextmanager
def _restored_on_error(model: nn.Module):
    """`model` as it was if the block raises: every module's class and attributes (its submodules,
    parameters, buffers and hooks among them) and its configs' (experts_implementation) put back.
    So what the block replaces stays in memory until it ends: transformers' experts modules,
    Llama-4's original experts, the former buffers of moekit's experts that it refills from a
    checkpoint (patch_model quantizes after the block, for that reason)."""
    saved = {}
    for m in model.modules():
        for obj in (m, getattr(m, "config", None)):
            if hasattr(obj, "__dict__") and id(obj) not in saved:
                saved[id(obj)] = (obj, type(obj), _shallow_state(obj))
    try:
        yield
    except BaseException:
        for obj, cls, state in saved.values():
            _restore_state(obj, cls, state)
        raise


def _experts_without_weights(model: nn.Module) -> str | None:
    """The name of a Llama-4 block whose experts are per-expert layers (transformers' quantized
    Llama-4): _to_moekit_modules would leave it empty experts, to be filled from a checkpoint."""
    for name, module in model.named_modules():
        fam = family_of_module(module)
        if (fam is not None and fam.block_class is not None and type(module).__name__ == fam.block_class
                and isinstance(getattr(module, "experts", None), nn.ModuleList)):
            return f"{name}.experts"
    return None


# --------------------------------------------------------------------------------- loading


def _raw_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UnsupportedModelError(f"{str(folder)!r} is not a model folder: it has no config.json")
    return json.loads(path.read_text())


def _quant_config(raw: dict):
    quant = raw.get("quantization_config")
    if quant is None and isinstance(raw.get("text_config"), dict):
        quant = raw["text_config"].get("quantization_config")
    return quant


def _checkpoint_scheme(raw: dict, folder, experts: list[str] | None = None) -> QuantScheme:
    """The experts' scheme in the config (`experts`: of these expert projections, one module's)."""
    try:
        return parse_quantization_config(_quant_config(raw), experts)
    except ValueError as e:
        raise UnsupportedModelError(f"{folder}: moekit cannot run this checkpoint's quantization: {e}") from None


def _found_experts(ckpt: ckpt_mod.Checkpoint, folder, family: Family) -> dict[str, dict]:
    """find_experts, refusing a checkpoint without expert tensors."""
    found = ckpt_mod.find_experts(ckpt, family)
    if not found:
        g, u, d = family.projections
        raise ckpt_mod.CheckpointError(
            f"{str(folder)!r}: no expert tensors found (looked for '<...>.experts.<e>.{g}|{u}|{d}.weight' "
            "and '<...>.experts.gate_up_proj')"
        )
    return found


def _module_scheme(raw: dict, folder, prefix: str, entry: dict, family: Family, num_experts: int) -> QuantScheme:
    """The scheme the config gives the checkpoint's experts module at `prefix`, read from its expert
    projections' own names (fused tensors: `num_experts` of them)."""
    experts = sorted(entry["experts"]) if "experts" in entry else range(num_experts)
    return _checkpoint_scheme(raw, folder, [f"{prefix}.{e}.{p}" for e in experts for p in family.projections])


def _checkpoint_schemes(folder, family: Family, raw: dict | None = None) -> dict[str, QuantScheme]:
    """{experts prefix: its scheme} for every experts module of the checkpoint at `folder`, before
    any model is built. Read from the checkpoint's own expert names, not from the config alone: a
    compressed-tensors `ignore` list may name every expert projection one by one (as
    compressed-tensors writes it), which leaves them bf16 only a reading of the real names can tell."""
    raw = _raw_config(Path(folder)) if raw is None else raw
    ckpt = ckpt_mod.Checkpoint(folder)
    try:
        schemes = {}
        for prefix, entry in _found_experts(ckpt, folder, family).items():
            # fused tensors hold the experts along dim 0 ([E, ...]), as read_unquantized reads them
            fused = entry.get("fused", {})
            key = fused.get("gate_up_proj") or fused.get("down_proj")
            schemes[prefix] = _module_scheme(raw, folder, prefix, entry, family,
                                             ckpt.info(key)[0][0] if key else 0)
        return schemes
    finally:
        ckpt.close()


def _fp8_not_converted(schemes: dict[str, QuantScheme], want: QuantScheme | None) -> tuple[str, QuantScheme] | None:
    """The first experts module (prefix, its scheme) whose config says FP8 of another scheme than
    `want`: moekit loads FP8 experts as stored and does not convert them (None: nothing refused)."""
    if want is None:
        return None
    return next(((p, s) for p, s in schemes.items() if s.is_fp8 and s != want), None)


def _model_class(config):
    from transformers import AutoModelForCausalLM

    try:
        from transformers import AutoModelForImageTextToText
    except ImportError:  # pragma: no cover
        AutoModelForImageTextToText = None
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if auto is not None and type(config) in auto._model_mapping:
            return auto
    return AutoModelForCausalLM


def _calibration_ids(calibration, folder: Path | None = None, vocab_size: int | None = None) -> torch.Tensor | None:
    """Calibration token ids as a tensor: a tensor as it is, a list (or tuple) of ids, or of lists
    of ids (what a tokenizer's input_ids are), as one; a text through the model folder's tokenizer.
    Anything else (a list turned into its text) would calibrate on the wrong tokens: TypeError.
    The ids are checked (_check_ids) here, not by the calibration forward after the model loaded."""
    if calibration is None:
        return None
    if isinstance(calibration, torch.Tensor):
        ids = calibration
    elif isinstance(calibration, (list, tuple)):
        try:
            ids = torch.tensor(calibration)
        except (TypeError, ValueError) as e:
            raise TypeError(f"calibration: a list must hold token ids (ints, or equal-length lists of ints): {e}") from None
        if ids.dtype not in (torch.int64, torch.int32) or ids.dim() not in (1, 2) or not ids.numel():
            raise TypeError(f"calibration: a list must hold token ids (ints, or equal-length lists of ints), got "
                            f"{ids.dtype} of shape {tuple(ids.shape)}")
    elif isinstance(calibration, str):
        ids = _tokenize(calibration, folder)
    else:
        raise TypeError(f"calibration must be token ids (a tensor or a list of ints) or a text, got "
                        f"{type(calibration).__name__}")
    _check_ids(ids, vocab_size)
    return ids


def _tokenize(text: str, folder: Path | None) -> torch.Tensor:
    if folder is None:
        raise TypeError("calibration: pass token ids (a tensor or a list of ints); a text needs the model "
                        "folder's tokenizer, which patch_model does not have (from_pretrained does)")
    from transformers import AutoTokenizer

    try:
        return _encode(AutoTokenizer.from_pretrained(folder), text, folder)
    except EmptyTokenizerError as e:
        raise ValueError(f"calibration: {e}: pass token ids, or add the tokenizer's files to the folder") from None


class EmptyTokenizerError(ValueError):
    """A model folder's tokenizer encoded a text into no token ids: see _encode."""


def _encode(tokenizer, text: str, folder: Path) -> torch.Tensor:
    """The text's token ids, [1, T]. Where a folder lacks its tokenizer files, transformers builds
    some families' tokenizers (Qwen2's, so Qwen3-MoE's) with an empty vocabulary instead of raising,
    and that tokenizer encodes any text into no ids: EmptyTokenizerError names the folder, so that
    the error is not blamed on the text or the ids later (shared by from_pretrained's calibration
    text and moekit eval). An empty (or blank) text is left to the caller's own count check."""
    ids = tokenizer(text, return_tensors="pt").input_ids
    if not ids.numel() and text.strip():
        raise EmptyTokenizerError(f"the tokenizer of {str(folder)!r} encoded the text into no token ids (a folder "
                                  "without its tokenizer files, such as tokenizer.json, gives an empty one)")
    return ids


def _check_ids(ids: torch.Tensor, vocab_size: int | None) -> None:
    """What the calibration forward would otherwise refuse deep inside the model (an embedding
    lookup's dtype or index error, a reshape of 0 elements), named: int32/int64 ids, [T] or
    [batch, T], at least one, each in [0, vocab_size) (None: unknown, not checked)."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"calibration: token ids must be an int64 or int32 tensor, got {ids.dtype}")
    if ids.dim() not in (1, 2):
        raise ValueError(f"calibration: token ids must be [tokens] or [batch, tokens], got shape {tuple(ids.shape)}")
    if not ids.numel():
        raise ValueError(f"calibration: no token ids (shape {tuple(ids.shape)}); the activation scales are "
                         "measured on at least one token")
    if vocab_size is None:
        return
    outside = (ids < 0) | (ids >= vocab_size)
    if bool(outside.any()):
        index = tuple(torch.nonzero(outside)[0].tolist())
        raise ValueError(f"calibration: token ids must be in [0, {vocab_size}) (the config's vocab_size); "
                         f"{int(outside.sum())} are not, e.g. {int(ids[index])} at {index}")


def _vocab_size(config) -> int | None:
    """The config's vocab_size (a multimodal config's text config's), which token ids index."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    size = getattr(text, "vocab_size", None)
    return size if isinstance(size, int) else None


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _model_dtype_arg(dtype, raw: dict, argument: str = "dtype") -> torch.dtype:
    """from_pretrained's dtype: torch.bfloat16 or torch.float16, their names, or "auto" (the
    config's own when it is one of those, else bf16); anything else refused before loading."""
    if dtype == "auto":
        named = raw.get("torch_dtype") or raw.get("dtype") or (raw.get("text_config") or {}).get("torch_dtype")
        return _DTYPES.get(str(named).removeprefix("torch."), torch.bfloat16)
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    if dtype in _DTYPES.values():
        return dtype
    raise ValueError(f"{argument}={dtype!r}: moekit runs the model in torch.bfloat16 or torch.float16 (or their "
                     "names, or 'auto' for the config's own)")


def from_pretrained(path: str | Path, backend: str | None = "auto", scheme: str | QuantScheme | None = None, *,
                    dtype: torch.dtype | str | None = None, calibration=None, model_class=None,
                    fused_routing: bool = False, **kwargs) -> nn.Module:
    """Load a local transformers MoE model with its routed experts in moekit.

    FP8 checkpoints (compressed-tensors fp8 tensor/channel/block, DeepSeek-style quant_method
    "fp8" with weight_scale_inv, fbgemm_fp8) keep their experts in FP8 exactly as stored, read
    tensor by tensor from the safetensors files: no bf16 copy of the experts is ever made.
    Unquantized checkpoints keep bf16 experts (scheme=None) or are quantized on load to `scheme`
    one expert at a time; fp8-tensor-static also needs `calibration` (token ids, or a text that
    the model folder's tokenizer encodes; checked before the weights load). `backend`: a moekit
    backend name or "auto" (then MOEKIT_BACKEND, then moekit's choice); one that cannot run the
    experts, named here or by MOEKIT_BACKEND, is refused at load. `fused_routing=True`: the
    routers run through moekit.route too (routers.py), each checked against transformers' own
    first. `dtype` (None: bf16): torch.bfloat16 or torch.float16, their names, or "auto";
    transformers' older name `torch_dtype` is read as it. Other keyword arguments go to
    transformers' from_pretrained (device_map, attn_implementation, ...), but for
    experts_implementation, which moekit sets ("moekit" only); output_loading_info=True returns
    (model, loading info) as transformers does, without the expert tensors moekit read itself;
    `model_class` overrides the Auto class.
    """
    from transformers import AutoConfig

    register()
    folder = Path(path)
    raw = _raw_config(folder)
    argument = "dtype"
    torch_dtype = kwargs.pop("torch_dtype", None)  # transformers' former name, still read by it: here too
    if torch_dtype is not None:
        if dtype is not None:
            raise ValueError("dtype= and torch_dtype= both given: pass dtype= only (torch_dtype is its former name)")
        dtype, argument = torch_dtype, "torch_dtype"
    dtype = _model_dtype_arg(torch.bfloat16 if dtype is None else dtype, raw, argument)
    implementation = kwargs.pop("experts_implementation", IMPLEMENTATION)
    if implementation != IMPLEMENTATION:
        raise ValueError(f"experts_implementation={implementation!r}: moekit.hf.from_pretrained runs the experts "
                         f"through moekit ({IMPLEMENTATION!r}); for transformers' own experts load the model with "
                         "transformers' from_pretrained")
    loading_info = kwargs.pop("output_loading_info", False)
    config = AutoConfig.from_pretrained(folder)
    family = family_of_config(config)
    want = get_scheme(scheme) if scheme is not None else None
    _check_calibration_scheme(calibration, want)
    schemes = _checkpoint_schemes(folder, family, raw)  # each module's; fill_from_checkpoint reads them as given
    refused = _fp8_not_converted(schemes, want)
    if refused:
        raise UnsupportedModelError(
            f"{folder}: the checkpoint's experts {refused[0]} are {refused[1].name}; moekit loads FP8 experts as "
            f"stored and does not convert them to {want.name} (leave scheme=None)"
        )
    to_quantize = any(not s.is_fp8 for s in schemes.values())  # experts the config leaves unquantized
    if want is not None and want.static_activation and to_quantize and calibration is None:
        raise UnsupportedModelError(
            f"scheme {want.name} needs static activation scales: pass calibration= (token ids, or a text "
            "that the model's tokenizer encodes), or use fp8-tensor-dynamic"
        )
    ids = None
    if want is not None and want.static_activation and to_quantize:
        ids = _calibration_ids(calibration, folder, _vocab_size(config))  # refused before the weights load
    _check_backend_name(backend)
    quant = getattr(config, "quantization_config", None)
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        # transformers' FP8 quantizer swaps every module named "*.experts" for its own FP8Experts:
        # keep its hands off moekit's (the dense layers stay its job)
        quant = dict(quant)
        quant["modules_to_not_convert"] = list(quant.get("modules_to_not_convert") or []) + ["experts"]
        config.quantization_config = quant
    kwargs.setdefault("config", config)
    cls = model_class or _model_class(config)
    report_logger = logging.getLogger("transformers.modeling_utils")
    drop = _DropLoadReport()
    report_logger.addFilter(drop)
    try:
        with _placeholders(family):
            model, info = cls.from_pretrained(folder, dtype=dtype, experts_implementation="moekit",
                                              output_loading_info=True, **kwargs)
    finally:
        report_logger.removeFilter(drop)
    info = _without_expert_keys(info)
    _report(info, folder)
    modules = experts_modules(model)
    if not modules:
        raise UnsupportedModelError(f"{type(model).__name__}: no experts module was built for family {family.name}")
    fill_from_checkpoint(model, folder, family, want, dtype, schemes, raw)
    if want is not None and want.static_activation and any(not m.scheme.is_fp8 for m in modules.values()):
        # read as bf16 to be calibrated (also under an FP8 config whose experts are stored unquantized)
        _set_implementation(model)  # the calibration forward runs moekit's experts without a warning
        quantize_model(model, want, ids if ids is not None else _calibration_ids(calibration, folder,
                                                                                  _vocab_size(config)))
    set_backend(model, backend)
    _check_backend(modules, backend, _model_dtype(model, modules))
    if fused_routing:
        fuse_routers(model)
    _refuse_transformers_save(model)
    return (model, info) if loading_info else model


_EXPERT_KEY = re.compile(r"\.experts\.(\d+\.[^.]+\.[a-z_]+|" + "|".join(ckpt_mod.FUSED_NAMES) + ")$")


def _without_expert_keys(info: dict) -> dict:
    """transformers' loading info without the expert tensors it lists as unexpected, which moekit
    reads itself."""
    unexpected = info.get("unexpected_keys", ())
    return {**info, "unexpected_keys": type(unexpected)(k for k in unexpected if not _EXPERT_KEY.search(k))}


def _report(info: dict, folder) -> None:
    """What transformers did not load (the expert tensors moekit reads itself left out)."""
    unexpected = sorted(info.get("unexpected_keys", ()))
    missing = sorted(info.get("missing_keys", ()))
    mismatched = info.get("mismatched_keys", ())
    for what, keys in (("unexpected (not used)", unexpected), ("missing (newly initialized)", missing),
                       ("of mismatched shape", mismatched)):
        if keys:
            shown = ", ".join(map(str, list(keys)[:5])) + (", ..." if len(keys) > 5 else "")
            log.warning("%s: %d checkpoint tensors %s: %s", folder, len(keys), what, shown)


def __getattr__(name: str):
    """`moekit.hf.load.MoekitLlama4TextMoe`, made on demand: pickle finds it here by name."""
    if name == "MoekitLlama4TextMoe":
        from .families import family_of

        return llama4_block_class(family_of("llama4"))
    from .families import FAMILIES

    for family in FAMILIES:
        if family.block_class is None and name == f"Moekit{family.experts_class}":
            return placeholder_class(family)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
