"""The int8 weight (kernels/q8_weight.py): GGUF Q8_0, Q4_K and Q6_K blocks read as int8 +
scales are the GGUF's weights exactly; the tiles, and the 5- and 4-bit packed copies
q8_vnni reads, hold the same weight; bad shapes are refused. And the kernels' build: one
header for every signature, an unwritable cache leaves a kernel off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swaserve.kernels import q8
from swaserve.kernels.q8_weight import BLOCK, Q8Weight
from tests.conftest import k_quant_blocks, q8_0_blocks, weight_from
from tests.kernels.conftest import random_weight


def test_blocks_read_as_int8_and_scales_are_the_dequantized_weights():
    import gguf

    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    raw = q8_0_blocks(w)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    got = Q8Weight.from_q8_0_blocks(raw, 48, 96).dequantize().numpy()
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_blocks_read_as_int8_are_the_dequantized_weights(kind):
    import gguf

    raw = k_quant_blocks(kind, 32, 512, 0)
    ref = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(32, 512)
    w = weight_from(kind, raw, 32, 512)
    assert (w.group, w.offsets is not None) == ((32, True) if kind == "Q4_K" else (16, False))
    assert not w.plain and not w.takes(torch.zeros(1, 512))  # q8_matvec takes plain only
    assert np.array_equal(w.dequantize().numpy(), ref)
    t = w.to_tiles()
    assert np.array_equal(t.dequantize().numpy(), ref)
    assert all(a is b or torch.equal(a, b) for a, b in zip(t.rows(), w.rows()))


def test_tiles_hold_the_same_weight():
    w = random_weight(48, 96, 0)
    t = w.to_tiles()
    assert t.tiled and t.shape == w.shape and t.q.shape == (3, 3, 16, 16, 2)
    q, s, o = t.rows()
    assert torch.equal(q, w.q) and torch.equal(s, w.scales) and o is None
    # block (n, b), pair p, output j, value i is weight [16 n + j, 32 b + 2 p + i]
    assert t.q[2, 1, 5, 7, 1] == w.q[2 * 16 + 7, 1 * 32 + 2 * 5 + 1]
    assert torch.equal(t.dequantize(), w.dequantize())
    with pytest.raises(ValueError, match="multiple of 16"):
        random_weight(40, 32, 0).to_tiles()
    with pytest.raises(ValueError, match="row-major"):
        Q8Weight.stack([t, w])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="K % 32"):
        Q8Weight(torch.zeros(4, 30, dtype=torch.int8), torch.ones(4, 1))
    with pytest.raises(ValueError, match="scales"):
        Q8Weight(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3))


def test_an_unwritable_cache_leaves_the_kernel_off_not_the_engine_broken(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    from pathlib import Path

    from swaserve.kernels import build

    source = Path(q8.__file__).with_name("q8.c")
    assert build.compile_library("cc", source, blocker / "kernels" / "q8.so") is False


def test_one_header_holds_every_kernels_signature_and_flags():
    """kernels.h is the one place for prototypes and shared flags: every exported symbol of
    every kernel library is declared there, and the bindings take their types from it."""
    import re
    from pathlib import Path

    from swaserve.kernels import build

    sig = build.signatures()
    here = Path(q8.__file__).parent
    for c in sorted(here.glob("*.c")):
        text = re.sub(r"/\*.*?\*/", "", c.read_text(), flags=re.S)
        exported = re.findall(r"^(?:int|void) (\w+)\(", text, re.M)
        assert exported and set(exported) <= set(sig), (c.name, set(exported) - set(sig))
        lib = build.load(c.stem)
        if lib is None:
            continue
        for name in set(exported):
            fn = build.function(c.stem, name)
            assert fn.argtypes == sig[name][1] and fn.restype == sig[name][0]
    flags = build.constants()
    assert flags["Q8_BF16_OUT"] == 4 and q8.MAX_ROWS == flags["Q8_MAX_ROWS"]
    assert len(sig["decode_layers"][1]) == 15 and sig["rms_norm_bf16"][0] is None


@pytest.mark.skipif(not q8.vnni_available(), reason="no AVX-512 VNNI here")
@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K", "Q8_0", "Q6_K"])
def test_vnni_reads_q5_0_and_q4_k_packed_with_the_same_bits(kind):
    """Tiles of Q5_0 (q in -16..15) and Q4_K (0..15) values are also kept in 5 and 4 bits,
    which q8_vnni reads instead of the int8 tiles: 5/8 and half the bytes, the same sums
    bit for bit; Q8_0's and Q6_K's (a scale per 16) stay int8."""
    import gguf

    w = np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32)
    if kind in ("Q5_0", "Q8_0"):
        read = getattr(Q8Weight, f"from_{kind.lower()}_blocks")
        weight = read(gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind)), 64, 512)
    else:
        weight = weight_from(kind, k_quant_blocks(kind, 64, 512, 4), 64, 512)
    t = weight.to_tiles()
    if kind in ("Q8_0", "Q6_K"):
        assert t.packed is None
        return
    packed, _ = t.packed
    assert packed.numel() == t.q.numel() * {"Q5_0": 5, "Q4_K": 4}[kind] // 8
    for m in range(1, q8.VNNI_ROWS + 1):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        got = t.matmul(x, kernel="vnni")
        keep, t.packed = t.packed, None
        want = t.matmul(x, kernel="vnni")
        t.packed = keep
        assert torch.equal(got, want), m


@pytest.mark.parametrize("vnni", [True, False])
def test_probe_block_is_the_tiled_weight_of_ones(vnni):
    """q8.py's availability probe lays out its block by hand (q8.py cannot import
    Q8Weight, which imports it): the same bytes and flags as Q8Weight gives the kernel."""
    w = Q8Weight(torch.ones(q8.TILE_N, BLOCK, dtype=torch.int8),
                 torch.full((q8.TILE_N, 1), 0.5)).to_tiles()
    values, flags = w.tiles_for("vnni" if vnni else "amx")
    q, scales, probe_flags = q8.probe_block(vnni)
    assert torch.equal(q.view(torch.uint8), values.reshape(-1).view(torch.uint8))
    assert torch.equal(scales, w.scales.reshape(-1)) and probe_flags == flags
