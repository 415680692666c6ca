"""Loading checkpoint tensors through a model's parameters by a name map.

A family declares how HF names map onto its parameters: merged ones (q/k/v into `qkv`,
gate/up into `gate_up`) by shard index, the rest one to one. Every parameter must be filled
completely, or loading fails naming what is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

PREFIXES = ("model.language_model.", "language_model.", "model.")
# what the HF families share: the top-level names, and the q/k/v (weights and biases) and
# gate/up projections merged into one parameter each, stacked along dim 0
HF_TOP = {"embed_tokens.weight": "embed", "norm.weight": "final_norm", "lm_head.weight": "lm_head"}
HF_QKV = {f"self_attn.{x}_proj.{kind}": (("qkv" if kind == "weight" else "qkv_bias"), i)
          for i, x in enumerate("qkv") for kind in ("weight", "bias")}
HF_GATE_UP = {"mlp.gate_proj.weight": ("gate_up", 0), "mlp.up_proj.weight": ("gate_up", 1)}


def merged_sizes(layer: nn.Module, pname: str) -> list[int]:
    """Shard sizes of a merged parameter: q/k/v by the layer's head sizes, gate/up halves."""
    if pname in ("qkv", "qkv_bias"):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if pname == "gate_up":
        return [layer.gate_up.shape[0] // 2] * 2
    raise ValueError(f"{pname}: not a merged parameter")


@dataclass(frozen=True)
class WeightMap:
    top: dict[str, str]  # checkpoint name -> parameter, outside the layers
    single: dict[str, str]  # layer-relative checkpoint name -> layer parameter
    stacked: dict[str, tuple[str, int]] = field(default_factory=dict)  # -> (parameter, shard)
    # (layer module, parameter name) -> shard sizes along dim 0
    shard_sizes: Callable[[nn.Module, str], list[int]] = merged_sizes
    # (parameter name, checkpoint tensor, parameter) -> tensor to copy
    transform: Callable[[str, torch.Tensor, nn.Parameter], torch.Tensor] | None = None


def load_by_map(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], wmap: WeightMap,
                layers: nn.ModuleList) -> None:
    params = dict(model.named_parameters())
    filled: dict[str, set[int]] = {}
    for name, w in weights:
        for pre in PREFIXES:
            if name.startswith(pre):
                name = name[len(pre):]
                break
        shard = None
        if name in wmap.top:
            target = wmap.top[name]
        elif name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            if rest in wmap.stacked:
                pname, shard = wmap.stacked[rest]
            elif rest in wmap.single:
                pname = wmap.single[rest]
            else:
                continue
            target = f"layers.{idx}.{pname}"
        else:
            continue
        if target not in params:
            continue  # e.g. lm_head.weight of a tied model
        p = params[target]
        if wmap.transform is not None:
            w = wmap.transform(target, w, p)
        with torch.no_grad():
            if shard is None:
                if tuple(w.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: shape {tuple(w.shape)} != expected {tuple(p.shape)}")
                p.copy_(w)
            else:
                layer = layers[int(target.split(".")[1])]
                sizes = wmap.shard_sizes(layer, target.split(".", 2)[2])
                if shard >= len(sizes):
                    continue  # a part this layer has not (Gemma 4's KV-sharing layers' k, v)
                start = sum(sizes[:shard])
                if w.shape[0] != sizes[shard] or w.shape[1:] != p.shape[1:]:
                    raise ValueError(f"{name}: shape {tuple(w.shape)} does not fit {target}")
                p[start:start + sizes[shard]].copy_(w)
        filled.setdefault(target, set()).add(-1 if shard is None else shard)
    missing = []
    for target in params:
        got = filled.get(target)
        if got is None:
            missing.append(target)
            continue
        if -1 not in got:
            layer = layers[int(target.split(".")[1])]
            n = len(wmap.shard_sizes(layer, target.split(".", 2)[2]))
            if got != set(range(n)):
                missing.append(f"{target} (shards {sorted(set(range(n)) - got)})")
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
