"""`swaserve generate`: complete one prompt offline."""

from __future__ import annotations

import argparse
import dataclasses
import json

from swaserve.cli.args import (
    add_engine_args,
    add_model_arg,
    add_sampling_args,
    engine_config,
    sampling_params,
)


def register(sub) -> None:
    g = sub.add_parser("generate", help="complete one prompt offline",
                       usage="%(prog)s [options] [MODEL] PROMPT")
    add_model_arg(g)
    g.add_argument("prompt")
    g.add_argument("--token-ids", action="store_true", help="PROMPT is comma-separated token ids")
    g.add_argument("--json", action="store_true", help="print JSON")
    add_sampling_args(g, temperature=0.0, max_tokens=64)  # greedy by default here
    add_engine_args(g)
    g.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from swaserve.entrypoints.llm import LLM

    params = sampling_params(args)
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
