"""A GGUF split into parts by llama.cpp's gguf-split: `NAME-00001-of-00003.gguf`, ... Each
part is a GGUF of its own; the first holds the model's key/values, every part holds some of
the tensors and the `split.*` keys (`split.no`, from 0; `split.count`;
`split.tensors.count`, the tensors of all parts).

Any part finds the others by that naming rule; they are checked against each other (all
there, each the part its name says, no tensor twice, as many tensors as part 1 counts),
and the tensor facts a config needs (gguf_meta.read_gguf_metadata's) are gathered from all
of them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from swaserve.checkpoint.gguf_meta import GGUFFormatError, read_gguf_metadata

# the end of a part's file stem: -<part, from 1>-of-<parts>
SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})$")
# tensor facts read_gguf_metadata takes from a file's tensor table (not its key/values)
_TENSOR_FACTS = ("GGUF.tensor_types", "GGUF.rope_freqs", "GGUF.per_layer_vocab")


class GGUFSplitError(ValueError):
    """A split GGUF's parts cannot be found or do not fit together."""


def part_path(prefix: Path, part: int, parts: int) -> Path:
    """The file of part `part` (from 1) of `parts`, by llama.cpp's naming rule."""
    return prefix.with_name(f"{prefix.name}-{part:05d}-of-{parts:05d}.gguf")


def split_parts(path: Path, meta: dict[str, Any]) -> tuple[Path, ...]:
    """All files of the model that the GGUF `path` (with its key/values `meta`) belongs to,
    in part order; (path,) for a GGUF that is not split. The names follow from `path`'s own
    name, which must be the one llama.cpp gives its part."""
    parts = int(meta.get("split.count", 1) or 1)
    if parts <= 1:
        return (path,)
    no = int(meta.get("split.no", 0)) + 1
    m = SPLIT_PART.search(path.name.removesuffix(".gguf"))
    if (not path.name.endswith(".gguf") or m is None or not path.name[:m.start()]
            or (int(m[1]), int(m[2])) != (no, parts)):
        raise GGUFSplitError(
            f"{path}: part {no} of a GGUF split into {parts} files, but not named "
            f"NAME-{no:05d}-of-{parts:05d}.gguf as llama.cpp names the parts (the name "
            "that finds the others): rename the parts so")
    prefix = path.with_name(path.name[:m.start()])
    return tuple(part_path(prefix, i + 1, parts) for i in range(parts))


def read_split_metadata(parts: tuple[Path, ...]) -> dict[str, Any]:
    """The key/values of part 1 with the tensor facts of all parts (read_gguf_metadata's,
    gathered); a GGUFSplitError names a part that is missing or does not fit."""
    meta: dict[str, Any] = {}
    types: dict[str, int] = {}
    for i, path in enumerate(parts):
        if not path.is_file():
            raise GGUFSplitError(f"part {i + 1} of {len(parts)} of the split GGUF is missing: "
                                 f"{path}")
        try:
            m = read_gguf_metadata(path)
        except (GGUFFormatError, OSError) as e:
            raise GGUFSplitError(f"{path}: not a readable GGUF file ({e})") from e
        says = (int(m.get("split.no", 0)) + 1, int(m.get("split.count", 1) or 1))
        if says != (i + 1, len(parts)):
            raise GGUFSplitError(f"{path}: its metadata says part {says[0]} of {says[1]}, its "
                                 f"name part {i + 1} of {len(parts)}")
        twice = sorted(types.keys() & m["GGUF.tensor_types"].keys())
        if twice:
            raise GGUFSplitError(f"{path}: tensors also in an earlier part: {', '.join(twice)}")
        types.update(m["GGUF.tensor_types"])
        if i == 0:
            meta = {k: v for k, v in m.items() if k not in _TENSOR_FACTS}
        for fact in _TENSOR_FACTS[1:]:
            if fact in m:
                meta[fact] = m[fact]
    meta["GGUF.tensor_types"] = types
    expected = meta.get("split.tensors.count")
    if expected is not None and int(expected) != len(types):
        raise GGUFSplitError(f"{parts[0]}: the parts hold {len(types)} tensors, part 1 counts "
                             f"{int(expected)}")
    return meta
