"""Greedy decode steps with the LM head's int8 screen on and off, alternating in one engine
(bundled Gemma 3 270M, bf16): the median step at each batch size, the ratio, and whether
both gave the same tokens. Then steps where every other row samples, the greedy rows'
tokens (and the sampling rows' keyed draws) from the screen beside the other rows'
logits, or every row's logits. Then the head alone on the engine's own final hidden
states: q8_dpbf16's argmaxes against the screen's (kernel and exact rescoring), the
rows' candidate counts, and keyed rows at T=1 drawn by the screen against logits and
the sampler.

    python benchmarks/head_screen.py [--batches 17 32 64 128] [--steps 16] [--pairs 3]
    python benchmarks/head_screen.py --vnni-limits 8 16 --batches 10 12 16

On a CPU where the screen does not run (AMX, or no AVX-512 VNNI and BF16) it says so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from roofline import log, median_time  # noqa: E402


def decode_steps(eng, batch: int, steps: int, prompt_len: int, mixed: bool = False
                 ) -> tuple[float, list[list[int]]]:
    """(the median of `steps` decode steps at `batch` rows, each row's tokens); with
    `mixed`, every other row samples (temperature 0.8, seeded)."""
    from swaserve.sampling.params import SamplingParams

    reqs = []
    for i in range(batch):
        ids = [2] + [(7 * i + 13 * j) % 20000 + 300 for j in range(prompt_len - 1)]
        sample = {"temperature": 0.8, "seed": i} if mixed and i % 2 else {"temperature": 0}
        reqs += eng.add_request(ids, SamplingParams(**sample, max_tokens=steps + 2 * batch,
                                                    ignore_eos=True))
    while any(not r.output_token_ids for r in reqs):
        eng.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
        assert eng.last_step.num_seqs == batch and eng.last_step.num_tokens == batch
    tokens = [list(r.output_token_ids) for r in reqs]
    for r in reqs:
        eng.abort(r.request_id)
    eng.settle()
    for r in reqs:
        eng.release(r.request_id)
    return statistics.median(times), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[17, 32, 64, 128])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--vnni-limits", type=int, nargs=2, default=None, metavar=("NEW", "OLD"),
                    help="instead: decode steps with the head's q8_vnni limit at NEW rows "
                         "against OLD (e.g. 8 16 --batches 10 12 16), greedy and mixed")
    args = ap.parse_args()

    from swaserve.engine.engine import Engine

    log("[head_screen] loading")
    most = max(args.batches)
    eng = Engine(dtype="bfloat16", prefix_cache=False, max_running_requests=most,
                 kv_memory=f"{max(2, most * 31 // 1024 + 2)}GiB",
                 max_model_len=args.prompt_len + args.steps + 2 * most + 40)
    model = eng.model
    screen = model.head.screen
    if screen is None:
        print("the LM head screen does not run here (it needs AVX-512 VNNI and BF16 without "
              "AMX, and the int8 head)")
        return
    print(f"threads {torch.get_num_threads()}; decode steps, median of {args.steps} a run, "
          f"{args.pairs} alternating pairs")
    if args.vnni_limits:
        vnni_limits(eng, args)
        return
    print("| batch | screen ms | whole head ms | ratio | same tokens |")
    print("|---|---|---|---|---|")
    def use_screen(on: bool) -> None:
        model.head.screen = screen if on else None

    alternate(eng, args, use_screen, mixed=False)
    model.head.screen = screen

    mixed_steps(eng, args)
    head_alone(eng, screen, args.batches, args.prompt_len)


def mixed_steps(eng, args) -> None:
    """Steps where half the rows sample: the greedy half's tokens from the screen beside
    the other half's logits (a SPLIT HeadOutput), against every row's logits."""
    model = eng.model
    print("\nmixed steps (every other row samples), median ms")
    print("| batch | split | every row's logits | ratio | same tokens |")
    print("|---|---|---|---|---|")
    def split(on: bool) -> None:
        if on:
            model.head.__dict__.pop("split", None)
        else:
            model.head.split = lambda x, ctx: None  # the whole head, every row

    alternate(eng, args, split, mixed=True)
    split(True)


def vnni_limits(eng, args) -> None:
    """Decode steps with the head's q8_vnni limit at the first of `args.vnni_limits` rows
    against the second (rows past the limit go to the screen), greedy and mixed."""
    head, model = eng.model.head.q8, eng.model
    new, old = args.vnni_limits

    def limit(on: bool) -> None:
        head.vnni_limit = new if on else old
        model._q8_tilings = None  # same_numerics_rows reads the limits

    for mixed in (False, True):
        print(f"\nq8_vnni to {new} rows against {old}, "
              f"{'every other row sampling' if mixed else 'greedy'}, median ms")
        print(f"| batch | to {new} | to {old} | ratio | same tokens |")
        print("|---|---|---|---|---|")
        alternate(eng, args, limit, mixed)
    limit(True)


def alternate(eng, args, setting, mixed: bool) -> None:
    """A table row a batch size: decode steps with `setting(True)` and `setting(False)`,
    alternating `args.pairs` times, their medians, the ratio, and whether the tokens
    were the same."""
    for batch in args.batches:
        times, same = {True: [], False: []}, True
        for _ in range(args.pairs):
            tokens = []
            for on in (True, False):
                setting(on)
                t, run_tokens = decode_steps(eng, batch, args.steps, args.prompt_len, mixed)
                times[on].append(t)
                tokens.append(run_tokens)
            same &= tokens[0] == tokens[1]
        a, b = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {batch} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f}x | {same} |", flush=True)


def head_alone(eng, screen, batches: list[int], prompt_len: int) -> None:
    """The head alone on final hidden states of this engine's decode steps: the screen
    (kernel and rescoring) against q8_dpbf16's argmaxes, and each row's candidates."""
    from swaserve.models.head import LMHead

    caught: list[torch.Tensor] = []
    head = LMHead.__call__

    def catch(self, x, weight, ctx):
        caught.append(x.detach().clone())
        return head(self, x, weight, ctx)

    LMHead.__call__ = catch
    log("[head_screen] collecting final hidden states")
    try:
        decode_steps(eng, max(batches), 8, prompt_len)
    finally:
        LMHead.__call__ = head
    rows = torch.cat([x for x in caught if x.shape[0] == max(batches)])
    print("\nthe head alone on the engine's final hidden states (ms, median of 5; q8_vnni: "
          "the head's kernel up to its vnni_limit rows)")
    print("| rows | screen | q8_dpbf16 argmax | ratio | q8_vnni argmax | candidates a row: "
          "median / max |")
    print("|---|---|---|---|---|---|")
    q8w = screen.head
    for m in batches:
        x = rows[:m].contiguous()
        assert torch.equal(screen.argmax(x), q8w.argmax(x, "dpbf16"))
        a = median_time(lambda x=x: screen.argmax(x), 5)
        b = median_time(lambda x=x: q8w.argmax(x, "dpbf16"), 5)
        c = median_time(lambda x=x: q8w.argmax(x, "vnni"), 5)
        counts = screen.candidates(x)[1].float()
        print(f"| {m} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f}x | {c * 1e3:.1f} | "
              f"{int(counts.median())} / {int(counts.max())} |", flush=True)
    keyed_alone(screen, rows, batches)


def keyed_alone(screen, rows: torch.Tensor, batches: list[int]) -> None:
    """Every row keyed at temperature 1 (seeds of their own): the screen's draws against
    q8_dpbf16's logits and the sampler, and each row's candidates."""
    from swaserve.sampling.params import SamplingParams
    from swaserve.sampling.rows import SamplerRow, row_prefixes
    from swaserve.sampling.sampler import Sampler

    q8w = screen.head
    sampler = Sampler(q8w.shape[0], torch.device("cpu"))
    print("\nkeyed rows at T=1 alone (ms, median of 5)")
    print("| rows | screen draws | logits + sampler | ratio | candidates a row: median / max "
          "| rows left to logits |")
    print("|---|---|---|---|---|---|")
    for m in batches:
        x = rows[:m].contiguous()
        keyed = [SamplerRow(SamplingParams(temperature=1.0), 1000 + i, 200, [1], [])
                 for i in range(m)]
        temperature = torch.ones(m)
        prefix = row_prefixes(keyed, torch.device("cpu"))

        def drawn(x=x, temperature=temperature, prefix=prefix):
            return screen.tokens(x, temperature, prefix)

        def sampled(x=x, keyed=keyed):
            return sampler(q8w.matmul(x, kernel="dpbf16"), keyed).tokens

        got, want = drawn(), sampled()
        settled = got >= 0
        assert torch.equal(got[settled], want[settled])
        a, b = median_time(drawn, 5), median_time(sampled, 5)
        counts = screen.candidates(x, temperature, prefix)[1].float()
        print(f"| {m} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f}x | "
              f"{int(counts.median())} / {int(counts.max())} | {int((~settled).sum())} |",
              flush=True)


if __name__ == "__main__":
    main()
