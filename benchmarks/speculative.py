"""Speculative decoding (n-gram drafts) on and off, same run, alternating: the bundled model.

Workloads (chat-formatted):
  copy  - edit a ~600-token document and give it back whole (text that copies the prompt);
          half greedy, half seeded at temperature 0.8
  free  - open-ended writing with nothing to copy, seeded at temperature 1 with top-p 0.95
          (greedy decoding of this model falls into loops, which drafts would copy)
  chat  - a second turn over a first turn's answer ("say it again, shorter"), history
          included; half greedy, half seeded
For each workload and concurrency B: 3 B requests (at least 4) with B in flight at a time,
a finished one replaced at once (a server under steady load: in a closed batch the slowest
request would set the time); output tok/s over the run, steps, draft tokens accepted per
drafted row, the acceptance rate, and whether each completion is the same on and off.
Identity is asserted at batch 1 (every step takes the kernels it would take without drafts);
larger batches report it (a row's int8 kernel there depends on how many others decode
beside it, and drafts change when requests finish; --batch-invariant asserts it everywhere).

    python benchmarks/speculative.py [--batches 1 8 32] [--repeats 2] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["a lighthouse keeper", "a city under the sea", "the first clock", "a lost map",
          "a robot gardener", "winter in the desert", "a talking river", "the last train"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def chat(*turns: str) -> str:
    """Gemma's chat format: user, model, user, ... turns, then the model's turn."""
    out = ""
    for i, text in enumerate(turns):
        role = "user" if i % 2 == 0 else "model"
        out += f"<start_of_turn>{role}\n{text}<end_of_turn>\n"
    return out + "<start_of_turn>model\n"


def documents() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text() + (ROOT / "README.md").read_text()
    paras = [p for p in text.split("\n\n") if len(p) > 200]
    docs, k = [], 0
    for _ in range(8):
        doc = ""
        while len(doc) < 2400:
            doc += paras[k % len(paras)] + "\n\n"
            k += 1
        docs.append(doc)
    return docs


def workload(name: str, batch: int, first_answers: list[str]) -> list[str]:
    if name == "copy":
        docs = documents()
        return [chat("Fix any typos in this text and give it back whole, changing nothing "
                     f"else:\n\n{docs[i % len(docs)]}") for i in range(batch)]
    if name == "free":
        return [chat(f"Write a short story about {TOPICS[i % len(TOPICS)]}.")
                for i in range(batch)]
    return [chat(f"Tell me about {TOPICS[i % len(TOPICS)]}.", first_answers[i % len(first_answers)],
                 "Say that again in fewer words, keeping the same sentences.")
            for i in range(batch)]


def params_for(name: str, i: int, max_tokens: int):
    from swaserve import SamplingParams

    if name == "free":
        return SamplingParams(temperature=1.0, top_p=0.95, seed=1000 + i, max_tokens=max_tokens)
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=max_tokens)
    return SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=max_tokens)


def run(eng, name: str, prompts: list[str], max_tokens: int, batch: int) -> dict:
    """`prompts` through the engine with `batch` of them in flight at a time (a finished one
    is replaced at once, as a server under steady load would): output tok/s over the whole
    run, and per-request seconds per output token."""
    reqs, waiting = [], list(enumerate(prompts))
    t0 = time.perf_counter()
    steps = 0
    while waiting or eng.has_unfinished():
        while waiting and sum(not r.is_finished for r in reqs) < batch:
            i, p = waiting.pop(0)
            reqs += eng.add_request(p, params_for(name, i, max_tokens))
        eng.step()
        steps += 1
    seconds = time.perf_counter() - t0
    total = sum(r.num_output_tokens for r in reqs)
    out = [r.output_token_ids for r in reqs]
    for r in reqs:
        eng.release(r.request_id)
    return {"tokens": total, "seconds": seconds, "steps": steps, "tok_s": total / seconds,
            "out": out}


def first_answers(eng) -> list[str]:
    from swaserve import SamplingParams

    reqs = [eng.add_request(chat(f"Tell me about {t}."),
                            SamplingParams(temperature=0, max_tokens=96))[0] for t in TOPICS]
    while eng.has_unfinished():
        eng.step()
    return [r.output_text for r in reqs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--workloads", nargs="+", default=["copy", "free", "chat"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--max-rows", type=int, default=None,
                    help="speculative_max_rows (default: the engine's)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    from swaserve.engine.engine import Engine

    common = dict(max_running_requests=max(args.batches), kv_memory="2GiB", prefix_cache=False,
                  batch_invariant=args.batch_invariant)
    log("[speculative] loading the engines (off, on)")
    spec = {"speculative": "ngram"}
    if args.max_rows:
        spec["speculative_max_rows"] = args.max_rows
    engines = {"off": Engine(**common), "on": Engine(**spec, **common)}
    answers = first_answers(engines["off"])
    rows, failures = [], []
    for name in args.workloads:
        for batch in args.batches:
            prompts = workload(name, max(4, 3 * batch), answers)
            res: dict[str, list[dict]] = {"off": [], "on": []}
            spec_before = None
            for rep in range(args.repeats):
                for mode in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                    eng = engines[mode]
                    if mode == "on":
                        st = eng.speculator.stats
                        spec_before = (st.proposed, st.accepted, st.drafted_rows)
                    res[mode].append(run(eng, name, prompts, args.max_tokens, batch))
                    if mode == "on":
                        st = eng.speculator.stats
                        res[mode][-1]["spec"] = (st.proposed - spec_before[0],
                                                 st.accepted - spec_before[1],
                                                 st.drafted_rows - spec_before[2])
                    log(f"  {name} b{batch} {mode}: {res[mode][-1]['tok_s']:.0f} tok/s, "
                        f"{res[mode][-1]['steps']} steps")
            same = [a == b for a, b in zip(res["off"][0]["out"], res["on"][0]["out"])]
            if (batch == 1 or args.batch_invariant) and not all(same):
                failures.append(f"{name} b{batch}: speculative output differs")
            med = {m: statistics.median(r["tok_s"] for r in res[m]) for m in res}
            proposed, accepted, drafted = (sum(r["spec"][i] for r in res["on"]) for i in range(3))
            rows.append({
                "workload": name, "batch": batch,
                "off_tok_s": round(med["off"], 1), "on_tok_s": round(med["on"], 1),
                "speedup": round(statistics.median(b["tok_s"] / a["tok_s"]
                                                   for a, b in zip(res["off"], res["on"])), 3),
                "steps_off": res["off"][0]["steps"], "steps_on": res["on"][0]["steps"],
                "accepted_per_draft": round(accepted / drafted, 2) if drafted else 0.0,
                "acceptance": round(accepted / proposed, 3) if proposed else 0.0,
                "same_outputs": f"{sum(same)}/{len(same)}"})
    print(f"{'workload':8} {'batch':>5} {'off tok/s':>10} {'on tok/s':>9} {'ratio':>6} "
          f"{'steps off/on':>13} {'acc/draft':>9} {'accept':>7} {'same':>7}")
    for r in rows:
        print(f"{r['workload']:8} {r['batch']:>5} {r['off_tok_s']:>10.1f} {r['on_tok_s']:>9.1f} "
              f"{r['speedup']:>6.2f} "
              f"{str(r['steps_off']) + '/' + str(r['steps_on']):>13} "
              f"{r['accepted_per_draft']:>9.2f} {r['acceptance']:>7.2f} {r['same_outputs']:>7}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
