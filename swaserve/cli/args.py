"""Command-line flags derived from the frozen configs: every EngineConfig field is an engine
flag and every SamplingParams field a sampling flag, with their types, defaults and help,
so a new option needs no hand-written flag."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing

from swaserve.config import EngineConfig
from swaserve.sampling.params import SamplingParams

# sampling flags named apart from an engine flag of the same name; their values are kept
# under "sampling_<field>" for the same reason
SAMPLING_FLAG_NAMES = {"seed": "sampling-seed", "speculative": "request-speculative"}


def _value_type(cls, name: str):
    """The non-None type of a dataclass field (`int | None` -> int, `list[str]` -> list)."""
    t = typing.get_type_hints(cls)[name]
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        t = args[0] if args else str
    return typing.get_origin(t) or t, typing.get_args(t)


def _add(g, cls, f: dataclasses.Field, flag: str, default, dest: str) -> None:
    kind, inner = _value_type(cls, f.name)
    help_ = f.metadata.get("help", "")
    if kind is bool:  # --prefix-cache / --no-prefix-cache
        g.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                       default=default, help=help_)
    elif kind is list:  # repeatable
        g.add_argument(flag, dest=dest, action="append", type=inner[0] if inner else str,
                       default=None, metavar=f.name.upper(), help=help_ + " (repeatable)")
    elif kind is dict:
        g.add_argument(flag, dest=dest, type=json.loads, default=default, metavar="JSON",
                       help=help_)
    else:
        g.add_argument(flag, dest=dest, type=kind, default=default, metavar=f.name.upper(),
                       help=help_)


def add_engine_args(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    g = p.add_argument_group("engine")
    for f in EngineConfig.fields():
        if only is None or f.name in only:
            _add(g, EngineConfig, f, "--" + f.name.replace("_", "-"), f.default, f.name)


def add_model_arg(p: argparse.ArgumentParser) -> None:
    """MODEL as a positional argument (vLLM's `serve MODEL`); `--model` names it too."""
    p.add_argument("positional_model", nargs="?", default=None, metavar="MODEL",
                   help="a GGUF file, an HF-style directory, a Hugging Face repo id "
                        "(org/name) or a GGUF repo and quantization (org/name-GGUF:Q4_K_M); "
                        "the same as --model")


def model_arg(args: argparse.Namespace) -> str | None:
    """The model named by MODEL or --model; naming two different ones is an error."""
    positional, flag = getattr(args, "positional_model", None), getattr(args, "model", None)
    if positional is not None and flag is not None and positional != flag:
        raise ValueError(f"model: MODEL ({positional}) and --model ({flag}) name different "
                         "models; give one of them")
    return positional if positional is not None else flag


def engine_config(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in EngineConfig.fields()
              if hasattr(args, f.name)}
    if "model" in values:
        values["model"] = model_arg(args)
    return EngineConfig(**values)


def add_sampling_args(p: argparse.ArgumentParser, **defaults) -> None:
    """SamplingParams' fields as flags; `defaults` overrides theirs for this command."""
    g = p.add_argument_group("sampling")
    for f in dataclasses.fields(SamplingParams):
        if f.name.startswith("_"):
            continue
        flag = "--" + SAMPLING_FLAG_NAMES.get(f.name, f.name.replace("_", "-"))
        default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING
                               else None)
        _add(g, SamplingParams, f, flag, default, "sampling_" + f.name)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**{f.name: getattr(args, "sampling_" + f.name)
                             for f in dataclasses.fields(SamplingParams)
                             if not f.name.startswith("_")})
