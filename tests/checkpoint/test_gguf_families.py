"""GGUF files of every family swaserve runs, written as llama.cpp's converter writes them
(tests/helpers/gguf_writer.py), against transformers on the same (dequantized) weights:
Llama 3 (permuted q/k, rope_freqs, K-quants), Mistral (a window on every layer,
SentencePiece), Qwen2 (q/k/v biases, tied head), Qwen3 (q/k norms), Gemma 3 (1 + w norms,
five sliding layers per full one), gpt-oss (sinks, MXFP4 experts, split or fused gate/up);
and each GGUF tokenizer against the tokenizer it was written from."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from swaserve import SamplingParams
from swaserve.checkpoint.source import ModelLoadError, resolve_model
from tests.conftest import TINY_WINDOW as W
from tests.conftest import drive, gpt_oss_config, hf_logits, random_prompt, tiny_engine
from tests.helpers.checkpoints import FAMILY_COMMON
from tests.helpers.gguf_writer import MULTILINGUAL, byte_bpe_vocab, sentencepiece_vocab, write_gguf

Q = gguf.GGMLQuantizationType
TOL = 1e-5  # relative to the largest logit
LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|start|>", "<|end|>"]


def _types(table: dict[str, object]):
    """qtype(gguf name) from {tensor kind: type}, e.g. "attn_q" for blk.N.attn_q.weight."""
    return lambda name: table[name.split(".")[-2]]


def _llama(vocab: int, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**FAMILY_COMMON, "vocab_size": vocab, "hidden_size": 256, **kw},
                      num_hidden_layers=2, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                       "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})
    return LlamaForCausalLM(cfg)


def _mistral(vocab: int):
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**{**FAMILY_COMMON, "vocab_size": vocab},
                                            num_hidden_layers=2, sliding_window=W,
                                            tie_word_embeddings=False))


def _qwen2(vocab: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**{**FAMILY_COMMON, "vocab_size": vocab,
                                           "hidden_size": 256}, num_hidden_layers=2,
                                        tie_word_embeddings=True))


def _qwen3(vocab: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**{**FAMILY_COMMON, "vocab_size": vocab,
                                           "hidden_size": 256}, num_hidden_layers=2,
                                        tie_word_embeddings=True))


def _gemma3(vocab: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=W,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=512,
        query_pre_attn_scalar=16,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # random norm weights so that (1 + w) matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model


def _gpt_oss(vocab: int):
    from transformers import GptOssForCausalLM

    model = GptOssForCausalLM(gpt_oss_config(vocab_size=vocab))
    with torch.no_grad():  # strong sinks and biases, so that each matters
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 3.0, 4))
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.1)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.1)
    return model


# family: (GGUF architecture, model, byte-level vocabulary (pre, specials, bos, eos, add bos;
# "sp" / "sp-gemma": SentencePiece, with or without a prefix space), types, writer options)
FAMILIES = {
    "llama3": ("llama", _llama, ("llama-bpe", LLAMA3, LLAMA3[0], LLAMA3[2], True), {
        "attn_q": Q.Q6_K, "attn_k": Q.Q6_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_0,
        "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q4_0, "token_embd": Q.Q8_0,
        "output": Q.Q6_K}, {}),
    "mistral": ("llama", _mistral, "sp", {
        "attn_q": Q.F16, "attn_k": Q.BF16, "attn_v": Q.Q4_1, "attn_output": Q.IQ4_NL,
        "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q8_0, "token_embd": Q.F16,
        "output": Q.Q8_0}, {"window": W}),
    "qwen2": ("qwen2", _qwen2, ("qwen2", QWEN, QWEN[0], QWEN[2], False), {
        "attn_q": Q.Q3_K, "attn_k": Q.Q5_K, "attn_v": Q.Q2_K, "attn_output": Q.Q8_0,
        "ffn_gate": Q.IQ4_XS, "ffn_up": Q.Q4_K, "ffn_down": Q.Q8_0, "token_embd": Q.Q6_K}, {}),
    "qwen3": ("qwen3", _qwen3, ("qwen2", QWEN, QWEN[0], QWEN[2], False), {
        "attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.BF16, "attn_output": Q.Q4_0,
        "ffn_gate": Q.Q4_K, "ffn_up": Q.Q6_K, "ffn_down": Q.Q5_1, "token_embd": Q.Q8_0}, {}),
    "gpt-oss": ("gpt-oss", _gpt_oss, ("gpt-4o", HARMONY, HARMONY[0], HARMONY[2], False), {
        "attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q8_0,
        "ffn_gate_inp": Q.F32, "ffn_gate_exps": Q.MXFP4, "ffn_up_exps": Q.MXFP4,
        "ffn_down_exps": Q.MXFP4, "token_embd": Q.Q8_0, "output": Q.Q8_0}, {}),
    "gemma3": ("gemma3", _gemma3, "sp-gemma", {
        "attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.Q8_0,
        "ffn_gate": Q.Q8_0, "ffn_up": Q.Q5_0, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0}, {}),
    "gpt-oss-fused": ("gpt-oss", _gpt_oss, ("gpt-4o", HARMONY, HARMONY[0], HARMONY[2], False), {
        "attn_q": Q.BF16, "attn_k": Q.BF16, "attn_v": Q.BF16, "attn_output": Q.BF16,
        "ffn_gate_inp": Q.F32, "ffn_gate_up_exps": Q.MXFP4, "ffn_down_exps": Q.Q8_0,
        "token_embd": Q.F16, "output": Q.Q8_0}, {"fuse_gate_up": True}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, GGUF path, the HF model holding the file's values, the HF tokenizer)."""
    arch, build, spec, types, options = FAMILIES[request.param]
    vocab = (sentencepiece_vocab(prefix_space=spec == "sp") if isinstance(spec, str)
             else byte_bpe_vocab(*spec))
    torch.manual_seed(7)
    model = build(vocab.size).eval()
    path = tmp_path_factory.mktemp(request.param) / "model.gguf"
    write_gguf(path, model, arch, vocab, _types(types), **options)
    return request.param, str(path), model, vocab


def decode_matches_transformers(path: str, model, vocab_size: int, name: str):
    """Two prompts past the window, prefilled in chunks of 7 and decoded together for 4
    tokens: every step's logits equal transformers' on the file's values. The engine."""
    eng = tiny_engine(path, chunk_size=7)
    eng.logits_log = []
    prompts = [random_prompt(3 * W + 5 + 9 * i, seed=i, vocab=vocab_size) for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    reqs = [eng.add_request(p, params)[0] for p in prompts]  # batched decode, mixed lengths
    drive(eng)
    for p, r in zip(prompts, reqs):
        want = hf_logits(model, p + r.output_token_ids)
        logs = [lg for rid, _, lg in eng.logits_log if rid == r.request_id]
        assert len(logs) == 4
        for i, lg in enumerate(logs):
            ref = want[len(p) - 1 + i]
            assert (lg - ref).abs().max().item() <= TOL * ref.abs().max().item(), (name, i)
    eng.check_integrity()
    return eng


def test_logits_equal_transformers_past_the_window(family):
    name, path, model, vocab = family
    eng = decode_matches_transformers(path, model, vocab.size, name)
    cfg = eng.whole_model_config
    assert cfg.eos_token_ids == (vocab.eos,) and cfg.bos_token_id == vocab.bos
    assert cfg.tie_word_embeddings == model.config.tie_word_embeddings
    if name == "mistral":
        assert eng.cache.full is None and cfg.sliding_window == W
    if name.startswith("gpt-oss"):
        assert eng.layout.sliding_layers == (0, 2) and eng.layout.full_layers == (1, 3)


def test_gguf_tokenizer_ids_equal_the_tokenizer_it_was_written_from(family):
    from swaserve.checkpoint.tokenizer import load_tokenizer

    _, path, _, vocab = family
    tok = load_tokenizer(resolve_model(path))
    text = f"{MULTILINGUAL} {vocab.tokenizer.id_to_token(vocab.eos)} tail ✓😀"  # 2 unseen
    want = vocab.tokenizer.encode(text, add_special_tokens=False).ids
    assert vocab.eos in want
    assert tok.encode(text, add_special_tokens=False) == want
    assert tok.encode(text) == ([vocab.bos] if vocab.add_bos else []) + want
    assert tok.decode(want, skip_special_tokens=False) == text


@pytest.mark.parametrize("family", ["llama3"], indirect=True)
def test_llama_int8_blocks_are_the_unpermuted_weights(family):
    """The int8 copies read straight from the file's blocks (q/k rows put back in HF's
    order) are the dequantized float weights the model loads, bit for bit."""
    from swaserve.checkpoint.weights import iter_weights, load_q8_weights

    _, path, model, _ = family
    source = resolve_model(path)
    q8 = load_q8_weights(source, 2)
    dense = dict(iter_weights(source, torch.float32))
    for i in range(2):
        qkv = torch.cat([dense[f"model.layers.{i}.self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(q8[f"{i}.qkv"].dequantize(), qkv)
        assert torch.equal(qkv[:32], model.model.layers[i].self_attn.q_proj.weight)
        assert torch.equal(q8[f"{i}.o"].dequantize(),
                           dense[f"model.layers.{i}.self_attn.o_proj.weight"])
    assert torch.equal(q8["lm_head"].dequantize(), dense["lm_head.weight"])


def _tiny_gguf(path, arch: str, tensor_type, block: int = 32) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64),
                       ("attention.head_count", 4)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_token_list([f"t{i}" for i in range(8)])
    size = gguf.GGML_QUANT_SIZES[tensor_type][1]
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32 // block * size), np.uint8),
                 raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_an_unreadable_tensor_type_is_a_clear_error(tmp_path):
    _tiny_gguf(tmp_path / "q81.gguf", "llama", Q.Q8_1)
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.attn_q\.weight' has type Q8_1.*Q8_0"):
        resolve_model(tmp_path / "q81.gguf")


def test_an_unsupported_architecture_lists_the_supported(tmp_path):
    _tiny_gguf(tmp_path / "moe.gguf", "qwen3moe", Q.Q8_0)
    with pytest.raises(ModelLoadError, match="'qwen3moe' is not supported.*gpt-oss.*qwen3"):
        resolve_model(tmp_path / "moe.gguf")
