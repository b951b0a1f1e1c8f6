"""Tiny random models of every MoE family moekit.hf runs (no test here: imported by the
test_hf_* modules). Each model: hidden 64, 8 experts, expert intermediate 128 (a multiple of
128, so fp8-block128 applies), 2 layers, vocab 256; seconds to build on a CPU.

Weights are drawn with a larger initializer_range than the families' default (0.02) so that
the next-token distributions are far from uniform: with the defaults, logits are ~1e-2 apart
and top-1 agreement between two runs would measure noise, not the experts.
"""

from __future__ import annotations

import torch

VOCAB = 256
HIDDEN = 64
INTER = 128
EXPERTS = 8
INIT = 0.15

FAMILY_NAMES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "llama4")


def tiny_config(family: str):
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=INIT,
                  tie_word_embeddings=False)
    if family == "mixtral":
        return T.MixtralConfig(intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=2, **common)
    if family == "qwen2_moe":
        return T.Qwen2MoeConfig(intermediate_size=INTER, moe_intermediate_size=INTER, shared_expert_intermediate_size=64,
                                num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=False, **common)
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(intermediate_size=INTER, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, **common)
    if family == "olmoe":
        return T.OlmoeConfig(intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=2, **common)
    if family == "deepseek_v3":
        return T.DeepseekV3Config(intermediate_size=INTER, moe_intermediate_size=INTER, n_routed_experts=EXPERTS,
                                  n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                  first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=16, routed_scaling_factor=1.5, **common)
    if family == "glm4_moe":
        return T.Glm4MoeConfig(intermediate_size=INTER, moe_intermediate_size=INTER, n_routed_experts=EXPERTS,
                               n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                               first_k_dense_replace=1, head_dim=16, **common)
    if family == "llama4":
        return T.Llama4TextConfig(intermediate_size=INTER, intermediate_size_mlp=INTER, num_local_experts=EXPERTS,
                                  num_experts_per_tok=1, head_dim=16, interleave_moe_layer_step=1, **common)
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0):
    """A random bf16 model of `family` (transformers' own classes and initialisation)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.bfloat16)
    if family in ("deepseek_v3", "glm4_moe"):  # a non-zero correction bias exercises the grouped choice
        g = torch.Generator().manual_seed(seed + 7)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(torch.randn(m.e_score_correction_bias.shape, generator=g) * 0.05)
    return model.eval()


def tiny_tokenizer(text: str):
    """A byte-level BPE tokenizer of VOCAB tokens trained on `text` (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def fp8_checkpoint(tmp_path_factory, family: str, scheme: str = "fp8-channel-token"):
    """(FP8 checkpoint folder, bf16 checkpoint folder): a tiny `family` model saved in bf16, then
    quantized on load by moekit and saved back in compressed-tensors format."""
    import moekit.hf as mh

    src = tmp_path_factory.mktemp("bf16")
    tiny_model(family).save_pretrained(src)
    out = tmp_path_factory.mktemp("fp8")
    mh.save_pretrained(mh.from_pretrained(src, scheme=scheme, backend="reference"), out)
    return out, src
