"""The accuracy gate of int8 activations: teacher forced over the real-model tests' prompts
and long ones past 3 W (tests/helpers/accuracy.py), the mean KL divergence of each
position's next-token distribution from the float32 engine's, and the share of positions
whose greedy token is float32's, for bf16 activations (the default), q8_dpbusd's int8
activations, and variants of int8 activations emulated in float32 (the int8 sums are
exact, so an emulation is the kernel's product up to float32 round-off; `int8-emu` checks
that against q8_dpbusd itself).

    python benchmarks/activation_accuracy.py [--variants bf16 int8 int8-g16 ...] [--short 32] [--long 3]

Variants (each on every layer product that int8 activations would take):
  bf16         q8_dpbf16 (bf16 activations, today's default)
  int8         q8_dpbusd: int8, a scale per token and 32 inputs (absmax / 127)
  int8-emu     the same, emulated
  int8-g16     a scale per token and 16 inputs
  uint8        asymmetric: per token and 32 inputs, min and max to 0..255
  uint8-g16    asymmetric per token and 16 inputs
  int8-top1    the largest |x| of each block of 32 kept exact, the rest int8 on the next
  uint8-top1   the same, the rest asymmetric
  int8-static  the 1 % of input channels largest over a calibration text kept exact
  smooth       SmoothQuant-like: each input channel divided by a power of two (calibrated;
               the weights' int8 values times it still fit int8, so the weights stay
               exact), then int8 per 32
  only-<name>  int8 on the named product only (qkv, o, gate_up, down), bf16 elsewhere
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.accuracy import Distance, gate_prompts, prompt_logprobs  # noqa: E402

CALIBRATION = ("doctest", "typing", "ast", "sqlite3", "difflib", "string", "collections",
               "tokenize", "http.server", "optparse", "pickle")


def log(msg: str) -> None:
    print(msg, flush=True)


def _blocks(x: torch.Tensor, g: int) -> torch.Tensor:
    return x.view(x.shape[0], -1, g)


def sym(x: torch.Tensor, g: int = 32) -> torch.Tensor:
    """x through int8 with a scale of absmax / 127 per row and g inputs"""
    b = _blocks(x, g)
    s = b.abs().amax(-1, keepdim=True) / 127
    return (torch.round(b / torch.where(s > 0, s, 1)).clamp(-127, 127) * s).view_as(x)


def asym(x: torch.Tensor, g: int = 32) -> torch.Tensor:
    b = _blocks(x, g)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    s = (hi - lo) / 255
    s = torch.where(s > 0, s, 1)
    return (torch.round((b - lo) / s).clamp(0, 255) * s + lo).view_as(x)


def top1(x: torch.Tensor, g: int = 32, quant=sym) -> torch.Tensor:
    b = _blocks(x, g)
    at = b.abs().argmax(-1, keepdim=True)
    keep = torch.zeros_like(b, dtype=torch.bool).scatter_(-1, at, True)
    rest = quant(torch.where(keep, 0, b).reshape_as(x), g)
    return torch.where(keep, b, _blocks(rest, g)).view_as(x)


class Emulation:
    """Q8Weight._run_tiles for q8_dpbusd, in float32: x_eff @ (q * scale).T minus the offsets
    times the exact sums of x per group, as the kernel computes."""

    def __init__(self):
        self.variant: str | None = None
        self.weights: dict[int, tuple] = {}
        self.absmax: dict[int, torch.Tensor] = {}  # calibration: per input channel
        self.layer_weights: set[int] = set()

    def parts(self, w):
        if id(w) not in self.weights:
            q, scales, offsets = w.rows()
            n, k = w.shape
            ws = (q.view(n, -1, w.group).float() * scales.float()[:, :, None]).view(n, k)
            shift = None
            qmax = q.abs().amax(0).float()  # per input channel
            if offsets is None:  # -128 also fits: q * 2^s in [-128, 127]
                lo, hi = q.amin(0).float(), q.amax(0).float()
                s = torch.zeros(k)
                for e in (1, 2, 3):
                    ok = (lo * 2 ** e >= -128) & (hi * 2 ** e <= 127)
                    s = torch.where(ok, float(e), s)
                shift = s
            else:
                shift = torch.floor(torch.log2(127 / qmax.clamp(min=1))).clamp(0, 3)
            self.weights[id(w)] = (ws, None if offsets is None else offsets.float(), shift)
        return self.weights[id(w)]

    def product(self, w, x: torch.Tensor) -> torch.Tensor:
        ws, offsets, shift = self.parts(w)
        xf = x.float()
        v = self.variant
        if v == "int8-emu":
            xe = sym(xf)
        elif v == "int8-g16":
            xe = sym(xf, 16)
        elif v == "uint8":
            xe = asym(xf)
        elif v == "uint8-g16":
            xe = asym(xf, 16)
        elif v == "int8-top1":
            xe = top1(xf)
        elif v == "uint8-top1":
            xe = top1(xf, quant=asym)
        elif v == "int8-static":
            a = self.absmax[id(w)]
            keep = torch.zeros_like(a, dtype=torch.bool)
            keep[a.topk(max(1, a.numel() // 100)).indices] = True
            xe = torch.where(keep, xf, sym(torch.where(keep, 0, xf)))
        elif v == "smooth":
            a = self.absmax[id(w)]
            target = a.median()
            want = torch.floor(torch.log2((a / target).clamp(min=1)))
            s = 2 ** torch.minimum(want, shift)
            xe = sym(xf / s) * s
        else:
            raise ValueError(v)
        y = xe @ ws.T
        if offsets is not None:
            g = ws.shape[1] // offsets.shape[1]
            y -= _blocks(xf, g).sum(-1) @ offsets.T
        return y

    def install(self):
        from swaserve.kernels import q8
        from swaserve.kernels.q8_weight import Q8Weight

        original = Q8Weight._run_tiles
        emu = self

        def run_tiles(w, fn, x, y, out_flag=0):
            if (fn is q8.dpbf16_entry() and emu.variant == "calibrate" and not out_flag
                    and x.shape[0] and id(w) in emu.layer_weights):
                a = x.float().abs().amax(0)
                emu.absmax[id(w)] = torch.maximum(emu.absmax.get(id(w), a), a)
            if fn is q8.dpbusd_entry() and emu.variant not in (None, "calibrate") and not out_flag:
                y.copy_(emu.product(w, x))
                return y
            return original(w, fn, x, y, out_flag)

        Q8Weight._run_tiles = run_tiles


def set_variant(model, emu: Emulation, variant: str) -> None:
    """The layer weights' `int8_activations` and the emulation for `variant`."""
    only = variant.removeprefix("only-") if variant.startswith("only-") else None
    for layer in model.layers:
        for name, w in layer.q8.items():
            w.int8_activations = (variant not in ("bf16", "calibrate")
                                  and (only is None or name == only))
    model._q8_tilings = None
    emu.layer_weights = {id(w) for layer in model.layers for w in layer.q8.values()}
    emu.variant = None if variant in ("bf16", "int8") or only else variant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=["bf16", "int8"])
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--long", type=int, default=3)
    args = ap.parse_args()

    from swaserve.engine.engine import Engine
    from swaserve.kernels import q8

    torch.manual_seed(0)
    options = dict(prefix_cache=False, max_running_requests=1, max_model_len=4096,
                   kv_memory="512MiB")
    ref_engine = Engine(dtype="float32", **options)
    eng = Engine(dtype="bfloat16", **options)
    log(f"prompt kernel {q8.prompt_kernel()}, int8 kernel "
        f"{q8.tile_kernel(64, int8=True)}; threads {torch.get_num_threads()}")
    prompts = gate_prompts(eng.tokenize, args.short, args.long)
    log(f"{len(prompts)} prompts, {sum(len(p) - 1 for p in prompts)} positions")
    emu = Emulation()
    emu.install()
    if {"int8-static", "smooth"} & set(args.variants):
        text = "\n\n".join(__import__(n, fromlist=["_"]).__doc__ for n in CALIBRATION)
        set_variant(eng.model, emu, "calibrate")
        emu.variant = "calibrate"
        ids = eng.tokenize(text)
        log(f"calibration: {len(ids)} tokens")
        prompt_logprobs(eng, ids)
    dist = {v: Distance() for v in args.variants}
    t0 = time.perf_counter()
    for ids in prompts:
        ref = prompt_logprobs(ref_engine, ids)
        for v in args.variants:
            set_variant(eng.model, emu, v)
            dist[v].add(ref, prompt_logprobs(eng, ids))
        del ref
    log(f"{time.perf_counter() - t0:.0f} s")
    short = args.short
    log("variant        | mean KL all | greedy all | KL short | greedy short | KL long | "
        "greedy long | KL long >= 3W | greedy >= 3W")
    for v, d in dist.items():
        s, lg = Distance(d.kl[:short], d.same[:short]), Distance(d.kl[short:], d.same[short:])
        cols = [d.summary(), s.summary()]
        if lg.kl:
            cols += [lg.summary(), lg.summary(first=3 * 512)]
        log(f"{v:14s} | " + " | ".join(f"{kl:.5f} | {same:.4f}" for kl, same, _ in cols))


if __name__ == "__main__":
    main()
