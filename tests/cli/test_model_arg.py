"""MODEL on the command line: positional (`swaserve serve MODEL`, vLLM's form) or
`--model`, for every command that loads a model; a hub model's errors reach the user as
one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from swaserve.cli import build_parser
from swaserve.cli.args import engine_config


def config_of(*argv: str):
    return engine_config(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize("command", ["serve", "plan"])
def test_model_positional_or_flag(command):
    assert config_of(command, "org/name-GGUF:Q8_0").model == "org/name-GGUF:Q8_0"
    assert config_of(command, "--model", "org/name").model == "org/name"
    assert config_of(command, "x.gguf", "--model", "x.gguf").model == "x.gguf"
    assert config_of(command).model is None  # the bundled model
    assert config_of(command, "org/name", "--revision", "v2").revision == "v2"
    with pytest.raises(ValueError, match=r"MODEL \(a.gguf\) and --model \(b.gguf\) name "
                                         "different models"):
        config_of(command, "a.gguf", "--model", "b.gguf")


def test_generate_takes_the_prompt_after_the_model():
    ns = build_parser().parse_args(["generate", "org/name", "The capital of France is"])
    assert ns.prompt == "The capital of France is" and engine_config(ns).model == "org/name"
    ns = build_parser().parse_args(["generate", "--max-tokens", "4", "org/name", "Hi",
                                    "--revision", "v2"])
    assert (ns.prompt, ns.sampling_max_tokens) == ("Hi", 4)
    assert (engine_config(ns).model, engine_config(ns).revision) == ("org/name", "v2")
    ns = build_parser().parse_args(["generate", "The capital of France is", "--model", "m"])
    assert ns.prompt == "The capital of France is" and engine_config(ns).model == "m"
    ns = build_parser().parse_args(["generate", "The capital of France is"])
    assert ns.prompt == "The capital of France is" and engine_config(ns).model is None
    with pytest.raises(ValueError, match="different models"):
        engine_config(build_parser().parse_args(["generate", "a", "Hi", "--model", "b"]))


def test_served_model_name_is_kept_as_given():
    from swaserve.cli.serve import server_options

    ns = build_parser().parse_args(["serve", "org/name", "--served-model-name", "mine"])
    assert server_options(ns).served_model_name == ("mine",)
    ns = build_parser().parse_args(["serve", "org/name", "--served-model-name", "a", "b/c"])
    assert server_options(ns).served_model_name == ("a", "b/c")
    ns = build_parser().parse_args(["serve", "org/name"])
    assert server_options(ns).served_model_name == ()  # the factory names it org/name


def test_allowed_origins_repeat_or_split_on_commas():
    from swaserve.cli.serve import server_options

    ns = build_parser().parse_args(["serve", "m", "--allowed-origins", "https://a.io, http://b",
                                    "--allowed-origins", "*"])
    assert server_options(ns).allowed_origins == ("https://a.io", "http://b", "*")
    assert server_options(build_parser().parse_args(["serve", "m"])).allowed_origins == ()


def test_hub_error_is_one_line_without_traceback(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    r = subprocess.run([sys.executable, "-m", "swaserve", "plan", "org/absent",
                        "--kv-memory", "1GiB"], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("swaserve: error: org/absent is no local path and not in the "
                               "Hugging Face cache "
                               f"({tmp_path / 'hub'}) and HF_HUB_OFFLINE is set")
