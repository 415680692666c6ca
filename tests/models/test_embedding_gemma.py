"""EmbeddingGemma: a tiny checkpoint written by transformers (Gemma3TextModel with
bidirectional attention) with sentence-transformers' modules beside it (mean pooling, two
dense layers, Normalize) embeds as transformers' model pooled the same way and as
`SentenceTransformer(dir).encode`, to 1e-5 in float32: prompts past the sliding window,
batches of mixed lengths, any slicing of a batch. Decoder models embed by their last token
or mean; embedding never touches the KV cache, and generation beside it is unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swaserve.engine.engine import Engine
from swaserve.sampling.params import SamplingParams
from tests.conftest import TEST_DEVICE, drive, random_prompt
from tests.helpers.embeddings import WINDOW, write_embedding_gemma

TOL = 1e-5
TEXTS = ["hello world", "abc " * 12, '{"name": "abc", "age": 12, "tags": ["x", "y"]}',
         "true false null " * 9, "[1, 2, 3.5]"]


@pytest.fixture(scope="module")
def gemma_embed(tmp_path_factory):
    path = tmp_path_factory.mktemp("embedding_gemma")
    return str(path), write_embedding_gemma(path)


@pytest.fixture(scope="module")
def engine(gemma_embed):
    return Engine(model=gemma_embed[0], dtype="float32", device=TEST_DEVICE,
                  kv_memory="16MiB", chunk_size=32)


@pytest.fixture(scope="module")
def sentence_model(gemma_embed):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(gemma_embed[0], device="cpu")


def hf_pooled(ref, path, ids: list[int], mode: str = "mean") -> torch.Tensor:
    """transformers' last hidden state of `ids`, pooled by `mode`, through the checkpoint's
    Dense layers, L2-normalized."""
    from safetensors.torch import load_file

    with torch.no_grad():
        h = ref(torch.tensor([ids])).last_hidden_state[0]
    x = h.mean(0) if mode == "mean" else h[0] if mode == "cls" else h[-1]
    for folder in ("2_Dense", "3_Dense"):
        x = F.linear(x, load_file(f"{path}/{folder}/model.safetensors")["linear.weight"])
    return F.normalize(x, dim=-1)


def test_hidden_states_are_transformers(gemma_embed, engine):
    """The encoder's rows are transformers' last_hidden_state, bidirectional on the full
    layers and within half the window either side on the sliding ones."""
    path, ref = gemma_embed
    prompts = [random_prompt(n, seed=n, vocab=300)
               for n in (1, WINDOW // 2, WINDOW + 1, 5 * WINDOW + 3)]
    got = engine.embedder.encoder(prompts)
    for ids, h in zip(prompts, got):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).last_hidden_state[0]
        assert (h.cpu() - want).abs().max().item() < TOL


def test_attention_is_bidirectional(engine):
    """A later token changes the first token's state (a causal model's would not)."""
    a = random_prompt(12, seed=1, vocab=300)
    b = a[:-1] + [(a[-1] + 1) % 300 or 3]
    ha, hb = engine.embedder.encoder([a, b])
    assert (ha[0] - hb[0]).abs().max().item() > 1e-4


def test_embeddings_are_sentence_transformers(gemma_embed, engine, sentence_model):
    """A batch of mixed lengths, past the window, equals SentenceTransformer.encode and
    transformers' model pooled by hand; token ids give what their text gives."""
    path, ref = gemma_embed
    got = torch.tensor(engine.embed(TEXTS))
    want = torch.tensor(sentence_model.encode(TEXTS))
    assert got.shape == want.shape == (len(TEXTS), 32)
    assert (got - want).abs().max().item() < TOL
    ids = [engine.tokenize(t) for t in TEXTS]
    assert max(len(i) for i in ids) > WINDOW
    for i, v in zip(ids, got):
        assert (v - hf_pooled(ref, path, i)).abs().max().item() < TOL
    assert torch.tensor(engine.embed(ids)).sub(got).abs().max().item() < TOL
    assert engine.cache.is_fully_free()
    engine.check_integrity()


def test_slices_keep_the_token_budget(gemma_embed, monkeypatch):
    """Prompts run in slices of at most chunk_size tokens (one longer prompt alone), in
    order, and give what one batch gives."""
    eng = Engine(model=gemma_embed[0], dtype="float32", device=TEST_DEVICE,
                 kv_memory="16MiB", chunk_size=20)
    ids = [random_prompt(n, seed=n, vocab=300) for n in (7, 9, 6, 30, 3, 12, 12)]
    whole = eng.embedder.encoder(ids)
    seen, real = [], eng.embedder.encoder.__call__

    def spy(prompts):
        seen.append([len(p) for p in prompts])
        return real(prompts)

    monkeypatch.setattr(eng.embedder, "encoder", spy)
    done = []
    eng.add_embedding(ids[:3], done.append)
    eng.add_embedding(ids[3:], done.append)
    drive(eng)
    assert seen == [[7, 9], [6], [30], [3, 12], [12]]
    assert len(done) == 2 and all(j.error is None for j in done)
    vectors = done[0].vectors + done[1].vectors
    for v, h in zip(vectors, whole):
        assert (torch.tensor(v) - eng.embedder.pooler(h).cpu()).abs().max().item() < TOL


def test_pooling_option_and_errors(gemma_embed):
    """`pooling` replaces the checkpoint's mode; bad input names `input`; an embedding
    model does not generate."""
    path, ref = gemma_embed
    eng = Engine(model=path, dtype="float32", device=TEST_DEVICE, kv_memory="16MiB",
                 pooling="cls", max_model_len=64)
    ids = eng.tokenize(TEXTS[1])
    [v] = eng.embed([ids])
    assert (torch.tensor(v) - hf_pooled(ref, path, ids, "cls")).abs().max().item() < TOL
    for bad in ([], [[]], [[5] * 65], [[10**6]]):
        with pytest.raises(ValueError, match="^input:"):
            eng.embed(bad)
    with pytest.raises(ValueError, match="^model:"):
        eng.add_request([5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="^pooling:"):
        Engine(model=path, dtype="float32", pooling="max")


def test_decoder_model_embeds_by_last_token(tiny_hybrid):
    """A causal model with no sentence-transformers modules: its final-normed last (or
    mean) hidden state, L2-normalized; generation beside embeddings gets the tokens it gets
    alone, and the cache is whole afterwards."""
    path, ref = tiny_hybrid
    prompts = [random_prompt(n, seed=n) for n in (3, 2 * 8 + 1, 40)]
    eng = Engine(model=path, dtype="float32", device=TEST_DEVICE, kv_memory="16MiB",
                 chunk_size=16)
    got = eng.embed(prompts)
    for ids, v in zip(prompts, got):
        with torch.no_grad():
            h = ref.model(torch.tensor([ids])).last_hidden_state[0]
        assert (torch.tensor(v) - F.normalize(h[-1], dim=-1)).abs().max().item() < TOL
    mean = Engine(model=path, dtype="float32", device=TEST_DEVICE, kv_memory="16MiB",
                  pooling="mean").embed(prompts[:1])
    with torch.no_grad():
        h = ref.model(torch.tensor([prompts[0]])).last_hidden_state[0]
    assert (torch.tensor(mean[0]) - F.normalize(h.mean(0), dim=-1)).abs().max().item() < TOL

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [alone] = eng.add_request(prompts[2], params)
    drive(eng)
    [beside] = eng.add_request(prompts[2], params)
    jobs = []
    for _ in range(6):  # an embedding request lands before each of the first steps
        jobs.append(eng.add_embedding(prompts, None))
        eng.step()
        eng.check_integrity()
    drive(eng, check_integrity=True)
    assert beside.output_token_ids == alone.output_token_ids
    assert all(j.finished and j.error is None for j in jobs)
    for v, w in zip(jobs[-1].vectors, got):
        assert (torch.tensor(v) - torch.tensor(w)).abs().max().item() < TOL
    assert eng.cache.is_fully_free()
