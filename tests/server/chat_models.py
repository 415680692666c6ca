"""The tiny chat models the chat-like surfaces test on: random gpt-oss and Qwen3 models with
their real tokenizers and chat templates, served in process (fixtures `gpt_oss_chat` and
`qwen3_chat`, re-exported by tests/server/conftest.py), whose outputs a test scripts
(`script`), and the tools and question they are asked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import inprocess_served
from tests.helpers.checkpoints import FAMILY_COMMON, _randomize_norms, _save, write_gpt_oss
from tests.helpers.scripted import script_outputs
from tests.helpers.tokenizers import write_tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "time",
                                           "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _chat_dir(path: Path, family: str, template: str) -> None:
    write_tokenizer(family, path)
    shutil.copyfile(TEMPLATES / template, path / "chat_template.jinja")


@pytest.fixture(scope="module")
def gpt_oss_chat(tmp_path_factory):
    """A tiny gpt-oss with o200k_harmony and gpt-oss's template; <|return|> and <|call|>
    end a turn (generation_config.json, as the real checkpoint has it)."""
    path = tmp_path_factory.mktemp("gpt_oss_chat")
    write_gpt_oss(path, vocab_size=201088, eos_token_id=200002, bos_token_id=199998,
                  max_position_embeddings=2048,
                  pad_token_id=199999)
    _chat_dir(path, "gpt-oss", "openai-gpt-oss-120b.jinja")
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [200002, 199999, 200012], "bos_token_id": 199998}))
    yield from inprocess_served(str(path), max_model_len=2048)


def write_qwen3_chat(path: Path) -> Path:
    """A tiny random Qwen3 with Qwen3-0.6B's tokenizer and chat template, in `path`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**{**FAMILY_COMMON, "vocab_size": 151669, "eos_token_id": 151645,
                         "bos_token_id": 151643, "pad_token_id": 151643,
                         "max_position_embeddings": 2048},
                      num_hidden_layers=2, tie_word_embeddings=True)
    _save(_randomize_norms(Qwen3ForCausalLM(cfg)), path)
    _chat_dir(path, "qwen3", "Qwen-Qwen3-0.6B.jinja")
    return path


@pytest.fixture(scope="module")
def qwen3_chat(tmp_path_factory):
    path = write_qwen3_chat(tmp_path_factory.mktemp("qwen3_chat"))
    yield from inprocess_served(str(path), max_model_len=2048)


def script(served, text: str) -> None:
    """Every request of the served engine writes `text` (special tokens as tokens), then
    its first end-of-turn token."""
    app, aeng = served
    eng = aeng.engine
    ids = eng.tokenizer.encode(text, add_special_tokens=False)
    script_outputs(eng, ids, end=eng.tokenizer.eos_token_ids[0])
