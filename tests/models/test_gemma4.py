"""Gemma 4 text models against transformers' own Gemma4ForCausalLM, in float32 on tiny random
checkpoints (W = 8): one with KV shared across layers, K=V full layers of their own head size,
per-layer inputs and double-wide MLPs on the reusing layers; one with none of these; one
with MoE blocks (and sharing, K=V, per-layer inputs); ragged prefills under one token budget,
with a grammar and prompt logprobs among them. Then
the KV cache and planner (reusing layers allocate and are charged nothing), `swaserve plan` on
Gemma-4-shaped configs, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

from swaserve import SamplingParams
from swaserve.checkpoint.shard import local_config
from swaserve.memory.planner import plan_memory
from swaserve.models.config import ModelConfig
from tests.conftest import (
    TEST_DEVICE,
    drive,
    hf_greedy,
    hf_logits,
    hf_logprobs,
    random_prompt,
    tiny_engine,
)
from tests.conftest import TINY_WINDOW as W
from tests.conftest import run_logged as run
from tests.engine.test_prompt_logprobs import check_against
from tests.helpers.checkpoints import write_byte_bpe_tokenizer, write_tiny_gemma4

TOL = 1e-4
PLAIN = dict(num_kv_shared_layers=0, attention_k_eq_v=False, hidden_size_per_layer_input=0,
             use_double_wide_mlp=False, final_logit_softcapping=None)
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return write_tiny_gemma4(tmp_path_factory.mktemp("gemma4_shared"))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return write_tiny_gemma4(tmp_path_factory.mktemp("gemma4_plain"), seed=1, **PLAIN)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_tiny_gemma4(tmp_path_factory.mktemp("gemma4_moe"), seed=2, **MOE)


@pytest.fixture(params=["shared", "plain", "moe"])
def gemma4(request):
    return request.getfixturevalue(request.param)


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("chunk", [1, 7, W - 1, W + 1])
def test_prompt_logits_match_transformers_under_every_chunking(gemma4, chunk):
    path, ref = gemma4
    prompts = [random_prompt(3 * W + 5, seed=1), random_prompt(4 * W + 3, seed=2)]
    for p, (tokens, logs) in zip(prompts, run(tiny_engine(path, chunk_size=chunk), prompts,
                                              GREEDY)):
        want = hf_logits(ref, p + tokens)
        for i, lg in enumerate(logs):
            assert (lg - want[len(p) - 1 + i]).abs().max().item() < TOL


def test_batched_decode_of_mixed_lengths_is_each_alone_and_greedy_is_transformers(gemma4):
    path, ref = gemma4
    prompts = [random_prompt(3 * W + 5 + 9 * i, seed=10 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    batched = run(tiny_engine(path, chunk_size=7), prompts, params)
    for p, (tokens, logs) in zip(prompts, batched):
        alone_tokens, alone_logs = run(tiny_engine(path, chunk_size=7), [p], params)[0]
        assert tokens == alone_tokens == hf_greedy(ref, p, 32)
        assert max((a - b).abs().max().item() for a, b in zip(logs, alone_logs)) < TOL
        want = hf_logits(ref, p + tokens)
        assert max((lg - want[len(p) - 1 + i]).abs().max().item()
                   for i, lg in enumerate(logs)) < TOL


def test_bf16_through_the_attention_kernels_is_as_near_as_transformers_bf16(tmp_path,
                                                                             monkeypatch):
    """bf16 on the CPU: heads of 32 (sliding) and 64 (full) go through the C decode and
    prompt attention kernels; the logits are no further from transformers' float32 ones
    than transformers' own bf16 model is, on the same tokens."""
    import copy

    from swaserve.kernels import attention as kernel
    from swaserve.models import attention as backend

    path, ref = write_tiny_gemma4(tmp_path, head_dim=32, global_head_dim=64,
                                  num_attention_heads=2)
    ref_bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    ran = []
    real = kernel.decode_attention_bf16

    def decode(*a, **k):
        ran.append(real(*a, **k))
        return ran[-1]
    monkeypatch.setattr(backend, "decode_attention_bf16", decode)
    prompts = [random_prompt(3 * W + 5 + 9 * i, seed=i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for p, (tokens, logs) in zip(prompts, run(tiny_engine(path, dtype="bfloat16"), prompts,
                                              params)):
        want, theirs = hf_logits(ref, p + tokens), hf_logits(ref_bf16, p + tokens)
        rows = range(len(p) - 1, len(p) - 1 + len(logs))
        ours = max((lg.float() - want[r]).abs().max().item() for lg, r in zip(logs, rows))
        hf = max((theirs[r] - want[r]).abs().max().item() for r in rows)
        assert ours <= 1.5 * hf + 0.02
    assert ran and (kernel.entry() is None or all(o is not None for o in ran))


RAGGED = [3 * W + 5, 2 * W - 1, 7, W + 2]  # cut by a budget of 13 at different points


@pytest.mark.parametrize("name", ["shared", "moe"])
def test_ragged_prefill_under_one_budget_and_a_late_arrival_match_transformers(request, name):
    """Four prompts arrive together under a 13-token budget, so each step cuts them at
    different points; a fifth arrives while they decode. Every sampled row is transformers'
    full forward at that position, and the greedy tokens are each prompt's run alone."""
    path, ref = request.getfixturevalue(name)
    prompts = [random_prompt(n, seed=80 + i) for i, n in enumerate(RAGGED)]
    late = random_prompt(2 * W + 3, seed=85)
    eng = tiny_engine(path, chunk_size=13)
    eng.logits_log = []
    reqs = [eng.add_request(p, GREEDY)[0] for p in prompts]
    seen = [0] * len(reqs)
    cuts = []  # per step: how many prompts it prefilled

    def count(_):
        now = [r.num_computed_tokens for r in reqs]
        cuts.append(sum(b > a and a < r.num_prompt_tokens
                        for a, b, r in zip(seen, now, reqs)))
        seen[:] = now
    drive(eng, until=lambda: reqs[0].num_output_tokens > 1, each_step=count)
    reqs.append(eng.add_request(late, GREEDY)[0])
    prompts.append(late)
    drive(eng)
    assert max(cuts) >= 2  # prompts cut in the same step
    for p, r in zip(prompts, reqs):
        logs = [lg for rid, _, lg in eng.logits_log if rid == r.request_id]
        want = hf_logits(ref, p + r.output_token_ids)
        assert len(logs) == GREEDY.max_tokens
        assert max((lg - want[len(p) - 1 + i]).abs().max().item()
                   for i, lg in enumerate(logs)) < TOL
        assert r.output_token_ids == run(tiny_engine(path, chunk_size=13), [p], GREEDY)[0][0]
    for r in reqs:
        eng.release(r.request_id)
    eng.check_integrity()


def test_a_grammar_and_prompt_logprobs_in_a_ragged_batch_are_what_they_are_alone(tmp_path):
    """A regex request, a prompt-logprobs request and plain ones share the 13-token budget:
    the regex output matches and is the one it gives alone; the prompt logprobs are
    transformers' log-softmax at every position."""
    import re

    from swaserve import LLM

    pytest.importorskip("llguidance")
    vocab = write_byte_bpe_tokenizer(tmp_path)
    path, ref = write_tiny_gemma4(tmp_path, vocab_size=vocab, vocab_size_per_layer_input=vocab)

    def llm():
        return LLM(path, dtype="float32", kv_memory="16MiB", max_running_requests=8,
                   page_size=4, chunk_size=13, device=TEST_DEVICE)
    regex = r"[0-9]{3}-[0-9]{4}"
    prompts = [random_prompt(n, seed=90 + i) for i, n in enumerate(RAGGED)]
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=30, regex=regex),
              SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), GREEDY, GREEDY]
    outs = llm().generate(prompts, params)
    assert re.fullmatch(regex, outs[0].text) and outs[0].finish_reason == "stop"
    alone = llm().generate([prompts[0]], params[0])[0]
    assert outs[0].token_ids == alone.token_ids
    check_against(hf_logprobs(ref, prompts[1]), prompts[1], outs[1].prompt_logprobs, 2)
    assert outs[1].token_ids == hf_greedy(ref, prompts[1], 2)


@pytest.mark.parametrize("cut", [5 * W, 5 * W + 3])  # at a page boundary, and between two
def test_prefix_hit_equals_a_cold_run(shared, cut):
    path, _ = shared
    eng = tiny_engine(path, chunk_size=7)
    p = random_prompt(6 * W, seed=70)
    run(eng, [p], GREEDY)
    q = p[:cut] + random_prompt(4, seed=71)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    req = eng.add_request(q, params)[0]
    eng.logits_log = []
    drive(eng)
    assert req.num_cached_tokens > 0
    hit_logs = [lg for _, _, lg in eng.logits_log]
    cold_tokens, cold_logs = run(tiny_engine(path, chunk_size=7, prefix_cache=False), [q],
                                 params)[0]
    assert req.output_token_ids == cold_tokens
    assert max((a - b).abs().max().item() for a, b in zip(hit_logs, cold_logs)) < TOL


def test_three_forks_follow_their_seeds(shared):
    path, _ = shared
    eng = tiny_engine(path)
    prompt = random_prompt(3 * W + 6, seed=4)
    params = SamplingParams(temperature=1.0, top_k=20, seed=11, n=3, max_tokens=12,
                            ignore_eos=True)
    forks = [tokens for tokens, _ in run(eng, [prompt], params)]
    for i, tokens in enumerate(forks):
        single = SamplingParams(temperature=1.0, top_k=20, seed=11 + i, max_tokens=12,
                                ignore_eos=True)
        assert tokens == run(eng, [prompt], single)[0][0]
    assert len({tuple(t) for t in forks}) > 1


def test_drafts_on_and_off_give_the_same_tokens(shared):
    path, _ = shared
    prompts = [[4, 5, 6] * 10, random_prompt(W, seed=5) * 4]  # repeats: drafts find matches
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = tiny_engine(path, speculative="ngram")
    spec.speculator.gate.allow = lambda n: True  # a tiny model's timings are noise
    with_drafts = run(spec, prompts, params)
    without = run(tiny_engine(path), prompts, params)
    assert [t for t, _ in with_drafts] == [t for t, _ in without]
    assert spec.speculator.stats.proposed > 0


def test_reusing_layers_allocate_nothing_and_the_plan_is_what_the_cache_holds(shared):
    path, _ = shared
    eng = tiny_engine(path)
    lay, cache = eng.layout, eng.cache
    assert lay.reusing_layers == (5, 6, 7)
    assert lay.full_layers == (3,) and lay.sliding_layers == (0, 1, 2, 4)
    assert [lay.dense_index(i) for i in (5, 6, 7)] == [3, 3, 0]  # their sources' buffers
    assert len(cache.full.k) == 1 and tuple(cache.full.k[0].shape[1:]) == (1, 16)
    assert len(cache.window.k) == 4 and all(tuple(k.shape[1:]) == (2, 8) for k in cache.window.k)
    assert len(cache.window_pages.k) == 4
    assert eng.plan.used_bytes == cache.nbytes()
    assert eng.plan.full_bytes_per_token == 2 * 1 * 16 * 4  # one K=V full layer, float32
    unshared = plan_memory(lay.without_sharing(), 16 * 2**20, 4, chunk_size=16, page_size=4,
                           max_model_len=512, max_running_requests=8)
    assert unshared.full_bytes_per_token == 2 * eng.plan.full_bytes_per_token
    assert unshared.fixed_bytes_per_row > eng.plan.fixed_bytes_per_row


def test_reusing_layers_write_nothing(shared, monkeypatch):
    """Only storing layers write the pools: one write per storing layer per step."""
    from swaserve.memory.full_pool import FullKVPool
    from swaserve.memory.window_pool import WindowPool

    path, _ = shared
    eng = tiny_engine(path)
    writes = []
    for pool in (FullKVPool, WindowPool):
        real = pool.write
        monkeypatch.setattr(pool, "write", lambda self, dense, *a, real=real, kind=pool.__name__:
                            (writes.append((kind, dense)), real(self, dense, *a))[1])
    run(eng, [random_prompt(5, seed=3)], SamplingParams(temperature=0, max_tokens=1))
    assert sorted(set(writes)) == [("FullKVPool", 0)] + [("WindowPool", d) for d in range(4)]
    assert len(writes) == 5  # one step: each storing layer once


def test_a_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """Gemma4ForConditionalGeneration: the text model's weights under
    model.language_model., the vision tower's left unread."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    write_tiny_gemma4(tmp_path / "text")
    text = json.loads((tmp_path / "text" / "config.json").read_text())
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(3)
    ref = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision,
                                                      audio_config=None)).eval()
    ref.save_pretrained(str(tmp_path / "mm"))
    prompt = random_prompt(3 * W + 5, seed=6)
    tokens, logs = run(tiny_engine(str(tmp_path / "mm")), [prompt], GREEDY)[0]
    want = hf_logits(ref, prompt + tokens)
    assert max((lg - want[len(prompt) - 1 + i]).abs().max().item()
               for i, lg in enumerate(logs)) < TOL


def _config(**kw) -> dict:
    return {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
            "vocab_size": 262_144, "num_attention_heads": 8, **kw}


# shaped like the small (per-layer inputs, KV sharing) and the large dense Gemma 4 models
E2B_LIKE = _config(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35,
                   num_key_value_heads=1, head_dim=256, global_head_dim=512,
                   sliding_window=512, num_kv_shared_layers=20, use_double_wide_mlp=True,
                   layer_types=["full_attention" if i % 5 == 4 else "sliding_attention"
                                for i in range(35)])
LARGE_LIKE = _config(hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
                     num_attention_heads=32, num_key_value_heads=16, head_dim=256,
                     global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True,
                     sliding_window=1024, hidden_size_per_layer_input=None)


@pytest.mark.parametrize("name,cfg", [("e2b", E2B_LIKE), ("large", LARGE_LIKE)])
def test_plan_of_gemma4_shaped_configs(tmp_path, name, cfg, capsys):
    from swaserve.cli import main
    from swaserve.cli.plan import plan_report
    from swaserve.config import EngineConfig

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = EngineConfig(model=str(tmp_path), kv_memory="4GiB", dtype="bf16")
    rep = plan_report(config, context=32768)
    lay, acc = rep["layers"], rep["accounting"]
    full_kvh = 1 if name == "e2b" else 4
    assert lay["kv_shape"] == {"sliding": [cfg["num_key_value_heads"], 256],
                               "full": [full_kvh, 512]}
    assert acc["ring"]["bytes_per_token"] == len(lay["full"]) * 2 * full_kvh * 512 * 2
    if name == "e2b":
        assert lay["reusing"] == list(range(15, 35)) and len(lay["full"]) == 3
        without = rep["without_kv_sharing"]["ring"]
        assert without["bytes_per_token"] == 7 * 2 * 512 * 2
        assert without["max_concurrent_requests"] < acc["ring"]["max_concurrent_requests"]
    else:
        assert lay["reusing"] == [] and rep["without_kv_sharing"] is None
    assert acc["ring"]["max_concurrent_requests"] > acc["full_history"]["max_concurrent_requests"]
    assert main(["plan", str(tmp_path), "--kv-memory", "4GiB", "--dtype", "bf16"]) == 0
    assert ("without KV sharing" in capsys.readouterr().out) == (name == "e2b")


@pytest.mark.parametrize("field,value", [("num_experts", None),
                                         ("use_bidirectional_attention", "all"),
                                         ("hidden_activation", "silu"),
                                         ("attention_bias", True)])
def test_unimplemented_options_are_refused_by_field(field, value):
    cfg = _config(hidden_size=64, intermediate_size=64, num_hidden_layers=6,
                  **{**MOE, "enable_moe_block": field == "num_experts", field: value})
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(cfg)


def test_tensor_parallel_and_mlx_are_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        local_config(ModelConfig.from_hf(E2B_LIKE), 2)
    from swaserve.models.gemma4.model import Gemma4ForCausalLM

    assert not Gemma4ForCausalLM.runs_on_mlx


def test_defaults_follow_transformers():
    """A config that leaves Gemma 4's fields out gets transformers' values: 5:1 layers with
    the last full, W = 512, 512-wide full heads, per-layer inputs of 256."""
    from transformers import Gemma4TextConfig

    cfg = _config(hidden_size=64, intermediate_size=64, num_hidden_layers=8)
    ours, theirs = ModelConfig.from_hf(cfg), Gemma4TextConfig(**cfg)
    assert [t + "_attention" for t in ours.layer_types] == theirs.layer_types
    assert ours.sliding_window == theirs.sliding_window == 512
    assert ours.layer_head_dims == tuple(theirs.per_layer_config[i].head_dim for i in range(8))
    assert ours.raw["hidden_size_per_layer_input"] == theirs.hidden_size_per_layer_input
    assert torch.tensor(ours.layer_kv_heads).tolist() == [theirs.per_layer_config[i]
                                                          .num_key_value_heads for i in range(8)]
