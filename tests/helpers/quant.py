"""int8 weights for the int8 paths: int8 copies of a float weight (and of a tiny engine's
model) in Q8_0's, Q5_0's or Q4_K's form, and GGUF block data (kernels/q8.py, mlx/quant.py)."""

from __future__ import annotations

import numpy as np
import torch


def int8_copy(w: torch.Tensor, kind: str = "q8_0"):
    """w as int8 with a float scale per 32 inputs, in tile order: Q8_0's rule (values in
    -127..127), Q5_0's range (-15..15) or Q4_K's form (0..15, a minimum per 32 as offset)."""
    from swaserve.kernels.q8_weight import Q8Weight

    blocks = w.float().view(w.shape[0], -1, 32)
    if kind == "q4_k":
        lo, hi = blocks.amin(dim=2), blocks.amax(dim=2)
        scales = (hi - lo).clamp_min(1e-8) / 15
        q = ((blocks - lo[:, :, None]) / scales[:, :, None]).round().clamp(0, 15).to(torch.int8)
        return Q8Weight(q.view(w.shape), scales, -lo).to_tiles()
    levels = {"q8_0": 127, "q5_0": 15}[kind]
    scales = blocks.abs().amax(dim=2).clamp_min(1e-8) / levels
    q = (blocks / scales[:, :, None]).round().clamp(-levels, levels).to(torch.int8)
    return Q8Weight(q.view(w.shape), scales).to_tiles()


def q8_0_blocks(w: np.ndarray) -> np.ndarray:
    """w as GGUF Q8_0 blocks, quantized by the gguf package itself."""
    import gguf

    return gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)


def k_quant_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random GGUF Q4_K / Q6_K data with finite float16 d (and dmin): every bit pattern
    of the packed scales and values occurs."""
    rng = np.random.default_rng(seed)
    size = {"Q4_K": 144, "Q6_K": 210}[kind]
    sb = rng.integers(0, 256, (n * k // 256, size), dtype=np.uint8)
    d = (rng.random((len(sb), 2)) * 1e-2 + 1e-4).astype(np.float16).view(np.uint8)
    if kind == "Q4_K":
        sb[:, 0:4] = d
    else:
        sb[:, 208:210] = d[:, :2]
    return sb.reshape(-1)


def weight_from(kind: str, raw: np.ndarray, n: int, k: int):
    """A Q8Weight read from Q4_K or Q6_K blocks."""
    from swaserve.kernels.q8_weight import Q8Weight

    return {"Q4_K": Q8Weight.from_q4_k_blocks,
            "Q6_K": Q8Weight.from_q6_k_blocks}[kind](raw, n, k)


def use_int8_copies(eng, kind: str = "q8_0", int8_activations: bool = False) -> None:
    """Give a bf16 engine's model int8 copies of its layer weights and LM head, as a GGUF's
    quantized tensors would (the tiny checkpoints are safetensors); `kind` for the layers,
    with `int8_activations` their products past q8_vnni's rows on q8_dpbusd."""
    eng.model.use_q8({"lm_head": int8_copy(eng.model.embed),
                      **{f"{i}.{name}": int8_copy(getattr(layer, name), kind)
                         for i, layer in enumerate(eng.model.layers)
                         for name in ("qkv", "o", "gate_up", "down")}},
                     int8_activations=int8_activations)
