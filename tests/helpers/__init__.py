"""Helpers the tests of several layers share, by kind: checkpoints.py (tiny checkpoints
written by transformers), reference.py (transformers' own results), quant.py (int8 copies
and GGUF block data), gguf_writer.py (GGUF files as llama.cpp's converter writes them),
servers.py (a `swaserve serve` process). tests/conftest.py re-imports
each of them, so `from tests.conftest import X` finds them too."""
