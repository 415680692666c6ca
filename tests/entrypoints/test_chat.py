"""`LLM.chat` on a tiny Qwen3 with its real tokenizer and chat template: the prompt is the
server's, and scripted outputs come back read as content, reasoning and tool calls."""

from __future__ import annotations

import json

import pytest

from swaserve.entrypoints.llm import LLM
from swaserve.sampling.params import SamplingParams
from tests.conftest import TEST_DEVICE, inprocess_served, run_client
from tests.helpers.scripted import script_outputs
from tests.server.chat_models import TOOLS, USER, write_qwen3_chat

CALL = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return write_qwen3_chat(tmp_path_factory.mktemp("qwen3_chat_llm"))


@pytest.fixture(scope="module")
def llm(qwen3_path):
    return LLM(str(qwen3_path), dtype="float32", device=TEST_DEVICE, max_model_len=2048)


def script(llm: LLM, text: str) -> None:
    tok = llm.tokenizer
    script_outputs(llm.engine, tok.encode(text, add_special_tokens=False),
                   end=tok.eos_token_ids[0])


def test_reasoning_and_content(llm):
    script(llm, "<think>\nhm\n</think>\n\nHello!")
    out = llm.chat(USER, SamplingParams(max_tokens=40))[0]
    assert (out.message.reasoning.strip(), out.message.content) == ("hm", "Hello!")
    assert out.message.tool_calls == []
    assert out.finish_reason == "stop" and "Hello!" in out.text
    assert out.prompt.endswith("<|im_start|>assistant\n")


def test_tool_call(llm):
    script(llm, CALL)
    msg = llm.chat(USER, SamplingParams(max_tokens=80), tools=TOOLS)[0].message
    assert msg.reasoning.strip() == "The user wants weather."
    assert msg.content.strip() == "Let me check."
    [call] = msg.tool_calls
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    turn = msg.as_dict()  # goes back into the conversation as the template reads it
    again = llm.chat([*USER, turn, {"role": "tool", "tool_call_id": call["id"],
                                    "content": "sunny"}], SamplingParams(max_tokens=4),
                     tools=TOOLS)[0]
    assert "<tool_response>\nsunny\n</tool_response>" in again.prompt


def test_two_conversations_and_template_kwargs(llm):
    script(llm, "Hi.")
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hey"}]
    outs = llm.chat([USER, other], SamplingParams(max_tokens=8),
                    chat_template_kwargs={"enable_thinking": False})
    assert [o.message.content for o in outs] == ["Hi.", "Hi."]
    assert "Be brief." in outs[1].prompt and "Be brief." not in outs[0].prompt
    assert all(o.prompt.endswith("<think>\n\n</think>\n\n") for o in outs)


def test_prompt_is_the_servers(llm, qwen3_path):
    chat = [{"role": "system", "content": "Be brief."}, *USER]
    mine = [o.prompt_token_ids for o in (
        llm.chat(chat, SamplingParams(max_tokens=1))[0],
        llm.chat(chat, SamplingParams(max_tokens=1), tools=TOOLS)[0])]
    for app, _ in inprocess_served(str(qwen3_path), max_model_len=2048):
        async def ask(client, http):
            plain = await http.post("/tokenize", json={"messages": chat})
            tools = await http.post("/tokenize", json={"messages": chat, "tools": TOOLS})
            return [plain.json()["tokens"], tools.json()["tokens"]]
        assert run_client(app, ask) == mine


@pytest.mark.parametrize("messages, says", [
    ([], "non-empty"),
    ([{"content": "hi"}], "messages[0]: needs a 'role'"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([USER, [{"role": "user"}, "x"]], "messages[1][1]: a message is a dict"),
])
def test_malformed_messages_raise(llm, messages, says):
    with pytest.raises(ValueError, match=r".*" + says.replace("[", r"\[").replace("]", r"\]")):
        llm.chat(messages)


def test_continue_final_message(llm):
    script(llm, "Paris.")
    out = llm.chat([*USER, {"role": "assistant", "content": "It is"}],
                   SamplingParams(max_tokens=4), add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert out.prompt.endswith("It is") and out.message.content == "Paris."
    with pytest.raises(ValueError, match="the last message must be the assistant's"):
        llm.chat(USER, add_generation_prompt=False, continue_final_message=True)


def test_a_model_without_a_template_raises(tiny_hybrid):
    llm = LLM(tiny_hybrid[0], dtype="float32", device=TEST_DEVICE, kv_memory="16MiB")
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(USER)
