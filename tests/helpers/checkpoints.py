"""Tiny random-weight checkpoints saved by transformers' own classes: Gemma 3 (hybrid,
all-sliding or all-full layers), Llama 3 (RoPE scaling, no window), Qwen3 (q/k norm),
Mistral (a window on every layer), gpt-oss (sinks, MoE, YaRN); and a small byte-level BPE
tokenizer to put beside one."""

from __future__ import annotations

import os

import torch

TINY_WINDOW = 8

HYBRID = ["sliding_attention", "sliding_attention", "full_attention",
          "sliding_attention", "full_attention", "sliding_attention"]


def write_tiny_gemma3(path, layer_types, window=TINY_WINDOW, vocab=128, seed=0,
                      max_positions=512, num_heads=2, num_kv_heads=1):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types),
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=16,
        sliding_window=window,
        layer_types=layer_types, max_position_embeddings=max_positions, query_pre_attn_scalar=16,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random norm weights so that (1 + w) matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


# What the tiny checkpoints of the other families share
FAMILY_COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=512, bos_token_id=2,
              eos_token_id=1, pad_token_id=0, rms_norm_eps=1e-6)


def _save(model, path):
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path), model


def _randomize_norms(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model.eval()


def write_llama(path):
    """A Llama 3 checkpoint at `path`: (path, model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(**FAMILY_COMMON, num_hidden_layers=3, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})
    return _save(_randomize_norms(LlamaForCausalLM(cfg)), path)


def write_qwen3(path):
    """A Qwen3 checkpoint at `path`: (path, model)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(4)
    cfg = Qwen3Config(**FAMILY_COMMON, num_hidden_layers=3, tie_word_embeddings=True)
    return _save(_randomize_norms(Qwen3ForCausalLM(cfg)), path)


def write_mistral(path):
    """A Mistral checkpoint at `path`: (path, model)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(5)
    cfg = MistralConfig(**FAMILY_COMMON, num_hidden_layers=3, sliding_window=TINY_WINDOW, tie_word_embeddings=False)
    return _save(_randomize_norms(MistralForCausalLM(cfg)), path)


def gpt_oss_config(**kw):
    from transformers import GptOssConfig

    c = dict(FAMILY_COMMON)
    c.update(num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, sliding_window=TINY_WINDOW,
             layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=False,
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                              "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                              "original_max_position_embeddings": 64})
    c.update(kw)
    return GptOssConfig(**c)


def write_gpt_oss(path, **kw):
    """A gpt-oss checkpoint at `path` (gpt_oss_config's fields overridden by kw): (path,
    model)."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(6)
    model = GptOssForCausalLM(gpt_oss_config(**kw))
    with torch.no_grad():  # strong sinks, so that a missing sink changes the result
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 3.0, 4))
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.1)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.1)
    return _save(_randomize_norms(model), path)


def write_byte_bpe_tokenizer(path, vocab: int = 320) -> int:
    """A small byte-level BPE tokenizer.json (ids 0/1/2 = pad/eos/bos, like the tiny
    models); returns its vocabulary size. Any text encodes, as with a real tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = ['{"name": "abc", "age": 12, "tags": ["x", "y"]}',
              "hello world 123-4567 true false null", "[1, 2, 3.5]"] * 50
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", "<eos>", "<bos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(os.path.join(str(path), "tokenizer.json"))
    return tk.get_vocab_size()


# Gemma 4: full layers at 3 and 7 (the last must be full), so that with 3 shared layers
# each kind keeps a storing layer before the reusing ones (layers 4 and 3 store for 5-7)
GEMMA4_TYPES = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 \
    + ["full_attention"]


def write_tiny_gemma4(path, window=TINY_WINDOW, seed=0, **kw):
    """A tiny Gemma 4 text checkpoint at `path` (KV sharing, K=V full layers with a head of
    their own, per-layer inputs, double-wide MLPs and soft-capped logits unless `kw` says
    otherwise; `enable_moe_block` with its expert fields for the MoE variant): (path, model)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    args = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=3,
                hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                use_double_wide_mlp=True, final_logit_softcapping=30.0, sliding_window=window,
                layer_types=list(GEMMA4_TYPES), max_position_embeddings=512, bos_token_id=2,
                eos_token_id=1, pad_token_id=0)
    cfg = Gemma4TextConfig(**{**args, **kw})
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(cfg)
    with torch.no_grad():  # multipliers and scalars away from 1, so that each one matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith(("router.scale", "per_expert_scale")):
                p.uniform_(0.5, 1.5)
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    return _save(model.eval(), path)


def write_tiny_qwen3_5(path, seed=0, moe=False, **kw):
    """A tiny Qwen3.5 text checkpoint at `path`: 8 layers, three Gated DeltaNet layers to
    each gated full-attention one, value heads grouped two to a key head, partial RoPE
    (a quarter of 16 dims); with `moe` the MoE variant (4 experts, top 2, a shared expert):
    (path, model)."""
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    args = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_conv_kernel_dim=4,
                max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=2,
                eos_token_id=1, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                 "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                                 "mrope_interleaved": True})
    if moe:
        args.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    shared_expert_intermediate_size=24)
        args.pop("intermediate_size")
    config_cls, model_cls = ((Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM) if moe
                             else (Qwen3_5TextConfig, Qwen3_5ForCausalLM))
    cfg = config_cls(**{**args, **kw})
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():  # (1 + w) norms away from 1, the gated norm's w away from 1
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.3)
            elif "norm" in name:
                p.normal_(0.0, 0.3)
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
    return _save(model.eval(), path)


DSV4_TYPES = ("sliding_attention", "compressed_sparse_attention",
              "heavily_compressed_attention", "compressed_sparse_attention",
              "heavily_compressed_attention")


def write_tiny_deepseek_v4(path, window=TINY_WINDOW, seed=0, **kw):
    """A tiny DeepSeek-V4 checkpoint at `path`: a sliding layer, C4 layers (rate 4, the
    indexer keeping 3 entries, so it binds), C128-kind layers at rate 8, two hyper-connection
    streams, four experts (hash routing in the first layer), gate biases, sinks and
    position biases away from zero: (path, model)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    n = kw.pop("num_hidden_layers", len(DSV4_TYPES))
    args = dict(vocab_size=128, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=n,
                num_attention_heads=4, head_dim=16, q_lora_rank=24, partial_rotary_factor=0.5,
                num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
                sliding_window=window, o_groups=2, o_lora_rank=8, index_n_heads=8,
                index_head_dim=8, index_topk=3, hc_mult=2, hc_sinkhorn_iters=5,
                layer_types=list(DSV4_TYPES[:n]),
                compress_rates={"compressed_sparse_attention": 4,
                                "heavily_compressed_attention": 8},
                mlp_layer_types=["hash_moe"] + ["moe"] * (n - 1), max_position_embeddings=512,
                num_nextn_predict_layers=0, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    cfg = DeepseekV4Config(**{**args, **kw})
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith(("sinks", "position_bias", "base", "e_score_correction_bias")):
                p.normal_(0.0, 0.5)
        g = torch.Generator().manual_seed(seed)
        for layer in model.model.layers:
            if layer.mlp.is_hash:
                experts = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:2]
                                       for _ in range(cfg.vocab_size)])
                layer.mlp.gate.tid2eid.copy_(experts)
            else:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.5, generator=g)
    return _save(model.eval(), path)
