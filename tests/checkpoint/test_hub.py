"""Models named by hub id: what is downloaded, what is loaded, and one clear error for each
way it fails. No network: a stand-in hub on a local port fills a temporary cache once
(conftest.py) and most tests then run with HF_HUB_OFFLINE set."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from swaserve.checkpoint.hub import HubRef, parse_hub_id, pick_files
from swaserve.checkpoint.source import ModelLoadError, resolve_model
from tests.checkpoint.conftest import DEAD_ENDPOINT, point_hub
from tests.conftest import TEST_DEVICE
from tests.helpers.hub import commit_of


def snapshot_files(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("text, ref", [
    ("org/name", HubRef("org/name")), ("Qwen/Qwen3-0.6B", HubRef("Qwen/Qwen3-0.6B")),
    ("org/name-GGUF:Q4_K_M", HubRef("org/name-GGUF", "Q4_K_M")),
    ("./x", None), ("/abs/dir", None), ("a/b/c", None), ("name", None),
    ("models/x.gguf", None), ("~/x", None), ("org/..", None)])
def test_parse_hub_id(text, ref):
    assert parse_hub_id(text) == ref


def test_tags_match_whole_words_and_splits_keep_their_parts():
    files = ["x-Q4_K_M.gguf", "x-Q4_K_S.gguf", "x.q4_k.gguf", "BF16/x-BF16-00001-of-00002.gguf",
             "BF16/x-BF16-00002-of-00002.gguf", "mmproj-x-BF16.gguf", "Q6_K/model.gguf",
             "README.md"]
    assert pick_files(HubRef("o/x", "Q4_K"), files) == (["x.q4_k.gguf"], "x.q4_k.gguf")
    assert pick_files(HubRef("o/x", "q4_k_s"), files)[1] == "x-Q4_K_S.gguf"
    assert pick_files(HubRef("o/x"), files)[1] == "x-Q4_K_M.gguf"  # the default tag
    parts = ["BF16/x-BF16-00001-of-00002.gguf", "BF16/x-BF16-00002-of-00002.gguf"]
    assert pick_files(HubRef("o/x", "bf16"), files) == (parts, parts[0])
    assert pick_files(HubRef("o/x", "Q6_K"), files)[1] == "Q6_K/model.gguf"
    with pytest.raises(ValueError, match="tag 'Q5_0'; its tags: BF16, Q4_K, Q4_K_M, Q4_K_S, Q6_K"):
        pick_files(HubRef("o/x", "Q5_0"), files)


def test_checkpoint_files_are_the_ones_the_engine_reads():
    files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja", "additional_chat_templates/tool.jinja",
             "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "consolidated.safetensors", "params.json",
             "README.md", "pytorch_model.bin", "original/model.safetensors", "x-Q8_0.gguf"]
    wanted, gguf = pick_files(HubRef("o/x"), files)
    assert gguf is None
    assert wanted == sorted(files[:10])
    modules = ["modules.json", "1_Pooling/config.json", "2_Dense/config.json",
               "2_Dense/model.safetensors", "config_sentence_transformers.json",
               "2_Dense/pytorch_model.bin"]
    wanted, _ = pick_files(HubRef("o/x"), files + modules)
    assert wanted == sorted(files[:10] + modules[:4])  # an embedding model's modules


def test_hf_repo_generates_as_its_local_path(offline_cache, tiny_with_tokenizer):
    from swaserve import LLM, SamplingParams

    source = resolve_model("org/tiny")
    assert source.fmt == "hf" and source.hub_id == "org/tiny"
    assert source.path.parts[-2:] == ("snapshots", commit_of("org/tiny"))
    assert snapshot_files(source.path) == {"config.json", "generation_config.json",
                                           "model.safetensors", "tokenizer.json"}
    kw = dict(dtype="float32", device=TEST_DEVICE, kv_memory="16MiB", max_running_requests=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    hub = LLM("org/tiny", **kw).generate("hello world", params)[0]
    local = LLM(tiny_with_tokenizer, **kw).generate("hello world", params)[0]
    assert hub.token_ids == local.token_ids and hub.text == local.text
    # a commit names a revision too
    assert resolve_model("org/tiny", revision=commit_of("org/tiny")).path == source.path


def test_gguf_tag_picks_its_file(offline_cache):
    for model in ("org/tiny-GGUF:Q8_0", "org/tiny-GGUF:q8_0"):
        source = resolve_model(model)
        assert source.fmt == "gguf" and source.path.name == "tiny-Q8_0.gguf"
        assert source.gguf_meta["general.name"] == "tiny-Q8_0" and source.hub_id == model
    default = resolve_model("org/tiny-GGUF")
    assert default.path.name == "tiny-Q4_K_M.gguf"
    assert default.gguf_meta["general.name"] == "tiny-Q4_K_M"
    # only the quantizations asked for were downloaded
    assert snapshot_files(default.path.parent) == {"tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf"}
    # a repo of one GGUF without the default tag gives that one
    assert resolve_model("org/one-GGUF").path.name == "one-Q8_0.gguf"


def test_tag_without_a_file_lists_the_tags(offline_cache):
    with pytest.raises(ModelLoadError, match="no GGUF file of org/tiny-GGUF carries the tag "
                                             "'Q5_K_M'; its tags: Q4_K, Q4_K_M, Q4_K_S, Q8_0"):
        resolve_model("org/tiny-GGUF:Q5_K_M")


def test_split_gguf_is_downloaded_whole_and_loads_from_its_parts(fake_hub, tmp_path,
                                                                  monkeypatch):
    point_hub(monkeypatch, fake_hub[1], tmp_path / "hub")
    source = resolve_model("org/split-GGUF:Q8_0")
    snapshot = tmp_path / "hub" / "models--org--split-GGUF" / "snapshots" / commit_of(
        "org/split-GGUF")
    assert snapshot_files(snapshot) == {"split-Q8_0-00001-of-00002.gguf",
                                        "split-Q8_0-00002-of-00002.gguf"}
    assert source.fmt == "gguf" and source.path.name == "split-Q8_0-00001-of-00002.gguf"
    assert [p.name for p in source.parts] == sorted(snapshot_files(snapshot))
    assert source.gguf_meta["general.name"] == "split-Q8_0-1"  # part 1's metadata
    assert source.model_config().num_layers == 6


@pytest.mark.parametrize("model, message", [
    ("org/nope", "no such local path, and no model org/nope on the Hugging Face hub \\(or "
                 "it is private and HF_TOKEN"),
    ("org/gated", "org/gated is gated: accept its terms on its hub page and set HF_TOKEN"),
    ("org/bin-only", "has neither \\*.safetensors nor .gguf files"),
    ("org/tiny:Q8_0", "org/tiny has no GGUF files, so a quantization tag does not apply"),
])
def test_hub_errors_say_what_is_wrong(fake_hub, tmp_path, monkeypatch, model, message):
    point_hub(monkeypatch, fake_hub[1], tmp_path / "hub")
    with pytest.raises(ModelLoadError, match=message):
        resolve_model(model)


def test_offline_without_the_model_in_the_cache(offline_cache):
    with pytest.raises(ModelLoadError, match="org/other is no local path and not in the "
                                             "Hugging Face cache .* HF_HUB_OFFLINE is set"):
        resolve_model("org/other")
    with pytest.raises(ModelLoadError, match="org/tiny-GGUF:Q4_K_S is no local path and "
                                             "not in the Hugging Face cache"):
        resolve_model("org/tiny-GGUF:Q4_K_S")  # listed, but never downloaded


def test_unreachable_hub(filled_cache, tmp_path, monkeypatch):
    point_hub(monkeypatch, DEAD_ENDPOINT, tmp_path / "empty")
    with pytest.raises(ModelLoadError, match="org/tiny is no local path and not in the Hugging "
                                             "Face cache .* the "
                                             "hub .* cannot be reached .*HF_HUB_OFFLINE=1"):
        resolve_model("org/tiny")
    point_hub(monkeypatch, DEAD_ENDPOINT, filled_cache)  # what the cache holds still loads
    assert resolve_model("org/tiny-GGUF:Q8_0").path.name == "tiny-Q8_0.gguf"


def test_a_local_path_wins_over_a_hub_id(tiny_with_tokenizer, tmp_path, monkeypatch):
    point_hub(monkeypatch, DEAD_ENDPOINT, tmp_path / "hub")
    (tmp_path / "org").mkdir()
    os.symlink(tiny_with_tokenizer, tmp_path / "org" / "tiny")
    monkeypatch.chdir(tmp_path)
    source = resolve_model("org/tiny")
    assert source.path == Path("org/tiny") and source.hub_id is None
    with pytest.raises(ModelLoadError, match="revision: applies to a Hugging Face repo id"):
        resolve_model("org/tiny", revision="main")


def test_served_model_name_is_the_hub_id_as_written(offline_cache):
    from swaserve.server.factory import default_model_name

    def name(model):
        return default_model_name(SimpleNamespace(source=resolve_model(model)))

    assert name("org/tiny") == "org/tiny"
    assert name("org/tiny-GGUF:Q8_0") == "org/tiny-GGUF:Q8_0"
    local = resolve_model("org/tiny-GGUF:Q8_0").path
    assert name(str(local)) == "tiny-Q8_0"
