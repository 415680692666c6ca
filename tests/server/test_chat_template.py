"""The chat template environment (transformers' own: loop controls, `tojson`'s options,
`strftime_now`, `{% generation %}`, a guarded `namespace`, the sandbox) and what a render
passes to a template."""

from __future__ import annotations

import datetime as dt

import pytest

from swaserve.chat import template as ct
from swaserve.chat.template import ChatTemplate, ChatTemplateError

USER = [{"role": "user", "content": "hi"}]


def render(source: str, messages=USER, special=None, **kw) -> str:
    return ChatTemplate(source, special).render(messages, **kw)


def test_loop_controls():
    src = "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}" \
          "{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    assert render(src) == "02"


def test_tojson_is_plain_json_with_its_options():
    data = {"b": "<&>", "a": ["é", 1]}
    assert render("{{ x | tojson }}", kwargs={"x": data}) == '{"b": "<&>", "a": ["é", 1]}'
    assert render("{{ x | tojson(indent=2) }}", kwargs={"x": {"a": 1}}) == '{\n  "a": 1\n}'
    assert render("{{ x | tojson(separators=(',', ':'), sort_keys=true) }}",
                  kwargs={"x": data}) == '{"a":["é",1],"b":"<&>"}'
    assert render("{{ x | tojson(ensure_ascii=true) }}", kwargs={"x": "é"}) == '"\\u00e9"'


def test_strftime_now_reads_the_patchable_clock(monkeypatch):
    monkeypatch.setattr(ct, "now", lambda: dt.datetime(2025, 7, 4))
    assert render("{{ strftime_now('%d %b %Y') }}") == "04 Jul 2025"


def test_generation_blocks_render_their_body():
    src = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}" \
          "{% endfor %}"
    assert render(src) == "[hi]"


def test_dict_global_and_namespace():
    assert render("{{ dict(a=1).a }}{{ dict.fromkeys(['x'], 2).x }}") == "12"
    assert render("{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}") == "2"
    for src in ("{% set ns = namespace(_x=1) %}", "{% set ns = namespace() %}"
                "{% set ns._x = 1 %}"):
        with pytest.raises(ChatTemplateError):
            render(src)


@pytest.mark.parametrize("src", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__name__.upper() }}",
    "{{ raise_exception.__globals__.keys() }}",
    "{{ namespace.__init__.__globals__.keys() }}",
    "{{ dict.__call__.__globals__.keys() }}",
    "{% set x = messages.append(1) %}",
])
def test_the_sandbox_holds(src):
    """Unsafe attributes are undefined (using them fails) and the data is immutable."""
    with pytest.raises(ChatTemplateError) as e:
        render(src)
    assert e.value.param == "messages"
    assert render("{{ messages.__class__ }}{{ ''.__class__ }}") == ""


def test_raise_exception_is_the_requests_error():
    with pytest.raises(ChatTemplateError, match="roles must alternate") as e:
        render("{{ raise_exception('roles must alternate') }}")
    assert e.value.param == "messages"


def test_a_template_that_does_not_compile_fails_at_once():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate({"default": "{% for %}", "rag": "x"})
    assert ChatTemplate({"default": "x", "rag": "{% for %}"}).sources == {"default": "x"}


def test_variables_special_tokens_then_kwargs():
    src = "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ tools }}|" \
          "{{ documents }}|{{ x }}"
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    assert render(src, special=special) == "<s>|</s>|True|None|None|"
    assert render(src, special=special, kwargs={"eos_token": "E", "x": 1},
                  add_generation_prompt=False, documents=[{"title": "t"}],
                  tools=[]) == "<s>|E|False|[]|[{'title': 't'}]|1"


@pytest.mark.parametrize("name", sorted(ct.RESERVED_KWARGS))
def test_reserved_kwargs_are_refused(name):
    with pytest.raises(ChatTemplateError) as e:
        render("x", kwargs={name: 1})
    assert e.value.param == "chat_template_kwargs"


def test_none_keys_are_dropped_and_reasoning_is_aliased():
    src = "{% for m in messages %}{{ m.keys() | list | sort | join(',') }};" \
          "{{ m.thinking }}/{{ m.reasoning_content }}{% endfor %}"
    msgs = [{"role": "assistant", "content": None, "reasoning": "r"}]
    assert render(src, msgs) == "reasoning,reasoning_content,role,thinking;r/r"
    assert msgs == [{"role": "assistant", "content": None, "reasoning": "r"}]  # untouched


def test_tool_use_is_picked_when_tools_are_given():
    t = ChatTemplate({"default": "plain", "tool_use": "tools", "rag": "docs"})
    assert t.render(USER) == "plain" and t.render(USER, tools=[]) == "tools"
    assert t.source_for(True) == "tools" and t.source_for(False) == "plain"
    assert t.render(USER, name="rag") == "docs" and t.source_for(True, "rag") == "docs"
    with pytest.raises(ChatTemplateError) as e:
        t.render(USER, name="nope")
    assert e.value.param == "chat_template"
    assert ChatTemplate({"default": "plain"}).render(USER, tools=[]) == "plain"
    with pytest.raises(ChatTemplateError):
        ChatTemplate({"tool_use": "tools"}).render(USER)


def test_continue_final_message():
    src = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    msgs = USER + [{"role": "assistant", "content": "The answer is"}]
    out = render(src, msgs, add_generation_prompt=False, continue_final_message=True)
    assert out == "<user>hi</user><assistant>The answer is"
    trimmed = src.replace("{{ m.content }}", "{{ m.content | trim }}")
    assert render(trimmed, [{"role": "assistant", "content": "so "}],
                  add_generation_prompt=False, continue_final_message=True) \
        == "<assistant>so"
    for kw, msgs_ in (({"add_generation_prompt": True}, msgs),
                      ({"add_generation_prompt": False}, [{"role": "assistant"}])):
        with pytest.raises(ChatTemplateError) as e:
            render(src, msgs_, continue_final_message=True, **kw)
        assert e.value.param == "continue_final_message"
    with pytest.raises(ChatTemplateError) as e:  # the template drops the content
        render("{% for m in messages %}{{ m.role }}{% endfor %}{{ 'content' }}", msgs,
               add_generation_prompt=False, continue_final_message=True)
    assert e.value.param == "continue_final_message"


def test_the_builtin_template():
    t = ChatTemplate(None)
    assert t.builtin
    assert t.render([{"role": "system", "content": "Be brief."}] + USER) == \
        "<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n"
