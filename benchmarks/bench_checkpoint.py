"""A random-weight checkpoint of the bundled model's shape, for benchmarks on a machine that
cannot hold the bundled GGUF (a device machine takes a small working tree and reaches no
registry).

Two halves, so that only small files have to travel:

    python benchmarks/bench_checkpoint.py DIR --prepare             # where the GGUF is
    python benchmarks/bench_checkpoint.py DIR --weights [--layers N]  # anywhere

--prepare writes the GGUF's config (as transformers writes it) and its tokenizer files into
DIR; --weights adds a model.safetensors of random bf16 weights for that config, cut to its
last N layers if asked (a quick run of the same code on a CPU). Decode and
prefill times depend on the shapes and the token counts, not on the weights' values, so
greedy runs with ignore_eos time the same as on the bundled weights dequantized to bf16.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def prepare(out: Path) -> None:
    """config.json and tokenizer files of the bundled model."""
    from transformers import Gemma3TextConfig

    from swaserve.checkpoint.source import resolve_model
    from swaserve.checkpoint.tokenizer import load_tokenizer

    src = resolve_model(None)
    out.mkdir(parents=True, exist_ok=True)
    Gemma3TextConfig(**src.hf_config).save_pretrained(str(out))
    load_tokenizer(src)  # converts the GGUF's tokenizer once into the cache
    tok_dir = src.cache_dir() / "tokenizer"
    for f in tok_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    want = src.model_config()
    got = resolve_model(out).model_config()
    if got != want:
        raise SystemExit(f"config written to {out} reads back differently:\n{got}\n{want}")


def write_weights(out: Path, seed: int, layers: int | None) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(out))
    if layers is not None:  # the last N end on a full-attention layer, as the whole does
        cfg.layer_types = cfg.layer_types[-layers:]
        cfg.num_hidden_layers = layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--prepare", action="store_true", help="write config and tokenizer")
    ap.add_argument("--layers", type=int, default=None, help="with --weights: keep the last N layers")
    ap.add_argument("--weights", action="store_true", help="write random bf16 weights")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not (args.prepare or args.weights):
        ap.error("nothing to do: give --prepare, --weights or both")
    if args.prepare:
        prepare(args.dir)
    if args.weights:
        if not (args.dir / "config.json").exists():
            ap.error(f"{args.dir}/config.json missing: run --prepare first")
        write_weights(args.dir, args.seed, args.layers)
    print(f"checkpoint in {args.dir}: {sorted(p.name for p in args.dir.iterdir())}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
