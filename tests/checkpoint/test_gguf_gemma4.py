"""Gemma 4 GGUFs written as llama.cpp's converter writes them (tests/helpers/gguf_writer.py,
gguf_gemma4.py) from the tiny checkpoints of tests/models/test_gemma4.py (KV sharing, K=V
full layers with their own head size, per-layer inputs, double-wide MLPs; none of these; MoE
blocks), in several GGML types, against transformers on the same (dequantized) weights; the
config read back from the metadata, and the GGUF tokenizer against the one it was written
from."""

from __future__ import annotations

import dataclasses

import gguf
import pytest

from swaserve.checkpoint.source import resolve_model
from swaserve.models.config import ModelConfig
from swaserve.models.gemma4.config import kv_sources, layer_shapes, with_defaults
from tests.checkpoint.test_gguf_families import decode_matches_transformers
from tests.conftest import TINY_WINDOW as W
from tests.helpers.checkpoints import write_tiny_gemma4
from tests.helpers.gguf_writer import MULTILINGUAL, sentencepiece_vocab, write_gguf

Q = gguf.GGMLQuantizationType
PLAIN = dict(num_kv_shared_layers=0, attention_k_eq_v=False, hidden_size_per_layer_input=0,
             use_double_wide_mlp=False, final_logit_softcapping=None)
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
# variant: (checkpoint options, {tensor kind: type}; other matrices F16, vectors F32)
VARIANTS = {
    "shared": ({}, {"attn_q": Q.Q8_0, "attn_k": Q.Q5_0, "attn_v": Q.Q4_1,
                    "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_0, "ffn_up": Q.Q8_0,
                    "ffn_down": Q.BF16, "token_embd": Q.Q8_0, "per_layer_token_embd": Q.Q8_0,
                    "per_layer_model_proj": Q.Q5_0, "inp_gate": Q.Q8_0}),
    "plain": (PLAIN, {"attn_q": Q.Q4_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0,
                      "attn_output": Q.BF16, "ffn_gate": Q.Q8_0, "ffn_up": Q.Q5_1,
                      "ffn_down": Q.F16, "token_embd": Q.IQ4_NL}),
    "moe": (MOE, {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_output": Q.Q8_0,
                  "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0, "ffn_down": Q.BF16,
                  "ffn_gate_up_exps": Q.Q8_0, "ffn_down_exps": Q.BF16, "ffn_gate_inp": Q.F32,
                  "token_embd": Q.Q8_0, "per_layer_token_embd": Q.Q4_1}),
}


def _vocab():
    """Gemma's SentencePiece-style BPE (no prefix space) as the converter writes Gemma 4's:
    tokenizer model "gemma4", with its merges."""
    return dataclasses.replace(sentencepiece_vocab(prefix_space=False), model="gemma4")


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    """(name, GGUF path, the HF model holding the file's values, the tokenizer written)."""
    options, table = VARIANTS[request.param]
    vocab = _vocab()
    tmp = tmp_path_factory.mktemp(f"gemma4_gguf_{request.param}")
    # a per-layer table longer than the vocabulary (the converter trims only token_embd)
    ple_rows = vocab.size + (32 if request.param == "shared" else 0)
    _, model = write_tiny_gemma4(tmp / "hf", seed=3, vocab_size=vocab.size,
                                 vocab_size_per_layer_input=ple_rows, **options)
    path = tmp / "model.gguf"
    write_gguf(path, model, "gemma4", vocab, lambda name: table.get(name.split(".")[-2], Q.F16))
    return request.param, str(path), model, vocab


def test_logits_equal_transformers_past_the_window(variant):
    name, path, model, vocab = variant
    decode_matches_transformers(path, model, vocab.size, name)


def test_the_config_read_from_the_metadata_is_the_checkpoint_config(variant):
    """Every field swaserve runs a Gemma 4 by, from the GGUF's metadata and tensor table
    against the same fields from the checkpoint's config.json."""
    _, path, model, vocab = variant
    got = resolve_model(path).hf_config
    want = model.config.to_dict()
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
              "attention_k_eq_v", "num_kv_shared_layers", "intermediate_size",
              "use_double_wide_mlp", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
              "layer_types", "sliding_window", "final_logit_softcapping", "rope_parameters",
              "tie_word_embeddings", "enable_moe_block")
    for field in fields:
        assert got.get(field, False if field == "enable_moe_block" else None) == want[field], field
    theirs = with_defaults(want)
    assert layer_shapes(with_defaults(got)) == layer_shapes(theirs)
    assert kv_sources(with_defaults(got)) == kv_sources(theirs)
    if want["enable_moe_block"]:
        for field in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            assert got[field] == want[field], field
    cfg = ModelConfig.from_hf(got)
    assert cfg.eos_token_ids == (vocab.eos,) and cfg.bos_token_id == vocab.bos


def test_gguf_tokenizer_ids_equal_the_tokenizer_it_was_written_from(variant):
    from swaserve.checkpoint.tokenizer import load_tokenizer

    _, path, _, vocab = variant
    tok = load_tokenizer(resolve_model(path))
    text = f"{MULTILINGUAL} {vocab.tokenizer.id_to_token(vocab.eos)} tail ✓😀"  # 2 unseen
    want = vocab.tokenizer.encode(text, add_special_tokens=False).ids
    assert vocab.eos in want
    assert tok.encode(text, add_special_tokens=False) == want
    assert tok.decode(want, skip_special_tokens=False) == text
    # BOS first, as the file's add_bos_token says and llama.cpp encodes
    assert vocab.add_bos and tok.encode(text) == [vocab.bos, *want]


def test_a_gguf_with_the_full_layers_rope_unknown_is_refused(tmp_path):
    """rope_freqs that are not a partial rotation (1 then 1e30) are refused, not guessed."""
    from swaserve.checkpoint.gguf_config import gguf_metadata_to_hf

    meta = {"general.architecture": "gemma4", "gemma4.block_count": 2,
            "gemma4.embedding_length": 32, "gemma4.feed_forward_length": 48,
            "gemma4.attention.head_count": 4, "gemma4.attention.key_length": 16,
            "gemma4.attention.key_length_swa": 8, "gemma4.attention.sliding_window": W,
            "gemma4.attention.sliding_window_pattern": [True, False],
            "GGUF.rope_freqs": [1.0, 0.5, 1e30, 1e30, 1e30, 1e30, 1e30, 1e30]}
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_metadata_to_hf(meta)
