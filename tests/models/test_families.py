"""The families behind the registry: each declares what the generic code asks
(models/family.py), the registry finds it by HF architecture, model_type and GGUF
architecture, and what it declares agrees with its network."""

from __future__ import annotations

from pathlib import Path

import pytest

from swaserve.models import networks, registry
from swaserve.models.config import ModelConfig
from swaserve.models.family import FamilyBase

FAMILIES = {f.name: f for f in registry.FAMILIES}


def test_every_family_package_is_registered_under_its_name():
    models = Path(registry.__file__).parent
    packages = {p.name for p in models.iterdir() if (p / "__init__.py").is_file()}
    assert sorted(FAMILIES) == sorted(packages)
    for family in registry.FAMILIES:
        assert isinstance(family, FamilyBase)
        assert type(family).__module__ == f"swaserve.models.{family.name}"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_family_runs_what_it_names_and_says_where(name):
    """Every architecture it runs as has a network; the MLX form it declares matches its
    network's `runs_on_mlx` (the MLX backend refuses by the latter)."""
    family = FAMILIES[name]
    for arch in set(family.architectures.values()):
        cls = networks.model_class(arch)
        assert cls.__module__ == f"swaserve.models.{name}.model"
        assert cls.runs_on_mlx == (family.mlx_layer is not None), arch


def test_the_registry_finds_a_family_by_architecture_model_type_and_gguf():
    assert registry.family_of({"architectures": ["MistralForCausalLM"]}).name == "llama"
    assert registry.family_of({"architectures": ["Gemma3TextModel"]}).name == "gemma3"
    assert registry.family_of({"model_type": "qwen3_5_moe_text"}).name == "qwen3_5"
    assert registry.family_of({"model_type": "gemma4_text"}).name == "gemma4"
    assert registry.family_of({"model_type": "deepseek_v4"}).name == "deepseek_v4"
    assert registry.family_of({"architectures": ["FooForCausalLM"]}) is registry.PLAIN
    assert {a: f.name for a, f in registry.gguf_architectures().items()} == {
        "gemma3": "gemma3", "gemma4": "gemma4", "gpt-oss": "gpt_oss", "llama": "llama",
        "qwen2": "llama", "qwen3": "llama"}
    with pytest.raises(ValueError, match="GGUF architecture 'bert' is not supported"):
        registry.gguf_family("bert")
    with pytest.raises(ValueError, match="unsupported architecture 'FooForCausalLM'"):
        networks.model_class("FooForCausalLM")


def test_a_config_carries_its_family_and_typed_fields():
    cfg = ModelConfig.from_hf({
        "architectures": ["GptOssForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 32, "vocab_size": 100, "num_local_experts": 8,
        "num_experts_per_tok": 2})
    assert cfg.family is FAMILIES["gpt_oss"]
    assert (cfg.spec.num_local_experts, cfg.spec.experts_per_token) == (8, 2)
    assert (cfg.spec.swiglu_alpha, cfg.spec.swiglu_limit) == (1.702, 7.0)  # the defaults
