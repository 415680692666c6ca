"""Command line: `swaserve generate | serve | plan`. Engine flags come from EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing

from swaserve.config import EngineConfig


def _field_type(f: dataclasses.Field):
    hints = typing.get_type_hints(EngineConfig)
    t = hints[f.name]
    args = [a for a in typing.get_args(t) if a is not type(None)] if isinstance(
        t, types.UnionType) or typing.get_origin(t) is typing.Union else [t]
    return args[0] if args else str


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    for f in EngineConfig.fields():
        flag = "--" + f.name.replace("_", "-")
        kind = _field_type(f)
        if kind is bool:  # --prefix-cache / --no-prefix-cache
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=f.default, help=f.metadata.get("help", ""))
        else:
            g.add_argument(flag, dest=f.name, type=kind, default=f.default,
                           help=f.metadata.get("help", ""))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in EngineConfig.fields()})


def _cmd_generate(args: argparse.Namespace) -> int:
    from swaserve import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        max_tokens=args.max_tokens, seed=args.sampling_seed, n=args.n,
        stop=args.stop or None, ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty, json_schema=args.json_schema,
        json_object=args.json_object, regex=args.regex, grammar=args.grammar)
    llm = LLM(**dataclasses.asdict(engine_config(args)))
    prompt = [int(t) for t in args.prompt.split(",")] if args.token_ids else args.prompt
    out = llm.generate(prompt, params)[0]
    if args.json:
        print(json.dumps({"prompt_token_ids": out.prompt_token_ids, "outputs": [
            {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
            for o in out.outputs]}))
    else:
        for o in out.outputs:
            print(o.text if llm.tokenizer is not None else " ".join(map(str, o.token_ids)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swaserve", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt offline")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--token-ids", action="store_true", help="PROMPT is comma-separated token ids")
    g.add_argument("--json", action="store_true", help="print JSON")
    g.add_argument("--json-schema", help="output follows this JSON schema (JSON text)")
    g.add_argument("--json-object", action="store_true", help="output is a JSON object")
    g.add_argument("--regex", help="output matches this regular expression")
    g.add_argument("--grammar", help="output follows this EBNF (GBNF) or Lark grammar")
    add_engine_args(g)
    g.set_defaults(func=_cmd_generate)

    for register in _extra_commands():
        register(sub)
    return p


def _extra_commands():
    from swaserve.memory.plan_cli import register as plan
    cmds = [plan]
    try:
        from swaserve.server.cli import register as serve
        cmds.append(serve)
    except ImportError:  # pragma: no cover
        pass
    return cmds


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"swaserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
