"""A chat's prompt through the API: the model's templates (chat_template.jinja beside
named ones), its special tokens, the server's default template kwargs under the request's
`chat_template_kwargs` under its `reasoning_effort`; /tokenize answers exactly the ids a
chat is prompted with; a 400 names the field at fault."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import TEST_DEVICE, asgi_client

TEMPLATES = Path(__file__).parent / "chat_templates"
TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools={{ tools | tojson }}\n{% endif %}"
    "effort={{ reasoning_effort | default('none') }} think={{ enable_thinking }}\n"
    "{% for m in messages %}"
    "{% if m.role == 'developer' %}{{ raise_exception('no developer turns') }}{% endif %}"
    "<{{ m.role }}>{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}"
    "{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"role": "assistant", "content": None, "tool_calls": [{
    "id": "a1B2c3D4e", "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
USER = {"role": "user", "content": "hello"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_with_tokenizer):
    d = tmp_path_factory.mktemp("templated") / "model"
    shutil.copytree(tiny_with_tokenizer, d)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    extra = d / "additional_chat_templates"
    extra.mkdir()
    shutil.copy(TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja", extra / "mistral.jinja")
    shutil.copy(TEMPLATES / "Qwen-Qwen3-0.6B.jinja", extra / "qwen3.jinja")
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "pad_token": "<pad>", "eos_token": {
            "__type": "AddedToken", "content": "<eos>", "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True}}))
    return d


def served(path, **app_kw):
    from swaserve.engine.engine import Engine
    from swaserve.server.app import create_app
    from swaserve.server.async_engine import AsyncEngine

    eng = Engine(model=str(path), dtype="float32", device=TEST_DEVICE, kv_memory="8MiB",
                 max_model_len=512)
    aeng = AsyncEngine(eng)
    yield create_app(aeng, "tiny", **app_kw)
    aeng.shutdown()


@pytest.fixture(scope="module")
def app(model_dir):
    yield from served(model_dir, template_kwargs={"enable_thinking": False})


def post(app, *calls: tuple[str, dict]) -> list:
    async def run():
        async with asgi_client(app) as c:
            return [await c.post(path, json=body) for path, body in calls]
    return asyncio.run(run())


def prompt_text(app, body: dict) -> str:
    tokens, = post(app, ("/tokenize", body))
    assert tokens.status_code == 200, tokens.text
    text, = post(app, ("/detokenize", {"tokens": tokens.json()["tokens"]}))
    return text.json()["prompt"]


def test_tokenize_answers_the_ids_a_chat_is_prompted_with(app, monkeypatch):
    from swaserve.server.openai import routes as routes_openai

    sent = []
    real = routes_openai.answer

    async def spy(state, request, prepared, *a):
        sent.append(prepared[0].ids)
        return await real(state, request, prepared, *a)

    monkeypatch.setattr(routes_openai, "answer", spy)
    fields = {"messages": [USER, CALL, {"role": "tool", "tool_call_id": "a1B2c3D4e",
                                        "content": "sunny"}],
              "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": True},
              "reasoning_effort": "low"}
    tokens, chat = post(app, ("/tokenize", fields),
                        ("/v1/chat/completions", {**fields, "max_tokens": 2}))
    assert chat.status_code == 200, chat.text
    assert tokens.json()["tokens"] == sent[0]
    assert chat.json()["usage"]["prompt_tokens"] == tokens.json()["count"]


def test_the_prompt_matches_transformers(app, model_dir):
    from transformers import AutoTokenizer

    from swaserve.chat.tools import template_messages

    body = {"messages": [USER, {"role": "assistant", "content": "hm",
                                "reasoning_content": "think"}, USER],
            "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": True}}
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    want = hf.apply_chat_template(template_messages(body["messages"], None, False),
                                  tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                  enable_thinking=True)
    assert want.startswith("<bos>tools=[{\"type\"") and "[think]hm<eos>" in want
    assert prompt_text(app, body) == want
    tokens, = post(app, ("/tokenize", body))
    assert tokens.json()["tokens"][:2] != [2, 2]  # the template's BOS, not one more


def test_kwargs_precedence(app):
    base = {"messages": [USER]}
    assert "effort=none think=False\n" in prompt_text(app, base)  # the server's default
    assert "think=True" in prompt_text(app, {**base, "chat_template_kwargs": {
        "enable_thinking": True}})
    assert "effort=high" in prompt_text(app, {**base, "reasoning_effort": "high",
                                              "chat_template_kwargs": {
                                                  "reasoning_effort": "low"}})


def test_generation_prompt_and_continuing_the_final_message(app):
    assert prompt_text(app, {"messages": [USER], "add_generation_prompt": False}) \
        .endswith("<user>hello<eos>")
    text = prompt_text(app, {"messages": [USER, {"role": "assistant", "content": "Hi th"}],
                             "add_generation_prompt": False,
                             "continue_final_message": True})
    assert text.endswith("<user>hello<eos><assistant>Hi th")


def test_named_templates_and_their_special_tokens(app):
    text = prompt_text(app, {"messages": [USER, {"role": "assistant", "content": "Yo"}, USER],
                             "chat_template": "mistral"})
    assert text == "<bos>[INST]hello[/INST]Yo<eos>[INST]hello[/INST]"
    # an assistant turn that only calls tools has null content: it renders as ""
    text = prompt_text(app, {"messages": [USER, CALL], "chat_template": "qwen3",
                             "add_generation_prompt": False})
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text


@pytest.mark.parametrize("route", ["/tokenize", "/v1/chat/completions"])
@pytest.mark.parametrize("extra,param", [
    ({"messages": [{"role": "developer", "content": "x"}]}, "messages"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_a_bad_field_is_a_400_naming_it(app, route, extra, param):
    r, = post(app, (route, {"messages": [USER], "max_tokens": 2, **extra}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_tokenizer_info_reports_the_template_in_use(app, model_dir):
    async def info(a):
        async with asgi_client(a) as c:
            return (await c.get("/tokenizer_info")).json()

    got = asyncio.run(info(app))
    assert got["chat_template"] == TEMPLATE
    assert got["special_tokens"] == {"bos_token": "<bos>", "eos_token": "<eos>",
                                     "pad_token": "<pad>"}
    for other in served(model_dir, chat_template="{{ messages[0].content }}!"):
        assert asyncio.run(info(other))["chat_template"] == "{{ messages[0].content }}!"
        assert prompt_text(other, {"messages": [USER]}) == "hello!"


def test_serve_flags(tmp_path):
    from swaserve.cli import build_parser
    from swaserve.cli.serve import server_options

    def options(*flags):
        return server_options(build_parser().parse_args(["serve", *flags]))

    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    got = options("--chat-template", str(f), "--default-chat-template-kwargs",
                  '{"enable_thinking": false}')
    assert got.chat_template == "{{ messages[0].content }}"
    assert got.default_chat_template_kwargs == {"enable_thinking": False}
    assert options("--chat-template", "{{ 'inline' }}").chat_template == "{{ 'inline' }}"
    assert options().chat_template is None and options().default_chat_template_kwargs == {}
    for bad in ("[1]", "{x", '"s"'):
        with pytest.raises(SystemExit):
            options("--default-chat-template-kwargs", bad)
    with pytest.raises(ValueError, match="default_chat_template_kwargs"):
        options("--default-chat-template-kwargs", '{"messages": 1}')
    with pytest.raises(ValueError, match="does not compile"):
        options("--chat-template", "{% if %}")
