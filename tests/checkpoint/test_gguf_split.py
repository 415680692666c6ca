"""GGUFs split into parts as llama.cpp's gguf-split writes them (tests/helpers/gguf_writer.py
split_gguf): loaded from any part or from their directory, they give the unsplit file's
config, weights (int8 blocks included), tokenizer and logits exactly; a missing, misnamed
or foreign part is a clear error."""

from __future__ import annotations

import os
import shutil

import gguf
import pytest
import torch

from swaserve import SamplingParams
from swaserve.checkpoint.source import ModelLoadError, resolve_model
from tests.checkpoint.test_gguf_families import FAMILIES
from tests.conftest import drive, random_prompt, tiny_engine
from tests.helpers.gguf_writer import MULTILINGUAL, byte_bpe_vocab, split_gguf, write_gguf


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(the unsplit GGUF, its parts split in two, its parts split in three with no tensors
    in part 1, the vocabulary): a Llama 3 of Q8_0 / Q6_K / Q5_0 / Q4_K / Q4_0 weights,
    rope_freqs and an untied head, so that part 1's tensors alone would give another
    config."""
    arch, build, spec, types, _ = FAMILIES["llama3"]
    vocab = byte_bpe_vocab(*spec)
    torch.manual_seed(7)
    model = build(vocab.size).eval()
    root = tmp_path_factory.mktemp("split")
    whole = root / "model.gguf"
    write_gguf(whole, model, arch, vocab, lambda name: types[name.split(".")[-2]])
    n = len(gguf.GGUFReader(str(whole)).tensors)
    (root / "two").mkdir()
    (root / "three").mkdir()
    two = split_gguf(whole, root / "two" / "model.gguf", (n + 1) // 2)
    three = split_gguf(whole, root / "three" / "model.gguf", (n + 1) // 2, empty_first=True)
    assert [p.name for p in three] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert len(two) == 2
    return whole, two, three, vocab


def _logits(model, vocab_size: int) -> list[torch.Tensor]:
    eng = tiny_engine(str(model), chunk_size=7)
    eng.logits_log = []
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(2):
        eng.add_request(random_prompt(13 + 9 * i, seed=i, vocab=vocab_size), params)
    drive(eng)
    return [lg for _, _, lg in eng.logits_log]


@pytest.mark.parametrize("how", ["first part", "last part", "directory"])
def test_split_logits_equal_the_unsplit_files(llama, how):
    whole, two, three, vocab = llama
    model = {"first part": two[0], "last part": three[-1], "directory": three[0].parent}[how]
    source = resolve_model(model)
    parts = two if how == "first part" else three
    assert source.path == parts[0] and source.parts == tuple(parts)
    unsplit = resolve_model(whole)
    assert source.hf_config == unsplit.hf_config
    assert source.gguf_meta["GGUF.tensor_types"] == unsplit.gguf_meta["GGUF.tensor_types"]
    want = _logits(whole, vocab.size)
    got = _logits(model, vocab.size)
    assert len(got) == len(want) == 8
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_split_weights_and_int8_blocks_equal_the_unsplit_files(llama):
    from swaserve.checkpoint.weights import iter_weights, load_q8_weights

    whole, _, three, _ = llama
    split, unsplit = resolve_model(three[1]), resolve_model(whole)
    assert split.cache_dir() != unsplit.cache_dir()
    got, want = dict(iter_weights(split, torch.float32)), dict(iter_weights(unsplit, torch.float32))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    q8_got, q8_want = load_q8_weights(split, 2), load_q8_weights(unsplit, 2)
    assert q8_got.keys() == q8_want.keys() and {"lm_head", "0.qkv", "1.o"} <= q8_got.keys()
    assert all(torch.equal(q8_got[k].dequantize(), q8_want[k].dequantize()) for k in q8_want)


def test_the_cache_is_keyed_by_every_part(llama, tmp_path):
    _, two, _, _ = llama
    for p in two:
        shutil.copy(p, tmp_path / p.name)
    before = resolve_model(tmp_path / two[0].name).cache_dir()
    last = tmp_path / two[-1].name
    st = last.stat()
    os.utime(last, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert resolve_model(tmp_path / two[0].name).cache_dir() != before


def test_split_tokenizer_is_the_unsplit_files(llama):
    from swaserve.checkpoint.tokenizer import load_tokenizer

    _, _, three, vocab = llama
    tok = load_tokenizer(resolve_model(three[2]))
    want = vocab.tokenizer.encode(MULTILINGUAL, add_special_tokens=False).ids
    assert tok.encode(MULTILINGUAL) == [vocab.bos] + want
    assert tok.eos_token_ids == (vocab.eos,)


def _copy(parts, into, skip=()) -> None:
    into.mkdir(exist_ok=True)
    for i, p in enumerate(parts):
        if i + 1 not in skip:
            shutil.copy(p, into / p.name)


def test_a_missing_part_is_named(llama, tmp_path):
    _, _, three, _ = llama
    _copy(three, tmp_path / "no2", skip=(2,))
    with pytest.raises(ModelLoadError, match=r"part 2 of 3 of the split GGUF is missing: "
                                             r".*no2/model-00002-of-00003\.gguf"):
        resolve_model(tmp_path / "no2" / three[0].name)
    _copy(three, tmp_path / "no1", skip=(1,))
    with pytest.raises(ModelLoadError, match=r"part 1 of 3 .* missing: .*model-00001-of-00003"):
        resolve_model(tmp_path / "no1")  # the directory: its other parts find part 1


def test_a_misnamed_or_foreign_part_is_a_clear_error(llama, tmp_path):
    _, two, three, _ = llama
    shutil.copy(three[0], tmp_path / "model.gguf")
    with pytest.raises(ModelLoadError, match="part 1 of a GGUF split into 3 files, but not "
                                             "named NAME-00001-of-00003.gguf"):
        resolve_model(tmp_path / "model.gguf")
    _copy(three, tmp_path / "mixed", skip=(2,))
    shutil.copy(two[1], tmp_path / "mixed" / three[1].name)  # part 2 of the other split
    with pytest.raises(ModelLoadError, match="its metadata says part 2 of 2, its name part 2 "
                                             "of 3"):
        resolve_model(tmp_path / "mixed")
