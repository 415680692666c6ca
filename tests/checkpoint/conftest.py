"""What the hub tests share: a stand-in hub serving tiny repos (tests/helpers/hub.py), a
cache huggingface_hub fills from it once, and `point_hub`, which aims huggingface_hub at an
endpoint and a cache (its settings are read from the environment at import, so the tests
set them where it keeps them)."""

from __future__ import annotations

import pytest

from tests.helpers.hub import FakeHub, directory_files, tiny_gguf_bytes

DEAD_ENDPOINT = "http://127.0.0.1:9"  # the discard port: nothing answers
QUANTS = ("Q4_K_M", "Q4_K_S", "Q4_K", "Q8_0")


def point_hub(mp: pytest.MonkeyPatch, endpoint: str, cache, offline: bool = False) -> None:
    from huggingface_hub import constants

    mp.setattr(constants, "ENDPOINT", endpoint)
    mp.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
               endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    mp.setattr(constants, "HF_HUB_CACHE", str(cache))
    mp.setattr(constants, "HF_HUB_OFFLINE", offline)
    mp.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    mp.delenv("HF_TOKEN", raising=False)


@pytest.fixture(scope="module")
def fake_hub(tiny_with_tokenizer, tmp_path_factory):
    """(FakeHub, its URL): the tiny model as org/tiny (beside files swaserve does not
    read), GGUF repos of several quantizations, one GGUF, a split GGUF, a gated copy of
    org/tiny and a repo of .bin weights only."""
    tmp = tmp_path_factory.mktemp("hub_files")
    tiny = directory_files(tiny_with_tokenizer)
    split = {f"split-Q8_0-0000{i}-of-00002.gguf":
             tiny_gguf_bytes(tmp, f"split-Q8_0-{i}", split=(i - 1, 2)) for i in (1, 2)}
    repos = {
        "org/tiny": {**tiny, "README.md": b"# tiny", "pytorch_model.bin": b"not read",
                     "onnx/model.safetensors": b"not read"},
        "org/tiny-GGUF": {**{f"tiny-{q}.gguf": tiny_gguf_bytes(tmp, f"tiny-{q}")
                             for q in QUANTS},
                          "mmproj-tiny-Q8_0.gguf": b"not read", "README.md": b"# gguf"},
        "org/one-GGUF": {"one-Q8_0.gguf": tiny_gguf_bytes(tmp, "one-Q8_0")},
        "org/split-GGUF": split,
        "org/gated": tiny,
        "org/bin-only": {"config.json": tiny["config.json"], "pytorch_model.bin": b"x"},
    }
    hub = FakeHub(repos, gated=frozenset({"org/gated"}))
    with hub.serving() as url:
        yield hub, url


@pytest.fixture(scope="module")
def filled_cache(fake_hub, tmp_path_factory):
    """A hub cache huggingface_hub filled from the stand-in with org/tiny, org/one-GGUF and
    org/tiny-GGUF's Q8_0 and default quantizations."""
    from swaserve.checkpoint.source import resolve_model

    cache = tmp_path_factory.mktemp("hf_home") / "hub"
    with pytest.MonkeyPatch.context() as mp:
        point_hub(mp, fake_hub[1], cache)
        for model in ("org/tiny", "org/tiny-GGUF:Q8_0", "org/tiny-GGUF", "org/one-GGUF"):
            resolve_model(model)
    return cache


@pytest.fixture
def offline_cache(filled_cache, monkeypatch):
    """The filled cache with HF_HUB_OFFLINE set and no hub to reach."""
    point_hub(monkeypatch, DEAD_ENDPOINT, filled_cache, offline=True)
    return filled_cache
