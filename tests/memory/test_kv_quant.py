"""The quantized KV cache's stored form (memory/kv_quant.py): the round trip against a
float64 reference, what the pools allocate against what the planner charges, and the
options it refuses."""

from __future__ import annotations

import pytest
import torch

from swaserve.config import EngineConfig
from swaserve.memory.kv_cache import KVCache
from swaserve.memory.kv_quant import BLOCK, StoredKV, dequantize, kv_format, quantize
from swaserve.memory.layout import CacheLayout, LayerKind, LayerSpec
from swaserve.memory.planner import full_bytes_per_token, plan_memory, sliding_bytes_per_token

KIB, GIB = 1024, 1024**3


def _rows(seed: int) -> torch.Tensor:
    """[T, KVH, D] rows of every kind a cache sees: small, large, an outlier, all zeros."""
    assert 256 % BLOCK == 0
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 2, 256, generator=g, dtype=torch.float64)
    x[1] *= 1e-3
    x[2] *= 300.0
    x[3, 0, 7] = 40.0  # one outlier in a head of small values
    x[4, 1] = 0.0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_round_trip_within_half_a_step_of_float64(dtype):
    x64 = _rows(0).to(dtype).to(torch.float64)  # what the model hands the cache, exactly
    q, s = quantize(x64.to(dtype), kv_format("int8", dtype))
    blocks = x64.unflatten(-1, (256 // BLOCK, BLOCK))  # a scale per block of 32 of a head
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == blocks.shape[:3]
    amax = blocks.abs().amax(-1)
    assert torch.allclose(s.double(), amax / 127, rtol=1e-6, atol=0)
    # the reference: round(x / s) in float64; float32's division may tip a tie by one step
    ref = torch.round(blocks / (amax / 127).clamp_min(1e-300)[..., None]).clamp(-127, 127)
    qb = q.unflatten(-1, (256 // BLOCK, BLOCK)).double()
    assert (qb - ref).abs().max() <= 1 and (qb != ref).float().mean() < 1e-3
    assert (qb.abs().amax(-1)[amax > 0] == 127).all()  # each block's largest value at the top
    back = dequantize(q, s, torch.float64).unflatten(-1, (256 // BLOCK, BLOCK))
    err = (back - blocks).abs()
    assert (err <= s.double()[..., None] * (0.5 + 1e-5) + 1e-30).all()
    assert (back[4, 1] == 0).all() and (s[4, 1] == 0).all()  # zeros read back as zeros
    # a head whose size the block does not divide takes one scale for the whole head
    q, s = quantize(x64[:, :, :40].to(dtype), kv_format("int8", dtype))
    assert s.shape == (64, 2, 1) and torch.allclose(
        s[..., 0].double(), x64[:, :, :40].abs().amax(-1) / 127, rtol=1e-6)


def test_fp8_round_trip_within_e4m3s_rounding():
    x64 = _rows(1)
    fmt = kv_format("fp8_e4m3", torch.float32)
    q, s = quantize(x64.float(), fmt)
    assert q.dtype == torch.float8_e4m3fn
    blocks = x64.unflatten(-1, (256 // BLOCK, BLOCK))
    amax = blocks.abs().amax(-1)
    assert torch.allclose(s.double(), amax / 448, rtol=1e-6, atol=0)
    qb = q.float().unflatten(-1, (256 // BLOCK, BLOCK))
    assert (qb.abs().amax(-1)[amax > 0] == 448).all()
    back = dequantize(q, s, torch.float64).unflatten(-1, (256 // BLOCK, BLOCK))
    # 3 mantissa bits: half a step is 2^-4 of a normal value, 2^-10 of the scale below 2^-6
    bound = torch.maximum(blocks.abs() * 2.0**-4, s.double()[..., None] * 2.0**-10) * (1 + 1e-5)
    assert ((back - blocks).abs() <= bound).all()


def _hybrid() -> CacheLayout:
    return CacheLayout(tuple(
        LayerSpec(LayerKind.FULL, 2, 64) if i % 3 == 2 else LayerSpec(LayerKind.SLIDING, 2, 64, window=32)
        for i in range(6)))


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8_e4m3"])
def test_pools_allocate_exactly_what_the_planner_charges(kv):
    lay = _hybrid()
    fmt = kv_format(kv, torch.bfloat16)
    plan = plan_memory(lay, 8 * 2**20, fmt.value_bytes, chunk_size=16, page_size=8,
                       max_model_len=256, window_cache_bytes=2**20, scale_bytes=fmt.scale_bytes)
    cache = KVCache(lay, plan, 256, torch.bfloat16, "cpu", prefix_cache=True, kv_cache_dtype=kv)
    assert cache.window_pages is not None
    assert cache.nbytes() == plan.used_bytes <= 8 * 2**20
    per_head = 64 * (2 if kv == "auto" else 1) + (0 if kv == "auto" else 4 * 64 // BLOCK)
    assert full_bytes_per_token(lay, fmt.value_bytes, fmt.scale_bytes) == 2 * 2 * 2 * per_head
    assert sliding_bytes_per_token(lay, fmt.value_bytes, fmt.scale_bytes) == 4 * 2 * 2 * per_head


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_forks_and_restores_copy_scales_with_values(kv):
    lay = _hybrid()
    fmt = kv_format(kv, torch.float32)
    plan = plan_memory(lay, 8 * 2**20, fmt.value_bytes, chunk_size=16, page_size=8,
                       max_model_len=256, window_cache_bytes=2**20, scale_bytes=fmt.scale_bytes)
    cache = KVCache(lay, plan, 256, torch.float32, "cpu", prefix_cache=True, kv_cache_dtype=kv)
    row = cache.alloc_row()
    assert cache.ensure_slots(row, 12)
    slots = cache.rows.req_to_token[row, :12]
    x = torch.randn(12, 2, 64) * torch.arange(1, 13)[:, None, None]
    stored = StoredKV.of(x, fmt)
    cache.full.write(0, slots, stored, stored)
    ring = cache.window.ring
    cache.window.write(1, row * ring + torch.arange(12), stored, stored)
    twin = cache.fork_row(row, 12)  # a partial page: copied, not shared
    got = cache.full.read(0, lambda b: b[cache.rows.req_to_token[twin, :12]], torch.float32)[0]
    assert torch.equal(got, stored.dequantize(torch.float32))
    assert cache.rows.req_to_token[twin, 8] != cache.rows.req_to_token[row, 8]
    got = cache.window.read(1, lambda b: b[twin * ring + torch.arange(12)], torch.float32)[1]
    assert torch.equal(got, stored.dequantize(torch.float32))
    cache.check_integrity()


def test_refused_and_unknown_kv_cache_dtypes():
    with pytest.raises(ValueError, match="kv_cache_dtype: int8 is not available with device mlx"):
        EngineConfig(device="mlx", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of auto, int8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="q4")


def test_plan_puts_int8_beside_bf16_for_the_bundled_model():
    from swaserve.cli.plan import plan_report

    rep = plan_report(EngineConfig(kv_memory="1GiB", kv_cache_dtype="int8"), context=8192)
    acc, bf16 = rep["accounting"], rep["unquantized_accounting"]
    assert rep["kv_cache_dtype"] == "int8"
    # 1 KV head of 256 a layer: 256 bytes + 8 4-byte scales for K and for V, 3 full layers
    assert acc["ring"]["bytes_per_token"] == 3 * 2 * 288
    assert bf16["ring"]["bytes_per_token"] == 3 * KIB
    assert acc["ring"]["fixed_bytes_per_request"] == 15 * 2 * 288 * 1024 + 8 * 1024
    per_req = acc["ring"]["fixed_bytes_per_request"] + 8192 * 3 * 2 * 288
    assert acc["ring"]["max_concurrent_requests"] == GIB // per_req == 46
    assert bf16["ring"]["max_concurrent_requests"] == 26
    assert plan_report(EngineConfig(kv_memory="1GiB"))["unquantized_accounting"] is None


def test_every_kv_cache_dtype_a_config_accepts_has_one_format():
    from swaserve.config import KV_CACHE_DTYPES
    from swaserve.memory.kv_quant import QUANTIZED

    assert set(KV_CACHE_DTYPES) == {"auto", *QUANTIZED}
    for name in KV_CACHE_DTYPES:
        assert kv_format(name, torch.bfloat16).name == (name if name != "auto" else "bfloat16")
