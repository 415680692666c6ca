"""GGUF tensors as the HF-named tensors of the same model, per GGUF architecture.

llama.cpp's converter renames every tensor (`blk.N.attn_q.weight`, ...) and changes a few
layouts, which are undone here: Llama's q/k rows are permuted into its interleaved RoPE
order (`unpermute_rows`), Gemma 3's norms store 1 + w (Gemma 4's store w), and gpt-oss's
experts are split into gate / up / down stacks ([experts, out, in], or gate and up fused as
one stack), where the HF checkpoint keeps gate and up interleaved in one
[experts, in, 2 * out] tensor. Gemma 4's expert stacks are stored as HF stores them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

log = logging.getLogger("swaserve")

# the layer tensors every architecture names alike
_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LLAMA = {**_LAYER, "ffn_norm": "post_attention_layernorm"}
# per GGUF architecture: layer tensor -> HF name inside the layer
_LAYER_NAMES = {
    "gemma3": {**_LAYER, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "gemma4": {**_LAYER, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm",
               "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
               "post_ffw_norm_1": "post_feedforward_layernorm_1",
               "post_ffw_norm_2": "post_feedforward_layernorm_2",
               "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
               "post_norm": "post_per_layer_input_norm", "ffn_gate_inp": "router.proj"},
    "llama": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA,
    "gpt-oss": {**_LAYER, "post_attention_norm": "post_attention_layernorm",
                "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router"},
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight",
                 "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
                 "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
                 "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}
# Gemma 4's layer tensors whose HF names carry no `.weight`: its scalar, router scales and
# expert stacks (stored as HF stores them, [experts, out, in])
_GEMMA4_BARE = {"layer_output_scale.weight": "layer_scalar", "ffn_gate_inp.scale": "router.scale",
                "ffn_down_exps.scale": "router.per_expert_scale",
                "ffn_gate_up_exps.weight": "experts.gate_up_proj",
                "ffn_down_exps.weight": "experts.down_proj"}
# read into the config instead (gguf_meta.read_gguf_metadata)
CONFIG_TENSORS = frozenset({"rope_freqs.weight"})
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|gate_up|down)_exps\.(weight|bias)")


def gguf_name_to_hf(arch: str, name: str) -> str | None:
    """The HF name of a GGUF tensor stored one to one; None for others."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    bare = re.fullmatch(r"blk\.(\d+)\.(\w+\.\w+)", name)
    if arch == "gemma4" and bare is not None and bare.group(2) in _GEMMA4_BARE:
        return f"model.layers.{bare.group(1)}.{_GEMMA4_BARE[bare.group(2)]}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    layer = _LAYER_NAMES.get(arch, {})
    if m is None or m.group(2) not in layer:
        return None
    hf = f"model.layers.{m.group(1)}.{layer[m.group(2)]}"
    return hf if m.group(2) == "attn_sinks" else f"{hf}.{m.group(3)}"


def unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that turns llama.cpp's permuted q or k projection (n_head heads of n_rows /
    n_head rows) back into HF's: hf_rows = gguf_rows[unpermute_rows(...)]."""
    half = n_rows // n_head // 2
    # the converter moved HF row (h, j, i) (i: which half, j: pair index) to (h, i, j) -> 2j + i
    return np.arange(n_rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(-1)


def permuted_heads(arch: str, name: str, hf_config: dict[str, Any]) -> int | None:
    """How many heads llama.cpp permuted a tensor's rows over (Llama's q and k), or None."""
    if arch != "llama":
        return None
    if re.fullmatch(r"blk\.\d+\.attn_q\.(weight|bias)", name):
        return int(hf_config["num_attention_heads"])
    if re.fullmatch(r"blk\.\d+\.attn_k\.(weight|bias)", name):
        return int(hf_config["num_key_value_heads"])
    return None


def to_hf(arch: str, hf_config: dict[str, Any], tensors: Iterable[tuple[str, np.ndarray]]
          ) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for dequantized GGUF tensors (GGUF name, array in the GGUF's
    row-major shape); a tensor of no known name is logged and left out."""
    experts: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for name, arr in tensors:
        if name in CONFIG_TENSORS:
            continue
        m = _EXPERTS.fullmatch(name)
        if m is not None and arch == "gpt-oss":
            layer, part, kind = m.groups()
            group = experts.setdefault((layer, kind), {})
            group[part] = arr
            out = _gpt_oss_experts(layer, kind, group)
            if out is not None:
                del experts[(layer, kind)]
                yield out
            continue
        hf = gguf_name_to_hf(arch, name)
        if hf is None:
            log.warning("ignoring unknown GGUF tensor %s", name)
            continue
        heads = permuted_heads(arch, name, hf_config)
        if heads is not None:
            arr = arr[unpermute_rows(arr.shape[0], heads)]
        if arch == "gemma3" and hf.endswith("norm.weight"):
            arr = arr - 1.0  # llama.cpp stores Gemma's norm multiplier as 1 + w
        yield hf, arr
    if experts:
        raise ValueError("GGUF expert tensors without their pair: " + ", ".join(
            f"blk.{layer}.{sorted(parts)} ({kind})" for (layer, kind), parts in experts.items()))


def _gpt_oss_experts(layer: str, kind: str, group: dict[str, np.ndarray]
                     ) -> tuple[str, np.ndarray] | None:
    """gpt-oss's HF expert tensor once the GGUF tensors it is made of are all there: down
    [E, out, in] -> [E, in, out]; gate and up (two stacks, or one with gate first) ->
    [E, in, 2 * out] with gate in the even columns, up in the odd (biases alike)."""
    base = f"model.layers.{layer}.mlp.experts."
    suffix = "_bias" if kind == "bias" else ""
    if "down" in group:
        d = group["down"]
        return base + "down_proj" + suffix, d if kind == "bias" else d.swapaxes(1, 2)
    if "gate_up" in group:
        gate, up = np.split(group["gate_up"], 2, axis=1)
    elif "gate" in group and "up" in group:
        gate, up = group["gate"], group["up"]
    else:
        return None
    fused = np.stack([gate, up], axis=2)  # [E, out, 2, (in)]: gate, up alternate
    if kind == "bias":
        return base + "gate_up_proj" + suffix, fused.reshape(gate.shape[0], -1)
    return base + "gate_up_proj", fused.reshape(gate.shape[0], -1, gate.shape[2]).swapaxes(1, 2)
