"""DeepSeek-V4 against transformers' own DeepseekV4ForCausalLM's full forward, in float32 on
tiny random checkpoints (W = 8; C4 layers at rate 4 with an indexer that keeps 3 entries, so
it binds; C128-kind layers at rate 8; two hyper-connection streams; four experts, hashed in
the first layer): prompts of several windows under every chunking (the compressors' open
windows cut at every phase), ragged prefills under one budget, batched decode of mixed
lengths, n > 1 forks; where the indexer's scores tie, prompt logprobs and prefix hits
against a per-prefix reference with the ties settled. Then the compress state (a row's ring
never holds more than its span), the planner's bytes against what the cache allocates, and
the refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from swaserve import SamplingParams
from swaserve.memory.planner import plan_memory
from swaserve.models.config import ModelConfig
from tests.conftest import (
    TEST_DEVICE,
    drive,
    hf_greedy,
    hf_logits,
    random_prompt,
    run_logged,
    tiny_engine,
)
from tests.conftest import TINY_WINDOW as W
from tests.helpers.checkpoints import (
    DSV4_TYPES,
    write_byte_bpe_tokenizer,
    write_tiny_deepseek_v4,
)

TOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    return write_tiny_deepseek_v4(tmp_path_factory.mktemp("dsv4"))


@pytest.fixture(scope="module")
def dsv4_yarn(tmp_path_factory):
    """A YaRN-scaled compress RoPE, sigmoid routing, no hashed layer, its config.json
    rewritten in the legacy field names (compress_ratios, compress_rate_csa / _hca,
    num_hash_layers, qk_rope_head_dim) that DeepSeek's own configs use."""
    path, ref = write_tiny_deepseek_v4(
        tmp_path_factory.mktemp("dsv4_yarn"), seed=3, num_hidden_layers=4,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                     "sliding_attention", "compressed_sparse_attention"],
        mlp_layer_types=["moe"] * 4, scoring_func="sigmoid",
        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 64})
    file = f"{path}/config.json"
    with open(file) as fh:
        cfg = json.load(fh)
    for field in ("layer_types", "compress_rates", "mlp_layer_types", "partial_rotary_factor"):
        cfg.pop(field)
    cfg.update(compress_ratios=[4, 128, 0, 4], compress_rate_csa=4, compress_rate_hca=8,
               num_hash_layers=0, qk_rope_head_dim=8)
    with open(file, "w") as fh:
        json.dump(cfg, fh)
    return path, ref


def engine(path, **kw):
    """Pages of 8 tokens: a whole number of entries of both rates (4 and 8)."""
    return tiny_engine(path, **{"page_size": 8, "prefix_cache": False, **kw})


def run(eng, prompts, params):
    """`run_logged` with the pools checked after every step."""
    return run_logged(eng, prompts, params, check_integrity=True)


def worst(ref, prompt, tokens, logs) -> float:
    want = hf_logits(ref, prompt + tokens)
    return max((lg - want[len(prompt) - 1 + i]).abs().max().item() for i, lg in enumerate(logs))


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, W - 1, W, W + 1, 64])
def test_prompt_logits_match_transformers_under_every_chunking(dsv4, chunk):
    path, ref = dsv4
    prompts = [random_prompt(3 * W + 5, seed=1), random_prompt(6 * W + 3, seed=2)]
    for p, (tokens, logs) in zip(prompts, run(engine(path, chunk_size=chunk), prompts, GREEDY)):
        assert len(logs) == 4 and worst(ref, p, tokens, logs) < TOL


def test_legacy_fields_yarn_and_sigmoid_routing_match_transformers(dsv4_yarn):
    path, ref = dsv4_yarn
    assert ref.config.rope_parameters["compress"]["rope_type"] == "yarn"
    prompts = [random_prompt(7 * W + 1, seed=4)]
    for chunk in (5, 64):
        for p, (tokens, logs) in zip(prompts, run(engine(path, chunk_size=chunk), prompts,
                                                  GREEDY)):
            assert worst(ref, p, tokens, logs) < TOL


def test_batched_decode_of_mixed_lengths_is_each_alone_and_greedy_is_transformers(dsv4):
    path, ref = dsv4
    prompts = [random_prompt(3 * W + 5 + 9 * i, seed=10 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batched = run(engine(path, chunk_size=7), prompts, params)
    for p, (tokens, logs) in zip(prompts, batched):
        alone_tokens, alone_logs = run(engine(path, chunk_size=7), [p], params)[0]
        assert tokens == alone_tokens == hf_greedy(ref, p, 24)
        assert max((a - b).abs().max().item() for a, b in zip(logs, alone_logs)) < TOL
        assert worst(ref, p, tokens, logs) < TOL


def test_ragged_prefill_under_one_budget_matches_transformers(dsv4):
    """Four prompts under a 13-token budget: each step cuts them at different points, so
    prompt chunks of several requests and decode rows share steps."""
    path, ref = dsv4
    prompts = [random_prompt(n, seed=20 + n) for n in (3 * W + 5, 2 * W - 1, 7, W + 2)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for p, (tokens, logs) in zip(prompts, run(engine(path, chunk_size=13), prompts, params)):
        assert tokens == hf_greedy(ref, p, 10)
        assert worst(ref, p, tokens, logs) < TOL


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_n_forks_each_match_transformers(dsv4, prefix_cache):
    """n = 3 seeded samples of one prompt: the forks copy the parent's rings and compress
    state and share its entries' pages (with the prefix cache, its window pages too); every
    fork's rows are transformers' at its own tokens."""
    path, ref = dsv4
    p = random_prompt(4 * W + 6, seed=5)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    out = run(engine(path, chunk_size=16, prefix_cache=prefix_cache), [p], params)
    assert len(out) == 3 and len({tuple(t) for t, _ in out}) > 1
    for tokens, logs in out:
        assert worst(ref, p, tokens, logs) < TOL


def test_prefix_hits_equal_cold_runs(dsv4):
    """Prompts that share 2, 3 and 5 pages of an earlier 51-token prompt, and the whole of
    it: each hit restores the sliding ring and the compress rings at the page boundary and
    shares the entries' pages; tokens and logits are the cold run's and transformers'."""
    path, ref = dsv4
    eng = engine(path, chunk_size=5, prefix_cache=True)
    base = random_prompt(6 * W + 3, seed=30)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    run(eng, [base], params)
    for cut in (16, 24, 40, len(base)):
        hits = eng.cache.prefix.hit_tokens
        p = base[:cut] + random_prompt(9, seed=cut)
        (tokens, logs), = run(eng, [p], params)
        assert eng.cache.prefix.hit_tokens - hits == cut // 8 * 8
        (cold, cold_logs), = run(engine(path, chunk_size=5), [p], params)
        assert tokens == cold
        assert max((a - b).abs().max().item() for a, b in zip(logs, cold_logs)) < TOL
        assert worst(ref, p, tokens, logs) < TOL


@pytest.fixture(scope="module")
def dsv4_ties(tmp_path_factory):
    """W = 16, rates 4 and 16, an indexer of one head keeping 8 entries: relu leaves many
    entries' scores exactly 0, so equal scores straddle the top 8. (path, reference model,
    prompt, the reference's log-softmax at each prompt position run on its prefix alone)."""
    path, hf = write_tiny_deepseek_v4(
        tmp_path_factory.mktemp("dsv4_ties"), window=16, hidden_size=64, num_hidden_layers=6,
        layer_types=list(DSV4_TYPES) + ["sliding_attention"],
        mlp_layer_types=["hash_moe"] + ["moe"] * 5, index_topk=8, index_n_heads=1,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16})
    ref = earliest_entries_win_ties(hf)
    prompt = random_prompt(64, seed=40)
    per_prefix = torch.stack([torch.log_softmax(hf_logits(ref, prompt[:q + 1])[-1], -1)
                              for q in range(len(prompt))])
    # with ties settled the reference is causal: one forward over the prompt is the same
    assert (torch.log_softmax(hf_logits(ref, prompt), -1) - per_prefix).abs().max() < TOL
    return path, ref, prompt, per_prefix


def earliest_entries_win_ties(hf):
    """transformers' model with the indexer's equal scores ranked by entry, earliest first.
    Its own `topk` (like DeepSeek's code) orders ties by the width of the score row, the
    number of entries the forward computed, so a position's picks would depend on the
    tokens after it."""
    ref = copy.deepcopy(hf)
    for layer in ref.model.layers:
        indexer = getattr(layer.self_attn.compressor, "indexer", None)
        if indexer is None:
            continue

        def ranked(*args, score=indexer.scorer.forward):
            s = score(*args)
            order = s.argsort(dim=-1, descending=True, stable=True)
            rank = torch.empty_like(order).scatter_(
                -1, order, torch.arange(s.shape[-1]).expand_as(order).contiguous())
            return -rank.to(s.dtype)
        indexer.scorer.forward = ranked
    return ref


@pytest.mark.parametrize("chunk", [1, 5, 13, 16, 64])
def test_prompt_logprobs_are_each_prefix_run_alone_under_every_chunking(dsv4_ties, chunk):
    """Every prompt position's logprobs are the model's on that position's prefix, whatever
    the chunking (chunks of 5 and 13 cut the rate-4 and rate-16 windows at every phase)."""
    path, _, prompt, want = dsv4_ties
    eng = engine(path, chunk_size=chunk, page_size=16)
    out = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1,
                                                 prompt_logprobs=3))[0]
    drive(eng, check_integrity=True)
    for i in range(1, len(prompt)):
        assert prompt[i] in out.prompt_logprobs[i]
        for token, lp in out.prompt_logprobs[i].items():
            assert abs(lp - want[i - 1, token].item()) < TOL
    eng.release(out.request_id)


@pytest.mark.parametrize("chunk", [5, 13])
def test_prefix_hits_inside_compressed_blocks_equal_cold_runs(dsv4_ties, chunk):
    """A prompt extended by W + 5 tokens after its first run was cached: the hit (2 pages
    of 16) recomputes from mid-prompt in other chunks than the cold run, and its tokens and
    logits are the cold run's and the reference's."""
    path, ref, prompt, _ = dsv4_ties
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = prompt[:45]
    longer = base + random_prompt(16 + 5, seed=41)
    eng = engine(path, chunk_size=chunk, page_size=16, prefix_cache=True)
    run(eng, [base], params)
    hits = eng.cache.prefix.hit_tokens
    (tokens, logs), = run(eng, [longer], params)
    assert eng.cache.prefix.hit_tokens - hits == 32
    (cold, cold_logs), = run(engine(path, chunk_size=chunk, page_size=16), [longer], params)
    assert tokens == cold == hf_greedy(ref, longer, 8)
    assert max((a - b).abs().max().item() for a, b in zip(logs, cold_logs)) < TOL
    assert worst(ref, longer, tokens, logs) < TOL


def test_a_grammar_request_beside_plain_ones_through_the_offline_api(tmp_path):
    """A regex request shares a 13-token budget with greedy ones (LLM API, a byte-level
    tokenizer): its text matches and its tokens are what it gives alone; the greedy
    requests' tokens are transformers'."""
    import re

    from swaserve import LLM

    pytest.importorskip("llguidance")
    vocab = write_byte_bpe_tokenizer(tmp_path)
    path, ref = write_tiny_deepseek_v4(tmp_path, vocab_size=vocab)

    def llm():
        return LLM(path, dtype="float32", kv_memory="16MiB", max_running_requests=8,
                   page_size=8, chunk_size=13, device=TEST_DEVICE)
    regex = r"[0-9]{3}-[0-9]{4}"
    prompts = [random_prompt(n, seed=90 + i) for i, n in enumerate((3 * W + 5, 2 * W - 1, 7))]
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=30, regex=regex), GREEDY,
              GREEDY]
    outs = llm().generate(prompts, params)
    assert re.fullmatch(regex, outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[0].token_ids == llm().generate([prompts[0]], params[0])[0].token_ids
    for p, out in zip(prompts[1:], outs[1:]):
        assert out.token_ids == hf_greedy(ref, p, GREEDY.max_tokens)


def test_compress_ring_never_holds_more_than_its_span(dsv4):
    """After every step of a request of 12 windows, each compressed layer's ring holds at
    most `span` of its positions, the newest ones; sliding rings at most `ring`."""
    path, _ = dsv4
    eng = engine(path, chunk_size=5)
    req = eng.add_request(random_prompt(12 * W, seed=9), SamplingParams(
        temperature=0, max_tokens=3 * W, ignore_eos=True))[0]
    pool = eng.cache.compress
    seen = []

    def check(e) -> None:
        row = req.row
        if row is None:
            return
        done = req.num_computed_tokens
        for layer, state in pool.layers.items():
            held = pool.row_positions(layer, row)
            span = state.spec.span
            assert held.numel() <= span
            if done:
                assert int(held.max()) == done - 1 and int(held.min()) >= done - span
                seen.append(held.numel())
        window = e.cache.window
        pos = window.positions[row * window.ring:(row + 1) * window.ring]
        assert int((pos >= 0).sum()) <= window.ring

    drive(eng, check_integrity=True, each_step=check)
    assert seen and max(seen) == 2 * 4  # C4 layers fill their span of two windows
    eng.release(req.request_id)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_planner_bytes_are_what_the_cache_allocates(dsv4, prefix_cache):
    """Rings per row; entries and indexer keys with the pages, 1 / rate per token; with the
    prefix cache, window pages holding each cached token's K=V once and its raw state."""
    path, _ = dsv4
    eng = engine(path, kv_memory="4MiB", max_running_requests=3, max_model_len=256,
                 prefix_cache=prefix_cache)
    layout = eng.layout
    assert layout.compressed_layers == (1, 2, 3, 4)
    assert [layout.layers[i].compress.span for i in (1, 2)] == [8, 8]
    plan = plan_memory(layout, 4 * 2**20, 4, chunk_size=16, page_size=8, max_model_len=256,
                       max_running_requests=3,
                       window_cache_bytes=4 * 2**20 // 5 if prefix_cache else 0)
    assert plan == eng.plan and bool(plan.window_cache_pages) == prefix_cache
    assert plan.used_bytes == eng.cache.nbytes()
    # (16 + 8) * 4 B / 4 twice (C4), 16 * 4 B / 8 twice (C128); no full layer
    assert plan.full_bytes_per_token == 2 * 24 + 2 * 8
    tokens = plan.full_pool_tokens
    pool = eng.cache.compress
    assert pool.layers[1].entries.shape == (tokens // 4, 16)
    assert pool.layers[2].entries.shape == (tokens // 8, 16)
    assert pool.layers[1].index_entries.shape == (tokens // 4, 8)
    assert pool.layers[1].kv.shape == (3 * 8, 32)  # rings: rows x span, both halves


def test_page_size_must_hold_whole_entries(dsv4):
    with pytest.raises(ValueError, match="page_size"):
        engine(dsv4[0], page_size=4)  # the rate-8 layers' entries would span pages


def write_config(tmp_path, **fields):
    path, ref = write_tiny_deepseek_v4(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("field,value", [
    ("quantization_config", {"quant_method": "fp8", "fmt": "e4m3"}),
    ("scoring_func", "softmax"),
    ("n_shared_experts", 2),
    ("num_key_value_heads", 2),
    ("hidden_act", "gelu"),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0}),
])
def test_unimplemented_options_are_refused_by_field(tmp_path, field, value):
    path = write_config(tmp_path, **{field: value})
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    with pytest.raises(Exception, match=field):
        engine(path)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_ngram_drafts_on_and_off_give_the_same_tokens(dsv4, prefix_cache):
    """Repetitive prompts so that n-gram drafts are proposed, some accepted and most
    rejected: a rejected draft's ring writes land in the rings' draft room (span = needed +
    num_draft_tokens), its slots are forgotten and its entries rewritten before any query
    reads them, so the tokens are the plain run's and transformers' greedy."""
    path, ref = dsv4
    prompts = [random_prompt(6, seed=3) * 6, random_prompt(5, seed=1) * 7 + [5, 6]]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    spec = engine(path, chunk_size=8, speculative="ngram", num_draft_tokens=4,
                  prefix_cache=prefix_cache)
    assert spec.layout.layers[1].compress.span == 2 * 4 + 4
    drafted = run(spec, prompts, params)
    plain = run(engine(path, chunk_size=8), prompts, params)
    verified, accepted = spec.stats().draft_tokens
    assert verified > accepted > 0
    for p, (tokens, _), (plain_tokens, logs) in zip(prompts, drafted, plain):
        assert tokens == plain_tokens
        assert worst(ref, p, plain_tokens, logs) < TOL


def test_prefix_cache_is_refused_where_a_hit_could_not_restore_the_rings(tmp_path):
    """W = 4 < the 8 raw tokens a rate-8 layer may need: a hit restores only W positions."""
    path, _ = write_tiny_deepseek_v4(tmp_path, window=4)
    with pytest.raises(ValueError, match="prefix_cache"):
        engine(path, prefix_cache=True)
    engine(path)  # without it the checkpoint runs


def test_tp_is_refused(dsv4):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        engine(dsv4[0], tensor_parallel_size=2)


def test_plan_of_a_v4_flash_shaped_config(tmp_path):
    """`swaserve plan` on transformers' default DeepseekV4Config (V4-Flash's shapes: 43
    layers, 20 C4 and 23 C128, W = 128) in bf16, pages of 256, 64 rows, 64 GiB: ring
    accounting charges a token its entries only (20 x 320 + 23 x 8 B) and a request its
    rings; token-scaled accounting (SGLang's before its per-request rings, swa ratio 0.1)
    charges every token a tenth of its window KV and compress state too."""
    from transformers import DeepseekV4Config

    from swaserve.cli.plan import plan_report
    from swaserve.config import EngineConfig

    cfg = DeepseekV4Config()
    cfg.architectures = ["DeepseekV4ForCausalLM"]
    cfg.save_pretrained(str(tmp_path))
    config = EngineConfig(model=str(tmp_path), kv_memory="64GiB", page_size=256,
                          chunk_size=512, dtype="bfloat16", max_running_requests=64)
    rep = plan_report(config, context=131072, swa_ratio=0.1)
    acc, lay = rep["accounting"], rep["layers"]
    assert lay["ring"] == 768 and len(lay["compressed"]) == 43
    assert acc["ring"]["bytes_per_token"] == 20 * 320 + 23 * 8
    rings = 43 * 768 * 1024 + 768 * 8 + 20 * 8 * (2 * 1280 * 2 + 8) + 23 * 128 * (2 * 512 * 2 + 8)
    assert acc["ring"]["fixed_bytes_per_request"] == rings
    ratio = acc["ring"]["full_pool_tokens"] / acc["token_scaled"]["full_pool_tokens"]
    assert 1.95 < ratio < 2.05


def test_a_quantized_kv_cache_is_refused(dsv4):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine(dsv4[0], kv_cache_dtype="int8")
