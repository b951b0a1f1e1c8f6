"""moekit.models: presets, config.json parsing, quantization_config parsing, get_model."""

from __future__ import annotations

import copy
import json

import pytest

from moekit.models import PRESETS, ModelSpec, get_model, parse_config, parse_quantization_config
from moekit.routing import RoutingConfig
from moekit.spec import (
    BF16,
    FP8_BLOCK128,
    FP8_CHANNEL_TOKEN,
    FP8_TENSOR_DYNAMIC,
    FP8_TENSOR_STATIC,
    MoEShape,
)

# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------

# name: (experts, hidden, moe intermediate, top-k, shared, MoE layers, scheme, model_type)
EXPECTED = {
    "glm-4.5v-fp8": (128, 4096, 1408, 8, 1, 45, FP8_CHANNEL_TOKEN, "glm4v_moe"),
    "glm-4.5-air-fp8": (128, 4096, 1408, 8, 1, 45, FP8_CHANNEL_TOKEN, "glm4_moe"),
    "glm-4.5-fp8": (160, 5120, 1536, 8, 1, 89, FP8_CHANNEL_TOKEN, "glm4_moe"),
    "llama-4-maverick-fp8": (128, 5120, 8192, 1, 1, 24, FP8_CHANNEL_TOKEN, "llama4"),
    "llama-4-scout": (16, 5120, 8192, 1, 1, 48, BF16, "llama4"),
    "deepseek-v3": (256, 7168, 2048, 8, 1, 58, FP8_BLOCK128, "deepseek_v3"),
    "kimi-k2": (384, 7168, 2048, 8, 1, 60, FP8_BLOCK128, "kimi_k2"),
    "qwen3-30b-a3b-fp8": (128, 2048, 768, 8, 0, 48, FP8_BLOCK128, "qwen3_moe"),
    "qwen3-235b-a22b-fp8": (128, 4096, 1536, 8, 0, 94, FP8_BLOCK128, "qwen3_moe"),
    "mixtral-8x7b": (8, 4096, 14336, 2, 0, 32, BF16, "mixtral"),
    "olmoe-1b-7b": (64, 2048, 1024, 8, 0, 16, BF16, "olmoe"),
}


def test_preset_names_are_exactly_the_required_ones():
    assert set(PRESETS) == set(EXPECTED)
    for name, spec in PRESETS.items():
        assert isinstance(spec, ModelSpec)
        assert spec.name == name
        assert spec.hf_id and "/" in spec.hf_id


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_shape_scheme_and_type(name):
    experts, hidden, inter, top_k, shared, layers, scheme, model_type = EXPECTED[name]
    spec = PRESETS[name]
    assert spec.shape == MoEShape(
        num_experts=experts,
        hidden=hidden,
        intermediate=inter,
        top_k=top_k,
        tp=1,
        num_layers=layers,
        shared_experts=shared,
    )
    assert spec.scheme == scheme
    assert spec.model_type == model_type
    assert spec.routing.top_k == top_k


def test_preset_routing_rules():
    softmax_renorm = ("mixtral-8x7b", "qwen3-30b-a3b-fp8", "qwen3-235b-a22b-fp8")
    for name in softmax_renorm:
        r = PRESETS[name].routing
        assert (r.scoring, r.renormalize, r.num_groups, r.use_correction_bias) == (
            "softmax", True, None, False
        )
    olmoe = PRESETS["olmoe-1b-7b"].routing
    assert (olmoe.scoring, olmoe.renormalize) == ("softmax", False)

    assert PRESETS["deepseek-v3"].routing == RoutingConfig(
        top_k=8, scoring="sigmoid", renormalize=True, num_groups=8, topk_groups=4,
        use_correction_bias=True, routed_scaling_factor=2.5,
    )
    assert PRESETS["kimi-k2"].routing == RoutingConfig(
        top_k=8, scoring="sigmoid", renormalize=True, num_groups=1, topk_groups=1,
        use_correction_bias=True, routed_scaling_factor=2.827,
    )
    for name, scale in (("glm-4.5-fp8", 2.5), ("glm-4.5-air-fp8", 1.0), ("glm-4.5v-fp8", 1.0)):
        assert PRESETS[name].routing == RoutingConfig(
            top_k=8, scoring="sigmoid", renormalize=True, num_groups=1, topk_groups=1,
            use_correction_bias=True, routed_scaling_factor=scale,
        ), name
    for name in ("llama-4-maverick-fp8", "llama-4-scout"):
        assert PRESETS[name].routing == RoutingConfig(
            top_k=1, scoring="sigmoid", renormalize=False, apply_on_input=True
        )


def test_model_spec_is_frozen():
    with pytest.raises(Exception):
        PRESETS["deepseek-v3"].name = "x"


# --------------------------------------------------------------------------------------------
# get_model
# --------------------------------------------------------------------------------------------


def test_get_model_preset_case_insensitive_with_tp():
    spec = get_model("DeepSeek-V3", tp=8)
    assert spec.shape.tp == 8 and spec.shape.n == 256
    assert spec.shape == PRESETS["deepseek-v3"].shape.with_tp(8)
    assert spec.scheme == FP8_BLOCK128 and spec.routing == PRESETS["deepseek-v3"].routing
    assert get_model("MIXTRAL-8x7B") == PRESETS["mixtral-8x7b"]
    assert PRESETS["deepseek-v3"].shape.tp == 1  # the preset itself is unchanged


def test_get_model_tp_not_dividing_intermediate_raises():
    with pytest.raises(ValueError, match="not divisible by tp"):
        get_model("glm-4.5-air-fp8", tp=3)  # 1408 % 3 != 0


def test_get_model_unknown_name_lists_presets():
    with pytest.raises(ValueError, match=r"unknown model 'gpt-5'.*presets: .*deepseek-v3.*olmoe"):
        get_model("gpt-5")


def test_get_model_path(tmp_path):
    folder = tmp_path / "Mixtral-8x7B-v0.1"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MIXTRAL))
    spec = get_model(str(folder), tp=2)
    assert spec.shape == PRESETS["mixtral-8x7b"].shape.with_tp(2)
    assert spec.name == "mixtral-8x7b-v0.1"


# --------------------------------------------------------------------------------------------
# Sample configs: the relevant fields of published config.json files
# --------------------------------------------------------------------------------------------

# zai-org/GLM-4.5V-FP8 (glm4v_moe: the language model lives under text_config)
GLM45V_FP8 = {
    "architectures": ["Glm4vMoeForConditionalGeneration"],
    "model_type": "glm4v_moe",
    "image_token_id": 151363,
    "text_config": {
        "model_type": "glm4v_moe_text",
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 46,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "vocab_size": 151552,
    },
    "vision_config": {"model_type": "glm4v_moe", "hidden_size": 1536, "depth": 24},
    "quantization_config": {
        "config_groups": {
            "group_0": {
                "input_activations": {
                    "actorder": None, "block_structure": None, "dynamic": True,
                    "group_size": None, "num_bits": 8, "observer": None, "observer_kwargs": {},
                    "strategy": "token", "symmetric": True, "type": "float",
                },
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None, "block_structure": None, "dynamic": False,
                    "group_size": None, "num_bits": 8, "observer": "minmax",
                    "observer_kwargs": {}, "strategy": "channel", "symmetric": True,
                    "type": "float",
                },
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": [
            "model.visual.blocks.0.attn.qkv",
            "model.language_model.layers.0.mlp.gate",
            "lm_head",
        ],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    },
}

# zai-org/GLM-4.5-Air-FP8 (same compressed-tensors block as above)
GLM45_AIR_FP8 = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 46,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "quantization_config": copy.deepcopy(GLM45V_FP8["quantization_config"]),
}

# deepseek-ai/DeepSeek-V3
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}

# moonshotai/Kimi-K2-Instruct: DeepseekV3ForCausalLM architecture, model_type "kimi_k2"
KIMI_K2 = {
    **copy.deepcopy(DEEPSEEK_V3),
    "model_type": "kimi_k2",
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 384,
    "routed_scaling_factor": 2.827,
    "num_attention_heads": 64,
}

# Qwen/Qwen3-30B-A3B-FP8
QWEN3_30B_FP8 = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}

# mistralai/Mixtral-8x7B-v0.1 (bf16, no quantization_config)
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_local_experts": 8,
    "torch_dtype": "bfloat16",
}

# allenai/OLMoE-1B-7B-0924 (intermediate_size is the expert's size)
OLMOE = {
    "architectures": ["OlmoeForCausalLM"],
    "model_type": "olmoe",
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "norm_topk_prob": False,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 16,
}

# meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8: text_config; MoE every other layer
LLAMA4_MAVERICK_FP8 = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "model_type": "llama4",
    "text_config": {
        "model_type": "llama4_text",
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "interleave_moe_layer_step": 2,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 48,
        "num_local_experts": 128,
    },
    "quantization_config": copy.deepcopy(GLM45V_FP8["quantization_config"]),
}

# meta-llama/Llama-4-Scout-17B-16E-Instruct as newer transformers write it (explicit moe_layers)
LLAMA4_SCOUT = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "model_type": "llama4",
    "text_config": {
        "model_type": "llama4_text",
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "interleave_moe_layer_step": 1,
        "moe_layers": list(range(48)),
        "num_experts_per_tok": 1,
        "num_hidden_layers": 48,
        "num_local_experts": 16,
    },
}

# fbgemm_fp8, as meta-llama's FP8 releases write it (Llama-3.1-405B-Instruct-FP8's block)
FBGEMM_QUANT = {
    "activation_scale_ub": 1200.0,
    "modules_to_not_convert": ["lm_head"],
    "quant_method": "fbgemm_fp8",
}


def _write_file(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def _write_folder(tmp_path, folder_name, config):
    folder = tmp_path / folder_name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _same_as_preset(spec, preset_name):
    preset = PRESETS[preset_name]
    assert spec.shape == preset.shape
    assert spec.scheme == preset.scheme
    assert spec.routing == preset.routing
    assert spec.model_type == preset.model_type


SAMPLES = [
    ("GLM-4.5V-FP8", GLM45V_FP8, "glm-4.5v-fp8"),
    ("GLM-4.5-Air-FP8", GLM45_AIR_FP8, "glm-4.5-air-fp8"),
    ("DeepSeek-V3", DEEPSEEK_V3, "deepseek-v3"),
    ("Kimi-K2-Instruct", KIMI_K2, "kimi-k2"),
    ("Qwen3-30B-A3B-FP8", QWEN3_30B_FP8, "qwen3-30b-a3b-fp8"),
    ("Mixtral-8x7B-v0.1", MIXTRAL, "mixtral-8x7b"),
    ("OLMoE-1B-7B-0924", OLMOE, "olmoe-1b-7b"),
    ("Llama-4-Maverick-17B-128E-Instruct-FP8", LLAMA4_MAVERICK_FP8, "llama-4-maverick-fp8"),
    ("Llama-4-Scout-17B-16E-Instruct", LLAMA4_SCOUT, "llama-4-scout"),
]


@pytest.mark.parametrize("folder_name, config, preset", SAMPLES, ids=[s[2] for s in SAMPLES])
def test_sample_config_via_folder_matches_preset(tmp_path, folder_name, config, preset):
    spec = parse_config(_write_folder(tmp_path, folder_name, config))
    _same_as_preset(spec, preset)
    assert spec.name == folder_name.lower()
    assert spec.hf_id is None


@pytest.mark.parametrize("folder_name, config, preset", SAMPLES, ids=[s[2] for s in SAMPLES])
def test_sample_config_via_file_and_dict(tmp_path, folder_name, config, preset):
    path = _write_file(tmp_path, config)
    from_file = parse_config(path)
    from_str = parse_config(str(path))
    from_dict = parse_config(config)
    _same_as_preset(from_file, preset)
    assert from_file == from_str
    assert from_dict.shape == from_file.shape and from_dict.scheme == from_file.scheme
    assert from_dict.name == config["model_type"]  # no _name_or_path, no folder


@pytest.mark.parametrize("parent, preset", [(LLAMA4_SCOUT, "llama-4-scout"), (GLM45V_FP8, "glm-4.5v-fp8")])
def test_text_sub_config_alone_routes_like_its_family(parent, preset):
    """A text-only config (model_type "llama4_text" / "glm4v_moe_text", as Llama4TextConfig or a
    sub-config saves it) fell to the generic rule: softmax and renormalized, silently wrong."""
    text = copy.deepcopy(parent["text_config"])
    spec = parse_config(text)
    assert spec.routing == PRESETS[preset].routing
    assert spec.shape == PRESETS[preset].shape
    assert spec.model_type == text["model_type"]
    # the same language model under a multimodal wrapper moekit does not know by name
    wrapped = parse_config({"model_type": "some_vlm", "text_config": text})
    assert wrapped.routing == PRESETS[preset].routing and wrapped.shape == PRESETS[preset].shape


def test_glm45v_fp8_details(tmp_path):
    spec = parse_config(_write_folder(tmp_path, "GLM-4.5V-FP8", GLM45V_FP8), tp=4)
    assert spec.model_type == "glm4v_moe"
    assert spec.scheme == FP8_CHANNEL_TOKEN
    assert spec.shape.tp == 4 and spec.shape.n == 352
    assert spec.shape.num_layers == 45 and spec.shape.shared_experts == 1
    assert spec.routing.use_correction_bias and spec.routing.scoring == "sigmoid"
    assert spec.routing.routed_scaling_factor == 1.0


def test_deepseek_v3_details(tmp_path):
    spec = parse_config(_write_file(tmp_path, DEEPSEEK_V3), tp=8)
    assert spec.scheme == FP8_BLOCK128 and spec.scheme.block == 128
    assert spec.shape.num_layers == 58 and spec.shape.n == 256
    assert (spec.routing.num_groups, spec.routing.topk_groups) == (8, 4)
    assert spec.routing.routed_scaling_factor == 2.5


def test_qwen3_mlp_only_layers_and_sparse_step():
    cfg = {**QWEN3_30B_FP8, "mlp_only_layers": [0, 47]}
    assert parse_config(cfg).shape.num_layers == 46
    cfg = {**QWEN3_30B_FP8, "decoder_sparse_step": 2}
    assert parse_config(cfg).shape.num_layers == 24


def test_qwen2_moe_shared_expert():
    # Qwen/Qwen1.5-MoE-A2.7B
    cfg = {
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": False,
    }
    spec = parse_config(cfg)
    assert spec.shape == MoEShape(60, 2048, 1408, 4, num_layers=24, shared_experts=1)
    assert spec.routing == RoutingConfig(top_k=4, scoring="softmax", renormalize=False)


def test_llama4_maverick_without_moe_layers_uses_interleave_step(tmp_path):
    spec = parse_config(_write_folder(tmp_path, "maverick", LLAMA4_MAVERICK_FP8), tp=8)
    assert spec.shape.num_layers == 24 and spec.shape.n == 1024
    assert spec.shape.intermediate == 8192  # the expert's, not intermediate_size_mlp
    assert spec.routing.apply_on_input and not spec.routing.renormalize


def test_fbgemm_fp8_is_channel_token(tmp_path):
    cfg = {**copy.deepcopy(LLAMA4_MAVERICK_FP8), "quantization_config": FBGEMM_QUANT}
    spec = parse_config(_write_file(tmp_path, cfg))
    assert spec.scheme == FP8_CHANNEL_TOKEN
    assert spec.shape == PRESETS["llama-4-maverick-fp8"].shape


def test_fp8_per_tensor_static_and_dynamic():
    # neuralmagic/Mixtral-8x7B-Instruct-v0.1-FP8 (AutoFP8: per-tensor weights, static activations)
    static = {"activation_scheme": "static", "quant_method": "fp8"}
    assert parse_config({**MIXTRAL, "quantization_config": static}).scheme == FP8_TENSOR_STATIC
    dynamic = {"activation_scheme": "dynamic", "quant_method": "fp8"}
    assert parse_config({**MIXTRAL, "quantization_config": dynamic}).scheme == FP8_TENSOR_DYNAMIC


def _ct(weights, acts):
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}
        },
    }


def _w(strategy, **kw):
    return {"type": "float", "num_bits": 8, "strategy": strategy, "dynamic": False, **kw}


def _a(strategy, dynamic, **kw):
    return {"type": "float", "num_bits": 8, "strategy": strategy, "dynamic": dynamic, **kw}


def test_compressed_tensors_block_and_tensor_schemes():
    # RedHatAI FP8_BLOCK checkpoints
    block = _ct(_w("block", block_structure=[128, 128]), _a("group", True, group_size=128))
    assert parse_config({**MIXTRAL, "quantization_config": block}).scheme == FP8_BLOCK128
    # llm-compressor FP8 (static per-tensor)
    static = _ct(_w("tensor"), _a("tensor", False))
    assert parse_config({**MIXTRAL, "quantization_config": static}).scheme == FP8_TENSOR_STATIC
    dynamic = _ct(_w("tensor"), _a("tensor", True))
    assert parse_config({**MIXTRAL, "quantization_config": dynamic}).scheme == FP8_TENSOR_DYNAMIC


def test_name_from_name_or_path():
    spec = parse_config({**DEEPSEEK_V3, "_name_or_path": "deepseek-ai/DeepSeek-V3"})
    assert spec.name == "deepseek-v3" and spec.hf_id == "deepseek-ai/DeepSeek-V3"
    spec = parse_config({**MIXTRAL, "_name_or_path": "mistralai/Mixtral-8x7B-Instruct-v0.1"})
    assert spec.name == "mixtral-8x7b-instruct-v0.1"
    assert spec.hf_id == "mistralai/Mixtral-8x7B-Instruct-v0.1"
    spec = parse_config({**MIXTRAL, "_name_or_path": "/data/ckpt/My-Mixtral/"})
    assert spec.name == "my-mixtral" and spec.hf_id is None


def test_generic_fallback_family():
    # an unknown family using the common keys
    cfg = {
        "model_type": "some_new_moe",
        "hidden_size": 1024,
        "moe_intermediate_size": 512,
        "intermediate_size": 4096,
        "n_routed_experts": 32,
        "num_experts_per_tok": 4,
        "n_shared_experts": 2,
        "num_hidden_layers": 10,
        "first_k_dense_replace": 2,
    }
    spec = parse_config(cfg, tp=2)
    assert spec.shape == MoEShape(32, 1024, 512, 4, tp=2, num_layers=8, shared_experts=2)
    assert spec.routing == RoutingConfig(top_k=4)
    assert spec.scheme == BF16


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def _with_quant(quant):
    return {**MIXTRAL, "quantization_config": quant}


@pytest.mark.parametrize(
    "quant, match",
    [
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
            r"quantization_config\.quant_method: 'awq' is not supported"
            r".*compressed-tensors, fp8, fbgemm_fp8",
        ),
        (
            {"bits": 4},
            r"quantization_config\.quant_method: None",
        ),
        (
            {"activation_scheme": "dynamic", "quant_method": "fp8", "weight_block_size": [64, 64]},
            r"quantization_config\.weight_block_size: \[64, 64\].*\[128, 128\]",
        ),
        (
            {"activation_scheme": "static", "quant_method": "fp8", "weight_block_size": [128, 128]},
            r"quantization_config\.activation_scheme: 'static'",
        ),
        (
            {"quant_method": "fp8", "fmt": "e5m2", "activation_scheme": "dynamic"},
            r"quantization_config\.fmt: 'e5m2'",
        ),
        (
            _ct({**_w("group", group_size=128), "type": "int", "num_bits": 4}, None),
            r"quantization_config\.config_groups\.group_0\.weights\.type: 'int'",
        ),
        (
            _ct({**_w("channel"), "num_bits": 4}, _a("token", True)),
            r"quantization_config\.config_groups\.group_0\.weights\.num_bits: 4.*num_bits 8",
        ),
        (
            _ct(_w("group", group_size=128), _a("token", True)),
            r"quantization_config\.config_groups\.group_0\.weights\.strategy: 'group'"
            r".*tensor, channel, block",
        ),
        (
            _ct(_w("block", block_structure=[64, 64]), _a("group", True, group_size=64)),
            r"quantization_config\.config_groups\.group_0\.weights\.block_structure: \[64, 64\]",
        ),
        (
            _ct(_w("block", block_structure=[128, 128]), _a("group", True, group_size=64)),
            r"quantization_config\.config_groups\.group_0\.input_activations\.group_size: 64",
        ),
        (
            _ct(_w("channel"), _a("tensor", True)),
            r"quantization_config\.config_groups\.group_0\.input_activations\.strategy: "
            r"'tensor'.*'token'",
        ),
        (
            _ct(_w("tensor"), _a("token", True)),
            r"quantization_config\.config_groups\.group_0\.input_activations\.strategy: 'token'",
        ),
        (
            _ct(_w("channel"), _a("token", False)),
            r"quantization_config\.config_groups\.group_0\.input_activations\.dynamic: False",
        ),
        (
            _ct(_w("channel"), None),
            r"quantization_config\.config_groups\.group_0\.input_activations: None.*weight-only",
        ),
        (
            _ct({**_w("channel"), "symmetric": False}, _a("token", True)),
            r"quantization_config\.config_groups\.group_0\.weights\.symmetric: False.*no zero points",
        ),
        (
            {**_ct(_w("channel"), _a("token", True)), "format": "dense"},
            r"quantization_config\.format: 'dense'.*float-quantized",
        ),
        (
            {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "scale_fmt": "e8m0x"},
            r"quantization_config\.scale_fmt: 'e8m0x'",
        ),
    ],
)
def test_unsupported_quantization_raises(quant, match):
    with pytest.raises(ValueError, match=match):
        parse_config(_with_quant(quant))


def test_compressed_tensors_mixed_groups_raise():
    quant = _ct(_w("channel"), _a("token", True))
    quant["config_groups"]["group_1"] = {
        "targets": ["re:.*experts.*"],
        "weights": _w("block", block_structure=[128, 128]),
        "input_activations": _a("group", True, group_size=128),
    }
    with pytest.raises(ValueError, match=r"config_groups: the groups that target the experts use different schemes"):
        parse_config(_with_quant(quant))


def test_dense_config_raises_naming_keys_looked_for():
    # meta-llama/Llama-3.1-8B: a dense model
    dense = {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
    }
    with pytest.raises(
        ValueError,
        match=r"no usable MoE fields.*num_local_experts/num_experts/n_routed_experts"
        r".*num_experts_per_tok",
    ):
        parse_config(dense)


def test_qwen3_dense_num_experts_zero_raises():
    with pytest.raises(ValueError, match="no usable MoE fields"):
        parse_config({**QWEN3_30B_FP8, "num_experts": 0})


def test_vision_config_without_text_moe_fields_raises():
    cfg = copy.deepcopy(GLM45V_FP8)
    del cfg["text_config"]["n_routed_experts"]
    with pytest.raises(ValueError, match=r"at its text_config: looked for num_local_experts"):
        parse_config(cfg)


def test_deepseek_v2_group_limited_greedy_raises():
    # deepseek-ai/DeepSeek-V2: groups scored by their best expert, not moekit's best-two sum
    cfg = {
        **DEEPSEEK_V3,
        "model_type": "deepseek_v2",
        "topk_method": "group_limited_greedy",
        "scoring_func": "softmax",
        "n_group": 8,
        "topk_group": 3,
        "quantization_config": None,
    }
    with pytest.raises(ValueError, match=r"topk_method: 'group_limited_greedy'"):
        parse_config(cfg)


def test_missing_layer_count_raises():
    cfg = {k: v for k, v in MIXTRAL.items() if k != "num_hidden_layers"}
    with pytest.raises(ValueError, match="looked for num_hidden_layers"):
        parse_config(cfg)


def test_bad_paths_raise(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        parse_config(tmp_path)
    with pytest.raises(ValueError, match="no such config file or model folder"):
        parse_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_config(bad)


def test_parse_config_tp_not_dividing_raises():
    with pytest.raises(ValueError, match="not divisible by tp"):
        parse_config(MIXTRAL, tp=3)


GENERIC = {
    "model_type": "some_new_moe", "hidden_size": 1024, "moe_intermediate_size": 512, "n_routed_experts": 32,
    "num_experts_per_tok": 4, "num_hidden_layers": 10,
}


def test_generic_unknown_scoring_func_raises():
    """An unknown family's scoring function was computed as softmax, silently (the DeepSeek
    branch already refused); "sigmoid" and an absent key still parse."""
    with pytest.raises(ValueError, match=r"scoring_func: 'sqrtsoftplus' is not supported; moekit supports "
                                         r"scoring_func 'softmax' or 'sigmoid'"):
        parse_config({**GENERIC, "scoring_func": "sqrtsoftplus"})
    assert parse_config({**GENERIC, "scoring_func": "sigmoid"}).routing.scoring == "sigmoid"
    assert parse_config(GENERIC).routing.scoring == "softmax"


@pytest.mark.parametrize("base", [GENERIC, QWEN3_30B_FP8, DEEPSEEK_V3], ids=["generic", "qwen3", "deepseek"])
@pytest.mark.parametrize("value", ["true", "false", 1, 0])
def test_non_boolean_norm_topk_prob_raises(base, value):
    """norm_topk_prob "false" (a string) read as the family's default (True for some): refused."""
    with pytest.raises(ValueError, match=rf"norm_topk_prob: {value!r} is not supported; moekit supports "
                                         r"norm_topk_prob true or false"):
        parse_config({**base, "norm_topk_prob": value})


def test_null_norm_topk_prob_is_the_family_default():
    assert parse_config({**QWEN3_30B_FP8, "norm_topk_prob": None}).routing.renormalize is False
    assert parse_config({**GENERIC, "norm_topk_prob": False}).routing.renormalize is False


# ------------------------------------------------ which quantization reaches the routed experts


def test_quantization_that_leaves_the_experts_unquantized_is_bf16():
    """The FP8 scheme was reported whatever the config said of the experts: `ignore` naming them
    (a real Llama-4-Maverick checkpoint lists every routed expert), groups targeting attention
    only, an FP8 KV cache alone (config_groups {} was refused), or fp8 / fbgemm_fp8 skip lists.
    moekit runs the experts only: those are bf16 then."""
    channel = _ct(_w("channel"), _a("token", True))
    attention_only = {**channel, "config_groups": {"group_0": {**channel["config_groups"]["group_0"],
                                                                 "targets": ["re:.*self_attn.*"]}}}
    cases = {
        "ignore regex": {**channel, "ignore": ["lm_head", "re:.*mlp.experts.*"]},
        "attention only": attention_only,
        "kv cache only": {"quant_method": "compressed-tensors", "config_groups": {},
                          "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
        "fp8 skip list": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                          "modules_to_not_convert": ["experts"]},
        "fbgemm skip list": {"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["feed_forward.experts"]},
    }
    for name, quant in cases.items():
        assert parse_config(_with_quant(quant)).scheme == BF16, name
    # ignore naming other layers, a regex target of the experts: the experts' scheme
    assert parse_config(_with_quant({**channel, "ignore": ["lm_head", "re:.*mlp.gate$"]})).scheme == FP8_CHANNEL_TOKEN
    experts_target = {**channel, "config_groups": {"group_0": {**channel["config_groups"]["group_0"],
                                                                 "targets": ["re:.*experts.*"]}}}
    assert parse_config(_with_quant(experts_target)).scheme == FP8_CHANNEL_TOKEN


def test_ignore_entries_naming_single_experts_modules_name_only_those():
    """compressed-tensors matches an ignore entry that is not "re:" to one module's name exactly.
    An entry naming one expert projection made every expert of the model bf16 (moekit.hf then
    refused the other layers' FP8 experts): it names that module only, and the model's experts
    keep the group's scheme; asked about one experts module (`experts=`), the names decide."""
    channel = _ct(_w("channel"), _a("token", True))
    layer0 = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    layer1 = [name.replace("layers.0", "layers.1") for name in layer0]
    by_name = {**channel, "ignore": ["lm_head", *layer0]}
    by_regex = {**channel, "ignore": ["lm_head", r"re:model[.]layers[.]0[.]mlp[.]experts[.].*"]}
    for quant in (by_name, by_regex):
        assert parse_config(_with_quant(quant)).scheme == FP8_CHANNEL_TOKEN
        assert parse_quantization_config(quant, experts=layer0) == BF16
        assert parse_quantization_config(quant, experts=layer1) == FP8_CHANNEL_TOKEN
    # a regex of one layer's experts is that layer's too (it was every layer's where it matched the sample)
    layer1_regex = {**channel, "ignore": [r"re:model[.]layers[.]1[.]mlp[.]experts[.].*"]}
    assert parse_config(_with_quant(layer1_regex)).scheme == FP8_CHANNEL_TOKEN
    assert parse_quantization_config(layer1_regex, experts=layer1) == BF16
    with pytest.raises(ValueError, match=r"ignore names model\.layers\.0\.mlp\.experts\.0\.gate_proj but not "
                                         r"model\.layers\.0\.mlp\.experts\.0\.up_proj"):
        parse_quantization_config({**channel, "ignore": layer0[:1]}, experts=layer0)


def test_only_the_groups_of_the_experts_must_agree():
    """A group of the experts beside a group of another scheme for attention was refused ('moekit
    runs one scheme per model'): only the experts' group matters."""
    channel = _ct(_w("channel"), _a("token", True))["config_groups"]["group_0"]
    static = _ct(_w("tensor"), _a("tensor", False))["config_groups"]["group_0"]
    quant = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "experts": {**channel, "targets": ["re:.*experts.*"]},
        "attention": {**static, "targets": ["re:.*self_attn.*"]},
    }}
    assert parse_config(_with_quant(quant)).scheme == FP8_CHANNEL_TOKEN
    both = {**quant, "config_groups": {"a": {**channel, "targets": ["Linear"]}, "b": {**static, "targets": ["Linear"]}}}
    with pytest.raises(ValueError, match="the groups that target the experts use different schemes"):
        parse_config(_with_quant(both))


def test_deepseek_v31_scale_fmt_is_read_as_block_fp8():
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "scale_fmt": "ue8m0", "fmt": "e4m3"}
    assert parse_config(_with_quant(quant)).scheme == FP8_BLOCK128


def test_routing_fields_are_checked_and_defaulted_as_transformers_does():
    """GLM-4.7-Flash (glm4_moe_lite) routed as softmax (its family was unknown); noaux_tc with
    softmax was accepted; a routed_scaling_factor of "2.5", -1 or 0 became 1.0; a DeepSeek-V3
    config without its group fields lost transformers' defaults; bad layer steps were read as
    1; n_group not dividing the experts failed only at the first forward."""
    lite = {"model_type": "glm4_moe_lite", "n_routed_experts": 64, "num_experts_per_tok": 4, "hidden_size": 2048,
            "moe_intermediate_size": 1536, "num_hidden_layers": 4, "mlp_layer_types": ["dense", "sparse", "sparse",
                                                                                    "sparse"]}
    spec = parse_config(lite)
    assert spec.routing.scoring == "sigmoid" and spec.routing.use_correction_bias
    assert spec.routing.routed_scaling_factor == 1.8 and spec.shape.num_layers == 3
    v3 = {"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8, "hidden_size": 7168,
          "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3}
    r = parse_config(v3).routing
    assert (r.num_groups, r.topk_groups, r.routed_scaling_factor) == (8, 4, 2.5)
    for bad, match in (({"scoring_func": "softmax"}, "scoring_func: 'softmax'.*with topk_method 'noaux_tc'"),
                       ({"routed_scaling_factor": "2.5"}, "routed_scaling_factor: '2.5'"),
                       ({"routed_scaling_factor": 0}, "routed_scaling_factor: 0"),
                       ({"n_group": 7}, "n_group: 7 is not supported.*divisor of the number of experts"),
                       ({"topk_group": 9}, "topk_group: 9 is not supported"),
                       ({"n_group": -2}, "n_group: -2 is not supported.*n_group a positive integer"),
                       ({"moe_layer_freq": "2"}, "moe_layer_freq: '2'")):
        with pytest.raises(ValueError, match=match):
            parse_config({**v3, **bad})
    qwen = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
            "moe_intermediate_size": 32, "num_hidden_layers": 4}
    for bad, match in (({"mlp_only_layers": 3}, "mlp_only_layers: 3"),
                       ({"decoder_sparse_step": 0}, "decoder_sparse_step: 0")):
        with pytest.raises(ValueError, match=match):
            parse_config({**qwen, **bad})
