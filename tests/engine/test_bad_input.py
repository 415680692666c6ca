"""Bad input gets a clear error, and the engine keeps serving."""

from __future__ import annotations

import subprocess
import sys

import pytest

from swaserve import LLM, EngineConfig, SamplingParams
from swaserve.checkpoint.source import ModelLoadError
from tests.conftest import TEST_DEVICE, random_prompt


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="model not found"):
        LLM(str(tmp_path / "nope.gguf"))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ModelLoadError, match="GGUF"):
        LLM(str(bad))
    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"hello world")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        LLM(str(notgguf))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["FooForCausalLM"], "num_hidden_layers": 1, '
                                          '"hidden_size": 8, "num_attention_heads": 1, '
                                          '"intermediate_size": 8, "vocab_size": 8}')
    with pytest.raises(ValueError, match="unsupported architecture 'FooForCausalLM'.*Gemma3ForCausalLM"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("kw, name", [({"dtype": "int3"}, "dtype"), ({"chunk_size": 0}, "chunk_size"),
                                      ({"kv_memory": "lots"}, "kv_memory"),
                                      ({"max_running_requests": -1}, "max_running_requests")])
def test_bad_engine_config(kw, name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**kw)


def test_prompt_errors_name_the_problem(tiny_hybrid):
    path, _ = tiny_hybrid
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, kv_memory="64MiB", max_running_requests=4,
              max_model_len=64)
    with pytest.raises(ValueError, match="prompt: must not be empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([random_prompt(64, 1)])
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=-1))
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text needs a tokenizer"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 100000]])
    # nothing was lost: the engine still serves
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    assert llm.engine.cache.is_fully_free()


def test_never_fitting_request_fails_at_once(tiny_hybrid):
    path, _ = tiny_hybrid
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, kv_memory=60_000, max_running_requests=2,
              page_size=8, chunk_size=16, prefix_cache=False)
    cap = llm.engine.cache.num_total_pages * 8
    with pytest.raises(ValueError, match="full-KV pages"):
        llm.generate([random_prompt(cap + 1, 3)], SamplingParams(max_tokens=4))


def test_cli_errors_exit_nonzero_with_message(tmp_path):
    r = subprocess.run([sys.executable, "-m", "swaserve", "generate", "hi", "--model",
                        str(tmp_path / "missing.gguf")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "model not found" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "swaserve", "generate", "hi", "--max-tokens", "-1",
                        "--model", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "max_tokens" in r.stderr and "Traceback" not in r.stderr
