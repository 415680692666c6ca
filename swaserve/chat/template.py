"""Chat templates: the model's own Jinja templates, rendered exactly as transformers'
`apply_chat_template` renders them, or the built-in Gemma turn template for GGUFs that
carry none (the bundled base model).

The environment is Hugging Face's: a sandbox with `trim_blocks` and `lstrip_blocks`, the
`{% break %}`/`{% continue %}` loop controls, `{% generation %}` blocks (rendered as their
body), a `tojson` that neither escapes HTML nor sorts keys, and the globals
`raise_exception`, `strftime_now`, a `dict` without attribute tricks and a `namespace` that
refuses underscore names. A render passes `messages`, `tools`, `documents`,
`add_generation_prompt`, the tokenizer's special tokens (`bos_token`, `eos_token`, ...)
and then the caller's template kwargs, which override the special tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import TemplateError, nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

GEMMA_TEMPLATE = (
    "{% set ns = namespace(sys='') %}"
    "{% for m in messages %}"
    "{% if m['role'] in ('system', 'developer') %}{% set ns.sys = ns.sys + m['content'] + '\\n\\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' }}"
    "{{ ns.sys }}{% set ns.sys = '' %}"
    "{{ (m['content'] | trim) + '<end_of_turn>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
GEMMA_END_OF_TURN = "<end_of_turn>"
log = logging.getLogger("swaserve")
# the names a render passes itself; template kwargs may not use them
RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                             "continue_final_message"})
# the names a message's reasoning goes by; templates read `reasoning_content` or `thinking`
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A chat the template cannot render; `param` is the request field to blame."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


def now() -> datetime:
    """The time `strftime_now` formats (a function of its own, so tests can freeze it)."""
    return datetime.now()


def _strftime_now(fmt: str) -> str:
    return now().strftime(fmt)


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Plain JSON text: Jinja's own filter escapes HTML characters and sorts keys."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type object itself
    (whose attributes would lead out of the sandbox)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_attribute(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a chat template may not set the attribute {name!r} on a "
                            "namespace (underscore names are refused)")


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore attributes (the way to CPython internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - Jinja's signature, so namespace(self=1) works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_attribute(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_attribute(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens for training
    masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def make_environment() -> ImmutableSandboxedEnvironment:
    """A sandboxed environment set up as transformers sets up its own."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


def _plain(value: Any) -> Any:
    """A fresh copy of JSON-shaped data (the render edits its copy of the messages)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _alias_reasoning(message: dict) -> dict:
    """A message's reasoning under both names templates read (`thinking` for gpt-oss,
    `reasoning_content` for the rest), from whichever name it came under."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None),
                     None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """One model's chat templates by name (`default`, `tool_use`, ...), compiled once, and
    its special tokens. `source` None is the built-in Gemma template. A default template
    that does not compile is an error at once; another one is left out (with a warning),
    so that the model still serves the chats it can."""

    def __init__(self, source: str | Mapping[str, str] | None,
                 special_tokens: Mapping[str, str] | None = None):
        self.builtin = source is None
        if source is None:
            source = GEMMA_TEMPLATE
        self.sources: dict[str, str] = (
            {"default": source} if isinstance(source, str) else dict(source))
        self.special_tokens = dict(special_tokens or {})
        env = make_environment()
        self._compiled = {}
        for name, text in list(self.sources.items()):
            try:
                self._compiled[name] = env.from_string(text)
            except TemplateError as e:
                if name == "default" or len(self.sources) == 1:
                    raise ChatTemplateError(f"chat template {name!r} does not compile: "
                                            f"{e}") from e
                log.warning("chat template %r does not compile (%s); left out", name, e)
                del self.sources[name]

    def name_for(self, tools: bool) -> str:
        """Which template a chat uses: `tool_use` for one with tools where the model has
        it, else `default` (transformers' choice)."""
        if tools and "tool_use" in self.sources:
            return "tool_use"
        if "default" in self.sources:
            return "default"
        raise ChatTemplateError(
            "messages: the model has several chat templates and none named 'default' "
            f"(it has {sorted(self.sources)})")

    def source_for(self, tools: bool, name: str | None = None) -> str:
        """The text of the template a chat uses (what its output format is read from):
        the one named, else the one `name_for` picks."""
        return self.sources[self._pick(tools, name)]

    def _pick(self, tools: bool, name: str | None) -> str:
        if name is None:
            return self.name_for(tools)
        if name not in self.sources:
            raise ChatTemplateError(f"chat_template: the model has no template {name!r} "
                                    f"(it has {sorted(self.sources)})", "chat_template")
        return name

    def render(self, messages: list[Mapping[str, Any]], *, tools: list[dict] | None = None,
               documents: list[dict] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False,
               kwargs: Mapping[str, Any] | None = None, name: str | None = None) -> str:
        """The prompt text of a chat, as `tokenizer.apply_chat_template(messages, tools,
        documents, add_generation_prompt=..., continue_final_message=..., tokenize=False,
        chat_template=name, **kwargs)` writes it. `continue_final_message` leaves the last
        message open, for the model to go on with it; `name` picks a template by name
        instead of by the presence of tools."""
        kwargs = dict(kwargs or {})
        reserved = sorted(RESERVED_KWARGS & kwargs.keys())
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs: {reserved[0]!r} is set by the "
                                    "request itself", "chat_template_kwargs")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message: needs add_generation_prompt "
                                    "false (one continues the last message, the other "
                                    "starts a new one)", "continue_final_message")
        name = self._pick(tools is not None, name)
        chat = [_alias_reasoning({k: v for k, v in _plain(m).items() if v is not None})
                for m in messages]
        final = self._tag_final(chat, name) if continue_final_message else None
        try:
            text = self._compiled[name].render(
                messages=chat, tools=_plain(tools), documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **_plain({**self.special_tokens, **kwargs}))
        except Exception as e:  # noqa: BLE001 - any template failure is the request's problem
            raise ChatTemplateError(f"messages: the chat template failed: {e}") from e
        return text if final is None else self._cut_at_tag(text, final)

    def _tag_final(self, chat: list[dict], name: str) -> str:
        """Marks the end of the last message's text, for `_cut_at_tag`; its text."""
        if not chat or chat[-1].get("content") is None:
            raise ChatTemplateError("continue_final_message: the last message has no "
                                    "content to continue", "continue_final_message")
        if "content" not in self.sources[name]:
            raise ChatTemplateError("continue_final_message: the chat template does not "
                                    "read a message's content", "continue_final_message")
        content = chat[-1]["content"]
        if isinstance(content, list):
            block = next((b for b in reversed(content) if "text" in b), None)
            if block is None:
                raise ChatTemplateError("continue_final_message: the last message has no "
                                        "text to continue", "continue_final_message")
            final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
            return final
        chat[-1]["content"] = content + _CONTINUE_TAG
        return content

    @staticmethod
    def _cut_at_tag(text: str, final: str) -> str:
        """The render up to the end of the last message's text (the template's closing of
        the turn is dropped)."""
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ChatTemplateError("continue_final_message: the chat template does not "
                                    "write the last message as given, so it cannot be "
                                    "continued", "continue_final_message")
        at = text.rindex(tag)
        if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return text[:at]
        return text[:at].rstrip()  # the template trimmed the message's end
