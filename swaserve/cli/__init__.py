"""Command line: `swaserve generate | chat | serve | plan`. Flags come from EngineConfig and
SamplingParams (cli/args.py)."""

from __future__ import annotations

import argparse
import logging
import sys

from swaserve.cli import chat, generate, plan, serve


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swaserve", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)
    for command in (generate, chat, serve, plan):
        command.register(sub)
    return p


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
