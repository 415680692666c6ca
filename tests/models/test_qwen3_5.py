"""Qwen3.5 text models against transformers' own Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM, in
float32 on tiny random checkpoints (8 layers: three Gated DeltaNet layers to each gated
full-attention layer; the MoE one with 4 experts beside a shared one): prompt logits under
chunkings 1, 7, 64, ragged prefills under one token budget, batched decode of mixed lengths
equal to each alone and to transformers' greedy tokens, n = 3 forks, retraction under a tiny
pool, bf16, batch-invariant mode, overlap scheduling, prompt logprobs, embeddings, a grammar.
Then the state pool (reset for new rows only, one slot per row per recurrent layer),
speculative drafts (scripted accept/reject patterns leave every state slot equal to a
non-speculative run's; n-gram drafts on and off give the same tokens), prefix hits through
state checkpoints (at, between and past them, equal to cold runs; LRU under a small
budget), the planner (its bytes are what the cache holds; `swaserve plan` on Qwen3.5-0.8B-
and -27B-shaped configs) and the refusals (config fields, GGUF, tensor parallelism, MLX).
The engine fuzz over this model is tests/models/test_qwen3_5_fuzz.py."""

from __future__ import annotations

import json

import pytest
import torch

from swaserve import SamplingParams
from swaserve.checkpoint.shard import local_config
from swaserve.models.config import ModelConfig
from tests.conftest import (
    TEST_DEVICE,
    drive,
    hf_logits,
    random_prompt,
    run_logged,
    run_logging_logits,
    tiny_engine,
)
from tests.helpers.checkpoints import write_tiny_qwen3_5

TOL = 1e-4


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return write_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5_moe"), seed=1, moe=True)


@pytest.fixture(params=["dense", "moe"])
def qwen(request):
    return request.getfixturevalue(request.param)


def engine(path, **kw):
    """A tiny engine without the prefix cache: what a cold run computes."""
    return tiny_engine(path, **{"prefix_cache": False, **kw})


def run(eng, prompts, params):
    """`run_logged` with the pools checked after every step."""
    return run_logged(eng, prompts, params, check_integrity=True)


def max_err(logs, want, offset):
    return max((lg - want[offset + i]).abs().max().item() for i, lg in enumerate(logs))


def hf_greedy(ref, prompt, tokens):
    """transformers' greedy continuation, where it is `tokens`: each token is the argmax of
    transformers' logits after the prompt and the tokens before it (one forward; its
    token-by-token loop takes ~0.2 s a token here)."""
    want = hf_logits(ref, prompt + tokens)
    return [int(want[len(prompt) - 1 + i].argmax()) for i in range(len(tokens))]


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prompt_logits_match_transformers_under_every_chunking(qwen, chunk):
    """Prompts of 3x the chunk size and more (and past transformers' 64-token blocks)."""
    path, ref = qwen
    n = max(3 * chunk + 5, 70)
    prompts = [random_prompt(n, seed=1), random_prompt(n + 61, seed=2)]
    for p, (tokens, logs) in zip(prompts, run(engine(path, chunk_size=chunk), prompts, GREEDY)):
        assert len(logs) == GREEDY.max_tokens
        assert max_err(logs, hf_logits(ref, p + tokens), len(p) - 1) < TOL


def test_batched_decode_of_mixed_lengths_is_each_alone_and_greedy_is_transformers(qwen):
    path, ref = qwen
    prompts = [random_prompt(40 + 23 * i, seed=10 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    batched = run(engine(path, chunk_size=7), prompts, params)
    for p, (tokens, logs) in zip(prompts, batched):
        alone_tokens, alone_logs = run(engine(path, chunk_size=7), [p], params)[0]
        assert tokens == alone_tokens == hf_greedy(ref, p, tokens)
        assert max((a - b).abs().max().item() for a, b in zip(logs, alone_logs)) < TOL
        assert max_err(logs, hf_logits(ref, p + tokens), len(p) - 1) < TOL


RAGGED = [3 * 13 + 5, 2 * 13 - 1, 7, 15]  # cut by a budget of 13 at different points


def test_ragged_prefill_under_one_budget_and_a_late_arrival_match_transformers(qwen):
    """Four prompts arrive together under a 13-token budget, so each step cuts them at
    different points (several runs of one step from different rows, one-token ones among
    them); a fifth arrives while they decode. Every sampled row is transformers' full
    forward at that position: no state leaks between rows."""
    path, ref = qwen
    prompts = [random_prompt(n, seed=80 + i) for i, n in enumerate(RAGGED)]
    late = random_prompt(29, seed=85)
    eng = engine(path, chunk_size=13)
    eng.logits_log = []
    reqs = [eng.add_request(p, GREEDY)[0] for p in prompts]
    seen = [0] * len(reqs)
    cuts = []

    def count(_):
        now = [r.num_computed_tokens for r in reqs]
        cuts.append(sum(b > a and a < r.num_prompt_tokens for a, b, r in zip(seen, now, reqs)))
        seen[:] = now
    drive(eng, until=lambda: reqs[0].num_output_tokens > 1, each_step=count)
    reqs.append(eng.add_request(late, GREEDY)[0])
    prompts.append(late)
    drive(eng, check_integrity=True)
    assert max(cuts) >= 2
    for p, r in zip(prompts, reqs):
        logs = [lg for rid, _, lg in eng.logits_log if rid == r.request_id]
        assert len(logs) == GREEDY.max_tokens
        assert max_err(logs, hf_logits(ref, p + r.output_token_ids), len(p) - 1) < TOL
    for r in reqs:
        eng.release(r.request_id)
    eng.check_integrity()


def test_three_forks_follow_their_seeds(dense):
    """n = 3: the siblings copy the parent's state after the prompt, then each follows its
    own seed as a single request would."""
    path, _ = dense
    eng = tiny_engine(path, state_checkpoint_interval=16)  # later runs hit the first's
    prompt = random_prompt(45, seed=4)
    params = SamplingParams(temperature=1.0, top_k=20, seed=11, n=3, max_tokens=12,
                            ignore_eos=True)
    forks = [tokens for tokens, _ in run(eng, [prompt], params)]
    for i, tokens in enumerate(forks):
        single = SamplingParams(temperature=1.0, top_k=20, seed=11 + i, max_tokens=12,
                                ignore_eos=True)
        assert tokens == run(eng, [prompt], single)[0][0]
    assert len({tuple(t) for t in forks}) > 1
    assert eng.cache.prefix.hit_tokens > 0


def test_retraction_and_readmission_under_a_tiny_pool(dense):
    """A pool too small for every request at once retracts the newest; each recomputes
    from a fresh state when admitted again and gives the tokens it gives alone."""
    path, ref = dense
    prompts = [random_prompt(30 + 7 * i, seed=20 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eng = engine(path, kv_memory=None, max_running_requests=4, chunk_size=16)
    # room for the full layers' KV of ~2 requests: 2 layers x 2 x 2 heads x 16 x 4 bytes
    # a token, so that growing decodes retract the newest
    eng = engine(path, max_running_requests=4, chunk_size=16,
                 kv_memory=str(4 * eng.plan.fixed_bytes_per_row + 24 * 4 * 512))
    out = run(eng, prompts, params)
    assert eng.scheduler.num_preemptions > 0
    for p, (tokens, _) in zip(prompts, out):
        assert len(tokens) == 24 and tokens == hf_greedy(ref, p, tokens)


def _row_state(eng, row):
    return [t[row].clone() for t in eng.cache.state.buffers]


def _record_states(eng, reqs, states):
    """After a step: each running request's row state has taken in exactly the tokens its
    request has computed; keep it by (request, tokens)."""
    pool = eng.cache.state
    for i, r in enumerate(reqs):
        if r.row is not None and not r.is_finished:
            assert pool.consumed[r.row] == r.num_computed_tokens
            states[(i, r.num_computed_tokens)] = _row_state(eng, r.row)


# (draft length, how many of its tokens are right): all, none, some, at the last one
PATTERNS = [(3, 3), (3, 0), (4, 2), (2, 1), (1, 1), (4, 4), (3, 1), (1, 0), (4, 3)]


def test_scripted_drafts_leave_every_state_slot_as_a_plain_run(dense):
    """Drafts whose first `a` tokens are the plain run's next tokens and the rest wrong, two
    requests drafting in the same steps: the tokens are the plain run's, and after every
    step each row's conv windows and recurrent matrices equal the plain run's after the
    same number of tokens (the accepted position's snapshot, never a rejected token's)."""
    path, _ = dense
    prompts = [random_prompt(30, seed=40), random_prompt(17, seed=41)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    plain = engine(path, chunk_size=8)
    reqs = [plain.add_request(p, params)[0] for p in prompts]
    want_states: dict = {}
    drive(plain, each_step=lambda e: _record_states(e, reqs, want_states))
    want = [r.output_token_ids for r in reqs]

    spec = tiny_engine(path, chunk_size=8, speculative="ngram", num_draft_tokens=4)
    sreqs = [spec.add_request(p, params)[0] for p in prompts]
    step = iter(range(10**6))

    def scripted(running):
        out = {}
        for i, r in enumerate(sreqs):
            n = r.num_output_tokens
            if r.is_finished or r.num_uncomputed_tokens != 1 or n == 0:
                continue
            d, a = PATTERNS[(next(step) + i) % len(PATTERNS)]
            d = min(d, r.max_new_tokens - r.num_generated - 1)
            if d <= 0:
                continue
            right = want[i][n:n + d]
            out[r.request_id] = right[:a] + [(t + 1) % 128 for t in right[a:]]
        return out
    spec.speculator.drafts = scripted
    got_states: dict = {}
    drive(spec, each_step=lambda e: _record_states(e, sreqs, got_states), check_integrity=True)
    assert [r.output_token_ids for r in sreqs] == want
    assert spec.speculator.stats.proposed > spec.speculator.stats.accepted > 0
    assert len(got_states) > 10
    for key, state in got_states.items():
        assert key in want_states
        for a, b in zip(state, want_states[key]):
            assert (a.float() - b.float()).abs().max().item() < 1e-5


def test_ngram_drafts_on_and_off_give_the_same_tokens(qwen):
    path, _ = qwen
    prompts = [[4, 5, 6] * 10, random_prompt(9, seed=5) * 4]  # repeats: drafts find matches
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = tiny_engine(path, speculative="ngram")
    spec.speculator.gate.allow = lambda n: True  # a tiny model's timings are noise
    with_drafts, logs = run_logging_logits(spec, prompts, params)
    without, plain_logs = run_logging_logits(engine(path), prompts, params)
    assert with_drafts == without
    assert spec.speculator.stats.proposed > 0
    for a, b in zip(logs, plain_logs):  # by position: a rejected row's is computed again
        a, b = dict(a), dict(b)
        assert a.keys() == b.keys()
        assert max((a[p] - b[p]).abs().max().item() for p in a) < TOL


def _warm(path, **kw):
    """An engine with the prefix cache, checkpoints every 16 tokens (pages of 4), that
    has run one 70-token prompt for 10 tokens: checkpoints at 16, 32, 48, 64 and at the
    prompt's last page boundary 68; the output's pages cached with none."""
    eng = tiny_engine(path, chunk_size=7, state_checkpoint_interval=16, **kw)
    p = random_prompt(70, seed=70)
    (out, _), = run(eng, [p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    return eng, p, out


HIT_PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("case,hit", [("at", 48), ("between", 48), ("prompt", 68),
                                      ("same", 68), ("past", 68)])
def test_prefix_hit_restores_a_checkpoint_and_equals_a_cold_run(dense, case, hit):
    """A hit at a checkpoint, between two (it backs off to the one before), at the
    prompt's end, on the same prompt again, and past the last checkpoint (into the cached
    output): the state is restored from the deepest checkpoint on the matched path, the
    rest recomputed, and every token and logits row is a cold run's."""
    path, _ = dense
    eng, p, out = _warm(path)
    q = {"at": p[:48], "between": p[:57], "prompt": p, "same": p, "past": p + out}[case]
    q = q if case == "same" else q + random_prompt(5, seed=71)
    eng.logits_log = []
    req = eng.add_request(q, HIT_PARAMS)[0]
    drive(eng, check_integrity=True)
    assert req.num_cached_tokens == hit
    hit_logs = [lg for _, _, lg in eng.logits_log]
    (cold, cold_logs), = run(engine(path, chunk_size=7), [q], HIT_PARAMS)
    assert req.output_token_ids == cold
    assert max((a - b).abs().max().item() for a, b in zip(hit_logs, cold_logs)) < TOL
    eng.release(req.request_id)
    assert eng.cache.is_fully_free()


def test_checkpoints_are_taken_where_they_should_be_and_freed_with_their_nodes(dense):
    path, _ = dense
    eng, p, out = _warm(path)
    prefix = eng.cache.prefix
    have = sorted(4 * depth for depth, n in _depths(prefix) if n.state is not None)
    assert have == [16, 32, 48, 64, 68]
    eng.check_integrity()
    eng.cache.evict_all()
    assert eng.cache.state.checkpoints.num_free == eng.cache.state.checkpoints.num_pages
    eng.check_integrity()


def _depths(prefix):
    stack = [(1, n) for n in prefix.root.children.values()]
    while stack:
        d, n = stack.pop()
        yield d, n
        stack.extend((d + 1, c) for c in n.children.values())


def test_a_small_checkpoint_budget_drops_the_least_recently_used(dense):
    """Room for 3 checkpoints: later prompts take the slots of the oldest unlocked ones;
    hits still equal cold runs and the pools stay whole."""
    path, _ = dense
    eng = tiny_engine(path, chunk_size=7, state_checkpoint_interval=16)
    slot = eng.plan.state_slot_bytes
    eng = tiny_engine(path, chunk_size=7, state_checkpoint_interval=16,
                      state_cache_memory=str(3 * slot))
    assert eng.cache.state.checkpoints.num_pages == 3
    prompts = [random_prompt(40, seed=90 + i) for i in range(3)]
    for p in prompts:
        run(eng, [p], HIT_PARAMS)
    # each prompt asks for 16, 32, 36 (its last page boundary before its last token) and
    # 40; the last prompt's first three took the slots of the older prompts' checkpoints
    assert eng.cache.state.checkpoints.num_free == 0
    held = sorted((d, n.tokens) for d, n in _depths(eng.cache.prefix) if n.state is not None)
    last = prompts[2]
    assert held == [(d, tuple(last[4 * d - 4:4 * d])) for d in (4, 8, 9)]
    q = last[:37] + random_prompt(3, seed=99)
    eng.logits_log = []
    req = eng.add_request(q, HIT_PARAMS)[0]
    drive(eng, check_integrity=True)
    assert req.num_cached_tokens == 36
    (cold, _), = run(engine(path, chunk_size=7), [q], HIT_PARAMS)
    assert req.output_token_ids == cold


@pytest.mark.parametrize("kw", [dict(prefix_cache=False), dict(),
                                dict(speculative="ngram", num_draft_tokens=3)])
def test_the_state_pool_is_one_slot_a_row_a_layer_and_the_plan_is_what_the_cache_holds(
        dense, kw):
    path, _ = dense
    eng = tiny_engine(path, **kw)
    lay, cache, plan = eng.layout, eng.cache, eng.plan
    assert lay.recurrent_layers == (0, 1, 2, 4, 5, 6) and lay.full_layers == (3, 7)
    assert [lay.dense_index(i) for i in (3, 4, 7)] == [0, 3, 1]
    pool = cache.state
    assert len(pool.conv) == len(pool.ssm) == 6
    # conv window: q, k (2 heads x 8) and v (4 heads x 8) channels, kernel 4 - 1 taps;
    # state: 4 value heads x 8 x 8, float32
    assert all(tuple(c.shape[1:]) == (64, 3) and c.dtype == torch.float32 for c in pool.conv)
    assert all(tuple(s.shape[1:]) == (4, 8, 8) and s.dtype == torch.float32 for s in pool.ssm)
    slot = 6 * (64 * 3 * 4 + 4 * 8 * 8 * 4)
    assert plan.state_slot_bytes == slot == pool.slot_bytes()
    assert plan.draft_state_slots == (kw.get("speculative") is not None) * (16 - 1)
    assert (plan.state_checkpoint_slots > 0) == kw.get("prefix_cache", True)
    assert pool.num_slots == plan.num_rows + plan.draft_state_slots + plan.state_checkpoint_slots
    assert plan.fixed_bytes_per_row == slot + 8 * eng.max_model_len  # state + r2t row
    assert plan.used_bytes == cache.nbytes()
    assert eng.cache.window is None and cache.full is not None


def test_new_rows_start_from_zeros_and_continuations_keep_their_state(dense):
    """The alloc hook zeroes a new row's slots (a finished request's state never leaks
    into the next) and is not called for a chunked continuation."""
    path, _ = dense
    eng = engine(path, chunk_size=5)
    pool = eng.cache.state
    resets = []
    real = pool.reset_rows
    pool.reset_rows = lambda rows: (resets.append(list(rows)), real(rows))[1]
    eng.cache.rows._hooks = [h if h != real else pool.reset_rows for h in eng.cache.rows._hooks]
    a = eng.add_request(random_prompt(23, seed=1), GREEDY)[0]
    drive(eng)
    assert resets == [[a.row if a.row is not None else resets[0][0]]]
    row = resets[0][0]
    assert any(t[row].abs().sum() > 0 for t in pool.buffers)  # a finished row keeps bytes
    b = eng.add_request(random_prompt(11, seed=2), GREEDY)[0]
    eng.step()
    assert len(resets) == 2 and b.row == resets[1][0] == row  # the same row, zeroed first
    drive(eng)
    (alone, _), = run(engine(path, chunk_size=5), [random_prompt(11, seed=2)], GREEDY)
    assert b.output_token_ids == alone


QWEN35_08B = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "tie_word_embeddings": True, "text_config": {
                  "model_type": "qwen3_5_text", "hidden_size": 1024,
                  "intermediate_size": 3584, "num_hidden_layers": 24,
                  "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
                  "linear_num_key_heads": 16, "linear_num_value_heads": 16,
                  "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                  "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
                  "vocab_size": 248_320, "max_position_embeddings": 262_144,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000,
                                      "partial_rotary_factor": 0.25,
                                      "mrope_section": [11, 11, 10], "mrope_interleaved": True}}}
QWEN35_27B = json.loads(json.dumps(QWEN35_08B))
QWEN35_27B["tie_word_embeddings"] = False
QWEN35_27B["text_config"].update(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                                 num_attention_heads=24, num_key_value_heads=4,
                                 linear_num_value_heads=48)


@pytest.mark.parametrize("name,cfg,gdn,full,hv", [("0.8b", QWEN35_08B, 18, 6, 16),
                                                  ("27b", QWEN35_27B, 48, 16, 48)])
def test_plan_of_qwen3_5_shaped_configs(tmp_path, capsys, name, cfg, gdn, full, hv):
    from swaserve.cli import main
    from swaserve.cli.plan import plan_report
    from swaserve.config import EngineConfig

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = EngineConfig(model=str(tmp_path), kv_memory="16GiB", dtype="bf16")
    rep = plan_report(config, context=32768)
    rec, acc = rep["recurrent"], rep["accounting"]
    assert len(rec["layers"]) == gdn and len(rep["layers"]["full"]) == full
    channels = 2 * 16 * 128 + hv * 128
    state = gdn * (channels * 3 * 2 + hv * 128 * 128 * 4)
    assert rec["state_bytes_per_request"] == state
    assert acc["ring"]["bytes_per_token"] == full * 2 * (2 if name == "0.8b" else 4) * 256 * 2
    assert acc["ring"]["fixed_bytes_per_request"] == state  # plan reads no max_model_len
    # a pool by token charges each recurrent layer its q/k/v heads' history instead
    assert rec["history_bytes_per_token"] == gdn * (16 * 128 + hv * 128) * 2
    assert (acc["token_scaled"]["bytes_per_token"]
            == acc["ring"]["bytes_per_token"] + rec["history_bytes_per_token"])
    assert (acc["ring"]["max_concurrent_requests"]
            > 5 * acc["token_scaled"]["max_concurrent_requests"])
    assert main(["plan", str(tmp_path), "--kv-memory", "16GiB", "--dtype", "bf16"]) == 0
    assert "recurrent state per request" in capsys.readouterr().out


def _text_config(**kw) -> dict:
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
            "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, **kw}


@pytest.mark.parametrize("field,value", [
    ("layer_types", ["linear_attention", "sliding_attention", "linear_attention",
                     "full_attention"]),
    ("hidden_act", "gelu"), ("attention_bias", True), ("attn_output_gate", False),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
    ("linear_num_value_heads", 24), ("linear_conv_kernel_dim", 1), ("num_experts", 8)])
def test_unimplemented_options_are_refused_by_field(field, value):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(_text_config(**{field: value}))


def test_defaults_follow_transformers():
    from transformers import Qwen3_5TextConfig

    cfg = _text_config(num_hidden_layers=8)
    ours, theirs = ModelConfig.from_hf(cfg), Qwen3_5TextConfig(**cfg)
    assert [{"linear": "linear_attention", "full": "full_attention"}[t]
            for t in ours.layer_types] == theirs.layer_types
    for f in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim", "head_dim"):
        assert ours.raw[f] == getattr(theirs, f)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.raw["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert ours.tie_word_embeddings is False and ours.sliding_window is None


def test_tensor_parallel_and_mlx_are_refused():
    from swaserve.models.qwen3_5.model import Qwen3_5ForCausalLM

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        local_config(ModelConfig.from_hf(QWEN35_08B), 2)
    assert not Qwen3_5ForCausalLM.runs_on_mlx


def test_a_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """Qwen3_5ForConditionalGeneration: the text model's weights under
    model.language_model., the vision tower left unread."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    write_tiny_qwen3_5(tmp_path / "text")
    text = json.loads((tmp_path / "text" / "config.json").read_text())
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                  out_hidden_size=32, patch_size=4, temporal_patch_size=1)
    torch.manual_seed(3)
    ref = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text,
                                                        vision_config=vision)).eval()
    ref.save_pretrained(str(tmp_path / "mm"))
    prompt = random_prompt(40, seed=6)
    (tokens, logs), = run(engine(str(tmp_path / "mm")), [prompt], GREEDY)
    assert max_err(logs, hf_logits(ref, prompt + tokens), len(prompt) - 1) < TOL


def test_prompt_logprobs_and_embeddings_are_transformers(dense):
    """Prompt logprobs (every position scored, in chunks of 7) and an embedding (an
    encoder forward: the prompt whole from a zero state, nothing kept)."""
    path, ref = dense
    p = random_prompt(40, seed=30)
    eng = tiny_engine(path, chunk_size=7)
    want = torch.log_softmax(hf_logits(ref, p), dim=-1)
    out = eng.add_request(p, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    drive(eng)
    for i in range(1, len(p)):
        assert abs(out.prompt_logprobs[i][p[i]] - want[i - 1, p[i]].item()) < TOL
    vec = torch.tensor(eng.embed([p])[0])
    with torch.no_grad():
        hidden = ref.model(torch.tensor([p])).last_hidden_state[0, -1]
    assert (vec - torch.nn.functional.normalize(hidden, dim=-1)).abs().max().item() < TOL
    eng.check_integrity()


def test_bf16_is_as_near_as_transformers_bf16(dense):
    """bf16: the logits are no further from transformers' float32 ones than transformers'
    own bf16 model is, on the same tokens."""
    import copy

    path, ref = dense
    ref_bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    prompts = [random_prompt(70 + 9 * i, seed=i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for p, (tokens, logs) in zip(prompts, run(tiny_engine(path, dtype="bfloat16", chunk_size=16),
                                              prompts, params)):
        want, theirs = hf_logits(ref, p + tokens), hf_logits(ref_bf16, p + tokens)
        rows = range(len(p) - 1, len(p) - 1 + len(logs))
        ours = max((lg.float() - want[r]).abs().max().item() for lg, r in zip(logs, rows))
        hf = max((theirs[r] - want[r]).abs().max().item() for r in rows)
        assert ours <= 1.5 * hf + 0.02


def test_batch_invariant_gives_a_request_the_same_bits_alone_and_in_a_batch(dense):
    path, _ = dense
    prompts = [random_prompt(37 + 11 * i, seed=60 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(dtype="bfloat16", batch_invariant=True, chunk_size=16)
    batched = run(tiny_engine(path, **kw), prompts, params)
    for p, (tokens, logs) in zip(prompts, batched):
        (alone, alone_logs), = run(tiny_engine(path, **kw), [p], params)
        assert tokens == alone
        assert all(torch.equal(a, b) for a, b in zip(logs, alone_logs))


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "qwen3next"])
def test_a_gguf_of_the_family_is_refused_by_its_architecture(arch):
    from swaserve.checkpoint.gguf_config import gguf_metadata_to_hf

    with pytest.raises(ValueError, match=f"GGUF architecture '{arch}' is not supported"):
        gguf_metadata_to_hf({"general.architecture": arch})


def test_overlap_scheduling_gives_the_tokens_of_plain_steps(dense):
    """Overlap on (a step scheduled while the previous computes, decodes chained on its
    device tokens): with the prefix cache taking checkpoints every 8 tokens through decode,
    n = 2 forks, drafts and a repeated prompt that hits, every request's tokens are those
    of plain steps."""
    path, _ = dense
    prompts = [random_prompt(30, seed=50), random_prompt(21, seed=51), random_prompt(30, seed=50)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]

    def go(**kw):
        eng = tiny_engine(path, chunk_size=8, state_checkpoint_interval=8, **kw)
        if eng.speculator is not None:
            eng.speculator.gate.allow = lambda n: True
        out = []
        for p, sp in zip(prompts, params):
            reqs = eng.add_request(p, sp)
            drive(eng, check_integrity=True)
            out.append([r.output_token_ids for r in reqs])
        assert eng.cache.prefix.hit_tokens > 0
        eng.check_integrity()
        return out
    plain = go(overlap=False)
    assert go(overlap=True) == plain
    assert go(overlap=True, speculative="ngram") == plain


def test_a_grammar_in_a_ragged_batch_is_what_it_is_alone(tmp_path):
    import re

    from swaserve import LLM
    from tests.helpers.checkpoints import write_byte_bpe_tokenizer

    pytest.importorskip("llguidance")
    vocab = write_byte_bpe_tokenizer(tmp_path)
    path, _ = write_tiny_qwen3_5(tmp_path, vocab_size=vocab)

    def llm():
        return LLM(path, dtype="float32", kv_memory="16MiB", max_running_requests=8,
                   page_size=4, chunk_size=13, device=TEST_DEVICE)
    regex = r"[0-9]{3}-[0-9]{4}"
    prompts = [random_prompt(n, seed=90 + i) for i, n in enumerate(RAGGED)]
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=30, regex=regex)] + [GREEDY] * 3
    outs = llm().generate(prompts, params)
    assert re.fullmatch(regex, outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[0].token_ids == llm().generate([prompts[0]], params[0])[0].token_ids


def test_fused_expert_tensors_load_as_per_expert_ones(moe, tmp_path):
    """Experts stored as transformers keeps them in memory (experts.gate_up_proj [E, 2I, h],
    experts.down_proj [E, h, I]) give the per-expert checkpoint's logits."""
    import re
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    path, ref = moe
    tensors = load_file(str(Path(path) / "model.safetensors"))
    fused, experts = {}, {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m is None:
            fused[name] = t
        else:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
    for prefix, per in experts.items():
        order = sorted(per)
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["gate"], per[e]["up"]]) for e in order])
        fused[f"{prefix}.down_proj"] = torch.stack([per[e]["down"] for e in order])
    shutil.copy(Path(path) / "config.json", tmp_path / "config.json")
    save_file(fused, str(tmp_path / "model.safetensors"))
    prompt = random_prompt(30, seed=7)
    (tokens, logs), = run(engine(str(tmp_path)), [prompt], GREEDY)
    assert max_err(logs, hf_logits(ref, prompt + tokens), len(prompt) - 1) < TOL


def test_a_quantized_kv_cache_is_refused(dense):
    """The state pool is planned in the model dtype: int8/fp8 KV is refused by name."""
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine(dense[0], kv_cache_dtype="int8")
