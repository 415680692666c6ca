"""What the families' GGUF maps share: the metadata keys every llama.cpp architecture writes
(`<arch>.block_count`, `<arch>.rope.scaling.*`, `tokenizer.ggml.*_token_id`, ...) read into an
HF config dict, and the tensor names every architecture spells alike, renamed to HF's.

llama.cpp's converter renames every tensor (`blk.N.attn_q.weight`, ...) and changes a few
layouts, which each family undoes in its own `gguf.py` (Llama's permuted q/k rows:
`unpermute_rows`; gpt-oss's expert stacks; Gemma 3's 1 + w norms).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

log = logging.getLogger("swaserve")

# the layer tensors every architecture names alike
LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight",
                 "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
                 "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
                 "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}
# read into the config instead (gguf_meta.read_gguf_metadata)
CONFIG_TENSORS = frozenset({"rope_freqs.weight"})
EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|gate_up|down)_exps\.(weight|bias)")


def hf_name(name: str, layer_names: Mapping[str, str],
            bare: Mapping[str, str] | None = None) -> str | None:
    """The HF name of a GGUF tensor stored one to one (`layer_names`: the family's layer
    tensors; `bare`: those whose HF names carry no `.weight`); None for others."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+\.\w+)", name)
    if bare and m is not None and m.group(2) in bare:
        return f"model.layers.{m.group(1)}.{bare[m.group(2)]}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m is None or m.group(2) not in layer_names:
        return None
    hf = f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"
    return hf if m.group(2) == "attn_sinks" else f"{hf}.{m.group(3)}"


def unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that turns llama.cpp's permuted q or k projection (n_head heads of n_rows /
    n_head rows) back into HF's: hf_rows = gguf_rows[unpermute_rows(...)]."""
    half = n_rows // n_head // 2
    # the converter moved HF row (h, j, i) (i: which half, j: pair index) to (h, i, j) -> 2j + i
    return np.arange(n_rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(-1)


# a family's expert stacks: (layer, part, kind, the parts so far) -> the HF tensor once all
# its parts are there, else None
Experts = Callable[[str, str, str, dict[str, np.ndarray]], "tuple[str, np.ndarray] | None"]


def renamed(tensors: Iterable[tuple[str, np.ndarray]], name_of: Callable[[str], str | None],
            heads_of: Callable[[str], int | None] | None = None,
            adjust: Callable[[str, np.ndarray], np.ndarray] | None = None,
            experts: Experts | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for dequantized GGUF tensors (GGUF name, array in the GGUF's
    row-major shape): renamed by `name_of`, rows unpermuted over `heads_of`'s heads, then
    `adjust`ed (HF name, array); expert stacks gathered by `experts`. A tensor of no known
    name is logged and left out."""
    groups: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for name, arr in tensors:
        if name in CONFIG_TENSORS:
            continue
        m = EXPERTS.fullmatch(name)
        if m is not None and experts is not None:
            layer, part, kind = m.groups()
            group = groups.setdefault((layer, kind), {})
            group[part] = arr
            out = experts(layer, part, kind, group)
            if out is not None:
                del groups[(layer, kind)]
                yield out
            continue
        hf = name_of(name)
        if hf is None:
            log.warning("ignoring unknown GGUF tensor %s", name)
            continue
        heads = heads_of(name) if heads_of is not None else None
        if heads is not None:
            arr = arr[unpermute_rows(arr.shape[0], heads)]
        yield hf, adjust(hf, arr) if adjust is not None else arr
    if groups:
        raise ValueError("GGUF expert tensors without their pair: " + ", ".join(
            f"blk.{layer}.{sorted(parts)} ({kind})" for (layer, kind), parts in groups.items()))


# -- metadata --------------------------------------------------------------------------------

# llama.cpp's `rope.scaling.type` values -> HF rope types
_ROPE_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}
Keys = Callable[..., Any]  # `<arch>.KEY` of the metadata, or the default when it is absent


def keys(meta: dict[str, Any], arch: str) -> Keys:
    """g(key, default=None): the metadata's `<arch>.<key>`."""
    def g(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}")
        return default if value is None else value

    return g


def base_config(meta: dict[str, Any], arch: str, hf_architecture: str) -> dict[str, Any]:
    """The HF config every llama.cpp architecture's keys give (one head size for all layers,
    SiLU; a family's `gguf.py` adds its own design)."""
    g = keys(meta, arch)
    types = meta.get("GGUF.tensor_types", {})
    n = int(g("block_count"))
    heads, hidden = int(g("attention.head_count")), int(g("embedding_length"))
    head_dim = int(g("attention.key_length") or g("rope.dimension_count") or hidden // heads)
    if int(g("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"GGUF {arch}: key length {head_dim} != value length "
                         f"{g('attention.value_length')} (swaserve needs them equal)")
    cfg = {
        "architectures": [hf_architecture],
        "hidden_size": hidden,
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "intermediate_size": int(g("expert_feed_forward_length") or g("feed_forward_length")),
        "vocab_size": int(g("vocab_size") or vocab_size(meta)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10_000.0)),
        "max_position_embeddings": int(g("context_length", 8192)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in types,
        **special_tokens(meta),
    }
    scaling = rope_scaling(g)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2's keys
        if g(cap) is not None:
            cfg[cap] = float(g(cap))
    return cfg


def vocab_size(meta: dict[str, Any]) -> int:
    """The tokenizer's size (0 when the metadata has no tokens)."""
    return meta.get("tokenizer.ggml.tokens#len") or len(meta.get("tokenizer.ggml.tokens", ()))


def special_tokens(meta: dict[str, Any]) -> dict[str, Any]:
    """bos, pad, and as eos every id llama.cpp ends generation at (eos, end of turn, end of
    message), eos first."""
    eos = []
    for key in ("eos", "eot", "eom"):
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and int(tid) not in eos:
            eos.append(int(tid))
    return {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}


def rope_scaling(g: Keys) -> dict[str, Any] | None:
    """`rope.scaling.*` as an HF rope_scaling dict; None when unscaled."""
    kind = g("rope.scaling.type")
    if kind is None or _ROPE_TYPES.get(kind) == "default":
        return None
    if kind not in _ROPE_TYPES:
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn)")
    scaling: dict[str, Any] = {"rope_type": _ROPE_TYPES[kind],
                               "factor": float(g("rope.scaling.factor", 1.0))}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = int(g("rope.scaling.original_context_length"))
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_attn_factor", "attention_factor")):
            if g(f"rope.scaling.{key}") is not None:
                scaling[hf] = float(g(f"rope.scaling.{key}"))
    return scaling


def per_layer(value: Any, n: int) -> list[int]:
    """A per-layer key (one value for all layers, or a list) as a list of n ints."""
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * n
