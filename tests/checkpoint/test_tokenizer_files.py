"""Where a tokenizer's chat templates, special tokens and extra stop ids come from: the
files transformers reads, in its order, and a GGUF's metadata."""

from __future__ import annotations

import json
import shutil

import pytest

from swaserve.checkpoint.gguf_meta import read_gguf_metadata
from swaserve.checkpoint.source import ModelSource, resolve_model
from swaserve.checkpoint.tokenizer import _from_file, load_tokenizer
from swaserve.checkpoint.tokenizer_files import (
    find_chat_templates,
    gguf_chat_templates,
    gguf_special_tokens,
    special_tokens,
)
from tests.helpers.checkpoints import write_byte_bpe_tokenizer


@pytest.fixture
def model_dir(tmp_path, tiny_with_tokenizer):
    """A copy of the tiny model with a tokenizer (config.json eos id 1), to add files to."""
    d = tmp_path / "model"
    shutil.copytree(tiny_with_tokenizer, d)
    return d


def write(path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")


def test_template_files_win_over_tokenizer_config(model_dir):
    write(model_dir / "tokenizer_config.json", {"chat_template": "from config"})
    assert find_chat_templates(model_dir) == {"default": "from config"}
    write(model_dir / "chat_template.jinja", "from file")
    write(model_dir / "additional_chat_templates" / "tool_use.jinja", "tools file")
    assert find_chat_templates(model_dir) == {"default": "from file",
                                              "tool_use": "tools file"}
    tok = load_tokenizer(resolve_model(model_dir))
    assert tok.chat_template == "from file"
    assert tok.chat_templates == {"default": "from file", "tool_use": "tools file"}


def test_a_list_of_named_templates_is_read(model_dir):
    write(model_dir / "tokenizer_config.json", {"chat_template": [
        {"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"},
        {"name": "rag", "template": "documents"}]})
    tok = load_tokenizer(resolve_model(model_dir))
    assert tok.chat_templates == {"default": "plain", "tool_use": "tools", "rag": "documents"}
    assert tok.chat_template == "plain"


def test_no_template_is_none(model_dir):
    tok = load_tokenizer(resolve_model(model_dir))
    assert tok.chat_templates == {} and tok.chat_template is None


def test_special_tokens_from_config_then_the_map(model_dir):
    write(model_dir / "tokenizer_config.json", {
        "bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False},
        "unk_token": None, "pad_token": "<pad>", "add_bos_token": True})
    write(model_dir / "special_tokens_map.json", {"pad_token": {"content": "<p2>"},
                                                  "mask_token": "<mask>"})
    assert special_tokens(model_dir) == {"bos_token": "<s>", "eos_token": "</s>",
                                         "pad_token": "<p2>", "mask_token": "<mask>"}
    assert load_tokenizer(resolve_model(model_dir)).special_tokens["eos_token"] == "</s>"


def test_generation_config_eos_ids_join_the_stop_ids(model_dir):
    write(model_dir / "generation_config.json", {"eos_token_id": [1, 5, 7]})
    assert load_tokenizer(resolve_model(model_dir)).eos_token_ids == (1, 5, 7)
    write(model_dir / "generation_config.json", {"eos_token_id": 9})
    assert load_tokenizer(resolve_model(model_dir)).eos_token_ids == (1, 9)


def test_the_engine_stops_on_generation_config_eos_ids(model_dir):
    from swaserve.engine.engine import Engine

    write(model_dir / "generation_config.json", {"eos_token_id": [1, 7]})
    eng = Engine(model=str(model_dir), dtype="float32", device="cpu", kv_memory="4MiB")
    assert {1, 7} <= eng.eos_token_ids


def write_gguf(path, **strings_and_ids) -> dict:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in strings_and_ids.items():
        key = key.replace("__", ".")
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_gguf_metadata(path)


def test_gguf_default_and_named_templates_and_special_tokens(tmp_path, tiny_with_tokenizer):
    meta = write_gguf(tmp_path / "m.gguf", tokenizer__chat_template="plain",
                      tokenizer__chat_template__tool_use="tools",
                      tokenizer__ggml__bos_token_id=2, tokenizer__ggml__eos_token_id=1,
                      tokenizer__ggml__padding_token_id=0, tokenizer__ggml__eot_token_id=40)
    assert gguf_chat_templates(meta) == {"default": "plain", "tool_use": "tools"}
    names = {0: "<pad>", 1: "<eos>", 2: "<bos>"}
    assert gguf_special_tokens(meta, names.get) == {"bos_token": "<bos>", "eos_token": "<eos>",
                                                    "pad_token": "<pad>"}
    write_byte_bpe_tokenizer(tmp_path)
    hf = resolve_model(tiny_with_tokenizer)
    source = ModelSource(tmp_path / "m.gguf", "gguf", hf.hf_config, meta)
    tok = _from_file(tmp_path / "tokenizer.json", source)
    assert tok.chat_templates == {"default": "plain", "tool_use": "tools"}
    assert tok.special_tokens["bos_token"] == tok.id_to_token(2)
    assert tok.eos_token_ids == (1, 40)  # llama.cpp also stops on end-of-turn
