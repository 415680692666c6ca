"""A decode step's layers in one C call (kernels/decode.c) give the bits of the layers run
one by one: the same kernels in the same order, only without Python between them."""

from __future__ import annotations

import pytest
import torch

from swaserve.kernels import q8
from swaserve.sampling.params import SamplingParams
from tests.conftest import TINY_WINDOW as W
from tests.conftest import drive, int8_copy, random_prompt, tiny_engine, use_int8_copies

pytestmark = [pytest.mark.skipif(not (q8.vnni_available() or q8.amx_available()),
                                 reason="no int8 tile kernel here"), pytest.mark.cpu_only]


def bf16_engine_with_int8_weights(path, int8_activations: bool = False, **kw):
    eng = tiny_engine(path, dtype="bfloat16", prefix_cache=False, **kw)
    use_int8_copies(eng, int8_activations=int8_activations)
    return eng


def decode_runs(eng, prompts, tokens: int) -> tuple[list, list, int]:
    """(tokens, logits) a prompt with the fused call on, then off; and how many steps the
    fused call ran."""
    runs, fused_steps = [], 0
    for on in (True, False):
        eng.model.fused_decode = on
        eng.logits_log = []
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        reqs = [eng.add_request(p, params)[0] for p in prompts]
        drive(eng)
        if on:
            fused_steps = eng.model.fused_decode_steps or 0
        runs.append([(r.output_token_ids, [lg for rid, _, lg in eng.logits_log
                                           if rid == r.request_id]) for r in reqs])
        assert eng.cache.is_fully_free()
    return runs[0], runs[1], fused_steps


def assert_same_bits(fused: list, plain: list, tokens: int) -> None:
    for (ta, la), (tb, lb) in zip(fused, plain, strict=True):
        assert ta == tb and len(la) == len(lb) == tokens
        assert all(torch.equal(a, b) for a, b in zip(la, lb))


@pytest.mark.parametrize("batch", [1, 3, q8.VNNI_ROWS + 2, 13, 40])
def test_fused_layers_give_the_layer_by_layer_bits(tiny_hybrid, batch):
    """Sliding and full layers, rings that wrap (prompts and outputs past the window),
    rows of different lengths (masks), the VNNI and the AMX row counts (40: past the 32
    rows the AMX path once stopped at; without AMX, 8 rows are q8_vnni's and 13 and 40
    q8_dpbf16's, or without AVX-512 BF16 13 q8_vnni's in passes of 8 and 5 rows and 40
    bf16 layer by layer)."""
    if q8.tile_kernel(batch) is None:
        pytest.skip(f"no int8 tile kernel takes a decode step of {batch} rows here (AMX)")
    eng = bf16_engine_with_int8_weights(tiny_hybrid[0], max_running_requests=batch)
    prompts = [random_prompt(3 + 5 * i, seed=i) for i in range(batch)]
    fused, plain, steps = decode_runs(eng, prompts, 3 * W)
    assert steps >= 3 * W - 2  # every pure decode step
    assert_same_bits(fused, plain, 3 * W)


@pytest.mark.parametrize("batch", [13, 40])
def test_fused_layers_on_int8_activations_give_the_layer_by_layer_bits(tiny_hybrid, batch):
    """With `int8_activations` the fused call's products past q8_vnni's rows run on
    q8_dpbusd, as the layers' own do: the same bits, and not those of q8_dpbf16."""
    if q8.amx_available() or q8.tile_kernel(batch, int8=True) != "dpbusd":
        pytest.skip("q8_dpbusd does not take these rows here")
    eng = bf16_engine_with_int8_weights(tiny_hybrid[0], int8_activations=True,
                                        max_running_requests=batch)
    prompts = [random_prompt(3 + 5 * i, seed=i) for i in range(batch)]
    fused, plain, steps = decode_runs(eng, prompts, 2 * W)
    assert steps >= 2 * W - 2
    assert_same_bits(fused, plain, 2 * W)
    bf16_acts = bf16_engine_with_int8_weights(tiny_hybrid[0], max_running_requests=batch)
    other, _, _ = decode_runs(bf16_acts, prompts, 2 * W)
    assert any(not torch.equal(a, b) for (_, la), (_, lb) in zip(fused, other)
               for a, b in zip(la, lb))


@pytest.mark.skipif(not q8.vnni_available(), reason="no AVX-512 VNNI here")
@pytest.mark.parametrize("kind", ["q5_0", "q4_k"])
def test_packed_weights_give_the_int8_tiles_bits(tiny_hybrid, kind):
    """Q5_0- and Q4_K-shaped weights: q8_vnni reads them packed in 5 and 4 bits (fused and
    layer by layer), and gets the bits the int8 tiles give."""
    eng = tiny_engine(tiny_hybrid[0], dtype="bfloat16", prefix_cache=False,
                      max_running_requests=3)
    use_int8_copies(eng, kind)
    weights = [w for layer in eng.model.layers for w in layer.q8.values()]
    assert all(w.packed is not None for w in weights)
    prompts = [random_prompt(3 + 5 * i, seed=i) for i in range(3)]
    fused, plain, steps = decode_runs(eng, prompts, 2 * W)
    assert steps >= 2 * W - 2
    assert_same_bits(fused, plain, 2 * W)
    for w in weights:
        w.packed = None
    eng.model._fused = None  # rebuilt over the int8 tiles
    unpacked, _, _ = decode_runs(eng, prompts, 2 * W)
    assert_same_bits(fused, unpacked, 2 * W)


def test_fused_layers_take_models_of_one_attention_kind(tiny_all_sliding, tiny_no_sliding):
    for path in (tiny_all_sliding[0], tiny_no_sliding[0]):
        eng = bf16_engine_with_int8_weights(path, max_running_requests=2)
        fused, plain, steps = decode_runs(eng, [random_prompt(5, 1), random_prompt(11, 2)], 12)
        assert steps > 0
        assert_same_bits(fused, plain, 12)


def test_fused_layers_decline_what_they_do_not_run(tiny_hybrid):
    """float32, weights without int8 tiles and prefill steps keep the layers one by one."""
    eng = tiny_engine(tiny_hybrid[0], dtype="bfloat16", prefix_cache=False)
    _, _, steps = decode_runs(eng, [random_prompt(6, 3)], 4)
    assert eng.model.fused_decode_steps == 0 and steps == 0  # consulted, and it declined
    eng32 = tiny_engine(tiny_hybrid[0])  # float32: the parity path
    eng32.model.use_q8({f"{i}.{n}": int8_copy(getattr(layer, n).bfloat16())
                        for i, layer in enumerate(eng32.model.layers)
                        for n in ("qkv", "o", "gate_up", "down")})
    _, _, steps = decode_runs(eng32, [random_prompt(6, 3)], 4)
    assert steps == 0
    prefill_only = bf16_engine_with_int8_weights(tiny_hybrid[0])
    _, _, steps = decode_runs(prefill_only, [random_prompt(6, 3)], 1)
    assert steps == 0 and prefill_only.model.fused_decode_steps == 0  # consulted, ran none


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_fused_layers_write_through_to_the_prefix_caches_window_pages(tiny_hybrid, kv):
    """With the prefix cache, every token's sliding-layer k/v (int8: values and scales)
    also goes to its window page; a follow-up turn that hits the tokens decoded by the
    fused call reads them back: the same bits as an engine that ran its layers one by one."""
    runs = []
    for on in (True, False):
        eng = tiny_engine(tiny_hybrid[0], dtype="bfloat16", prefix_cache=True,
                          max_running_requests=2, kv_cache_dtype=kv)
        use_int8_copies(eng)
        eng.model.fused_decode = on
        eng.logits_log = []
        params = SamplingParams(temperature=0, max_tokens=3 * W, ignore_eos=True)
        first = eng.add_request(random_prompt(13, 5), params)[0]
        drive(eng)
        follow = first.prompt_token_ids + first.output_token_ids + random_prompt(3, 6)
        second = eng.add_request(follow, params)[0]
        drive(eng)
        assert second.num_cached_tokens > 13 + W  # decoded tokens came from the cache
        assert bool(eng.model.fused_decode_steps) == on
        runs.append((first.output_token_ids, second.output_token_ids,
                     [lg for _, _, lg in eng.logits_log]))
        eng.check_integrity()
    (a1, a2, la), (b1, b2, lb) = runs
    assert a1 == b1 and a2 == b2 and len(la) == len(lb) == 6 * W
    assert all(torch.equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("batch", [3, 13])
def test_an_int8_kv_cache_takes_the_fused_step_with_the_layer_by_layer_bits(tiny_hybrid, batch):
    """With kv_cache_dtype int8 the fused call quantizes the new k and v as
    memory/kv_quant.py does and attends with the int8 kernel: every pure decode step runs
    there, with the logits and the cache bytes and scales of the layers run one by one."""
    prompts = [random_prompt(3 + 5 * i, seed=i) for i in range(batch)]
    runs = []
    for on in (True, False):
        eng = bf16_engine_with_int8_weights(tiny_hybrid[0], kv_cache_dtype="int8",
                                            max_running_requests=batch)
        eng.model.fused_decode = on
        eng.logits_log = []
        params = SamplingParams(temperature=0, max_tokens=2 * W, ignore_eos=True)
        reqs = [eng.add_request(p, params)[0] for p in prompts]
        drive(eng)
        assert (eng.model.fused_decode_steps or 0) >= (2 * W - 2 if on else 0)
        pools = (eng.cache.full, eng.cache.window)
        runs.append(([(r.output_token_ids, [lg for rid, _, lg in eng.logits_log
                                            if rid == r.request_id]) for r in reqs],
                     [t.clone() for pool in pools for t in pool.buffers()]))
    (fused, cache_a), (plain, cache_b) = runs
    assert_same_bits(fused, plain, 2 * W)
    assert len(cache_a) == len(cache_b) and all(map(torch.equal, cache_a, cache_b))


def test_an_fp8_kv_cache_decodes_layer_by_layer(tiny_hybrid):
    """No kernel reads an fp8 cache in place: with kv_cache_dtype fp8_e4m3 the fused call
    declines every step and the layers run one by one, with the bits they have without it."""
    eng = bf16_engine_with_int8_weights(tiny_hybrid[0], kv_cache_dtype="fp8_e4m3")
    prompts = [random_prompt(3 + 5 * i, seed=i) for i in range(3)]
    fused, plain, steps = decode_runs(eng, prompts, 2 * W)
    assert steps == 0
    assert_same_bits(fused, plain, 2 * W)
