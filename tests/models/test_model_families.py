"""More families against transformers' own classes: Llama 3 (RoPE scaling, no window),
Qwen3 (q/k norm), Mistral (a window on every layer), gpt-oss (sinks, MoE, YaRN, MXFP4)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from swaserve import SamplingParams
from swaserve.engine.engine import Engine
from tests.conftest import TINY_WINDOW as W
from tests.conftest import drive, gpt_oss_config, hf_greedy, hf_logits, random_prompt, tiny_engine

TOL = 1e-4
def engine(path, **kw) -> Engine:
    return tiny_engine(path, **{"chunk_size": 7, **kw})  # 7: chunk boundaries off pages


def check_against_reference(path, ref, n_prompts=3):
    prompts = [random_prompt(3 * W + 5 + 9 * i, seed=i) for i in range(n_prompts)]
    eng = engine(path)
    eng.logits_log = []
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    reqs = [eng.add_request(p, params)[0] for p in prompts]  # batched decode, mixed lengths
    drive(eng)
    for p, r in zip(prompts, reqs):
        logs = [lg for rid, _, lg in eng.logits_log if rid == r.request_id]
        want = hf_logits(ref, p + r.output_token_ids)
        for i, lg in enumerate(logs):
            assert (lg - want[len(p) - 1 + i]).abs().max().item() < TOL
        assert r.output_token_ids == hf_greedy(ref, p, 32)
    eng.check_integrity()
    return eng


def test_llama3_matches_transformers_and_has_no_window_pool(llama):
    eng = check_against_reference(*llama)
    assert eng.cache.window is None and eng.cache.full is not None
    assert eng.whole_model_config.rope_scaling["rope_type"] == "llama3"


def test_qwen3_matches_transformers(qwen3):
    eng = check_against_reference(*qwen3)
    assert eng.model.layers[0].q_norm is not None


def test_mistral_all_sliding_has_no_full_pool(mistral):
    eng = check_against_reference(*mistral)
    assert eng.cache.full is None and eng.cache.window is not None
    assert eng.plan.full_pool_pages == 0 and eng.plan.ring == W + 7 + 1  # W + chunk, page-rounded


def test_gpt_oss_matches_transformers(gpt_oss):
    eng = check_against_reference(*gpt_oss)
    assert eng.layout.full_layers == (1, 3) and eng.layout.sliding_layers == (0, 2)


def test_gpt_oss_bf16_prompts_with_sinks_through_the_prompt_kernel(gpt_oss_dim32, monkeypatch):
    """In bf16 the prompt attention kernel takes the sinks (where it runs: AVX-512 BF16):
    the first logits of chunked prompts past the window are no further from transformers'
    float32 ones than with torch's SDPA (a sink as one more key), the greedy tokens the same."""
    from swaserve.kernels import attention as kernel
    from swaserve.models import attention as backend

    path, ref = gpt_oss_dim32
    prompts = [random_prompt(3 * W + 5 + 9 * i, seed=i) for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    if not kernel.prefill_available():
        pytest.skip("no AVX-512 BF16 here: prompt chunks take torch's SDPA")
    monkeypatch.setattr(backend, "prefill_preferred", kernel.prefill_available)  # AMX too
    calls, errors, tokens = [], {}, {}
    real = kernel.prefill_attention_bf16

    def counted(*a, **kw):
        out = real(*a, **kw)
        calls.append(out is not None and a[-1] is not None)  # ran, with the sinks
        return out

    for name, fn in (("kernel", counted), ("sdpa", lambda *a, **kw: None)):
        monkeypatch.setattr(backend, "prefill_attention_bf16", fn)
        eng = engine(path, dtype="bfloat16")
        eng.logits_log = []
        reqs = [eng.add_request(p, params)[0] for p in prompts]
        drive(eng)
        worst = 0.0
        for p, r in zip(prompts, reqs):
            first = next(lg for rid, _, lg in eng.logits_log if rid == r.request_id)
            worst = max(worst, (first - hf_logits(ref, p)[-1]).abs().max().item())
        errors[name], tokens[name] = worst, [r.output_token_ids for r in reqs]
    assert calls and all(calls)
    assert errors["kernel"] <= 1.25 * errors["sdpa"] + 1e-3, errors
    assert tokens["kernel"] == tokens["sdpa"]


def test_gpt_oss_sinks_change_the_result(gpt_oss):
    path, ref = gpt_oss
    prompt = random_prompt(3 * W, seed=9)
    with_sinks = hf_logits(ref, prompt)
    saved = [layer.self_attn.sinks.detach().clone() for layer in ref.model.layers]
    try:
        with torch.no_grad():
            for layer in ref.model.layers:
                layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: as if there were no sink
        without = hf_logits(ref, prompt)
    finally:
        with torch.no_grad():
            for layer, s in zip(ref.model.layers, saved):
                layer.self_attn.sinks.copy_(s)
    assert (with_sinks - without).abs().max().item() > 0.05  # a missing sink would fail parity
    eng = engine(path)
    eng.logits_log = []
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    drive(eng)
    ours = eng.logits_log[0][2]
    assert (ours - with_sinks[-1]).abs().max().item() < TOL


def _pack_mxfp4(w: torch.Tensor):
    """[E, in, out] float -> (blocks [E, out, in/32, 16], scales [E, out, in/32]), exact for
    values of the form e2m1 * 2^k, which is what the test feeds."""
    from swaserve.models.gpt_oss.model import E2M1

    x = w.transpose(1, 2).contiguous()  # [E, out, in]
    e, o, i = x.shape
    g = x.view(e, o, i // 32, 32)
    amax = g.abs().amax(-1).clamp_min(2.0**-120)
    exp = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    scaled = g / torch.ldexp(torch.ones_like(amax), exp)[..., None]
    lut = torch.tensor(E2M1)
    idx = (scaled[..., None] - lut).abs().argmin(-1)  # nearest code
    lo, hi = idx[..., 0::2], idx[..., 1::2]
    blocks = (lo | (hi << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


def test_mxfp4_dequantization_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from swaserve.models.gpt_oss.model import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 16, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 135, (3, 16, 2), dtype=torch.uint8, generator=g)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(blocks, scales), ref)


def test_gpt_oss_mxfp4_checkpoint_loads(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import GptOssForCausalLM

    from swaserve.models.gpt_oss.model import dequantize_mxfp4

    torch.manual_seed(7)
    cfg = gpt_oss_config(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         layer_types=["sliding_attention", "full_attention"])
    model = GptOssForCausalLM(cfg).eval()
    model.save_pretrained(str(tmp_path / "bf16"), safe_serialization=True)
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for name in list(tensors):
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            blocks, scales = _pack_mxfp4(tensors.pop(name))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            with torch.no_grad():  # the reference gets exactly the dequantized values
                layer = int(name.split(".")[2])
                target = getattr(model.model.layers[layer].mlp.experts, name.rsplit(".", 1)[1])
                target.copy_(dequantize_mxfp4(blocks, scales))
    (tmp_path / "mx").mkdir()
    save_file(tensors, str(tmp_path / "mx" / "model.safetensors"))
    (tmp_path / "mx" / "config.json").write_text((tmp_path / "bf16" / "config.json").read_text())
    eng = engine(str(tmp_path / "mx"))
    eng.logits_log = []
    prompt = random_prompt(3 * W, seed=11)
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    drive(eng)
    assert (eng.logits_log[0][2] - hf_logits(model, prompt)[-1]).abs().max().item() < TOL


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["BertForMaskedLM"], "num_hidden_layers": 1, "hidden_size": 8,
        "num_attention_heads": 1, "intermediate_size": 8, "vocab_size": 8}))
    with pytest.raises(ValueError, match="GptOssForCausalLM.*LlamaForCausalLM.*MistralForCausalLM"):
        Engine(model=str(tmp_path))


def test_planner_reports_the_pools_of_each_family(llama, mistral, gpt_oss):
    from swaserve.cli.plan import plan_report
    from swaserve.config import EngineConfig

    def report(path):
        return plan_report(EngineConfig(model=path, kv_memory="64MiB", chunk_size=64),
                           context=1024)
    r = report(llama[0])
    assert r["layers"]["sliding"] == [] and r["accounting"]["ring"]["fixed_bytes_per_request"] == 0
    r = report(mistral[0])
    assert r["layers"]["full"] == [] and r["accounting"]["ring"]["bytes_per_token"] == 0
    r = report(gpt_oss[0])
    assert r["layers"]["full"] == [1, 3] and r["layers"]["window"] == W


@pytest.mark.parametrize("fixture", ["mistral", "llama"])
def test_all_sliding_and_no_sliding_through_the_server(request, fixture):
    import openai

    path, ref = request.getfixturevalue(fixture)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "swaserve", "serve", "--model", path, "--port",
                             str(port), "--dtype", "float32", "--kv-memory", "16MiB",
                             "--max-running-requests", "4"],
                            env={**os.environ, "SWASERVE_NO_PROGRESS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        for _ in range(240):
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                time.sleep(0.25)
        prompt = random_prompt(3 * W, seed=12)
        r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == len(prompt)
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def test_gpt_oss_band_blocks_keep_the_sinks(gpt_oss, monkeypatch):
    """Sliding layers of a one-shot prompt chunk past the window attend in blocks of
    queries (`_banded`); each block's softmax still holds its heads' sinks."""
    from swaserve.models import attention as backend

    monkeypatch.setattr(backend, "BAND_QUERIES", 4)
    path, ref = gpt_oss
    prompt = random_prompt(4 * W + 3, seed=12)
    eng = engine(path, chunk_size=64)
    eng.logits_log = []
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    drive(eng)
    assert (eng.logits_log[0][2] - hf_logits(ref, prompt)[-1]).abs().max().item() < TOL
