"""A tiny EmbeddingGemma-shaped checkpoint as sentence-transformers lays one out: the
transformer (Gemma3TextModel with bidirectional attention, saved by transformers) and a
byte-level tokenizer that adds <bos> and <eos> at the root, then 1_Pooling (mean),
2_Dense and 3_Dense (no bias, identity) and 4_Normalize, listed in modules.json."""

from __future__ import annotations

import json
import os

import torch

from tests.helpers.checkpoints import write_byte_bpe_tokenizer

WINDOW = 8  # config.json's sliding_window: bidirectional layers see 4 keys either side
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention", "full_attention"]
HIDDEN, DENSE = 32, 48


def write_embedding_gemma(path, seed: int = 0, modules: bool = True):
    """The checkpoint at `path` (sentence-transformers modules with `modules`); returns the
    transformers model (float32, eval)."""
    from safetensors.torch import save_file
    from transformers import Gemma3TextConfig, Gemma3TextModel

    path = str(path)
    os.makedirs(path, exist_ok=True)
    vocab = write_byte_bpe_tokenizer(path)
    _add_bos_eos(path)
    cfg = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64,
        num_hidden_layers=len(LAYER_TYPES), num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, sliding_window=WINDOW, layer_types=LAYER_TYPES,
        max_position_embeddings=256, query_pre_attn_scalar=16,
        use_bidirectional_attention=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    model = Gemma3TextModel(cfg).eval()
    with torch.no_grad():  # random norm weights so that (1 + w) matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    if not modules:
        return model
    listing = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Dense",
                "type": "sentence_transformers.models.Dense"},
               {"idx": 3, "name": "3", "path": "3_Dense",
                "type": "sentence_transformers.models.Dense"},
               {"idx": 4, "name": "4", "path": "4_Normalize",
                "type": "sentence_transformers.models.Normalize"}]
    _write_json(path, "modules.json", listing)
    _write_json(path, "sentence_bert_config.json", {"max_seq_length": 256,
                                                    "do_lower_case": False})
    _write_json(os.path.join(path, "1_Pooling"), "config.json", {
        "word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False, "include_prompt": True})
    for folder, (n_in, n_out) in (("2_Dense", (HIDDEN, DENSE)), ("3_Dense", (DENSE, HIDDEN))):
        _write_json(os.path.join(path, folder), "config.json", {
            "in_features": n_in, "out_features": n_out, "bias": False,
            "activation_function": "torch.nn.modules.linear.Identity"})
        w = torch.randn(n_out, n_in) / n_in ** 0.5
        save_file({"linear.weight": w}, os.path.join(path, folder, "model.safetensors"))
    os.makedirs(os.path.join(path, "4_Normalize"), exist_ok=True)
    return model


def _add_bos_eos(path: str) -> None:
    """<bos> text <eos>, as EmbeddingGemma's tokenizer encodes, for swaserve and
    transformers alike (the post-processor of tokenizer.json)."""
    from tokenizers import Tokenizer, processors

    file = os.path.join(path, "tokenizer.json")
    tk = Tokenizer.from_file(file)
    tk.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 1)])
    tk.save(file)
    _write_json(path, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
        "eos_token": "<eos>", "pad_token": "<pad>", "model_max_length": 256,
        "padding_side": "right"})


def _write_json(folder: str, name: str, obj) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w") as f:
        json.dump(obj, f, indent=1)
