"""Models named by a Hugging Face hub id: `org/name` (a safetensors checkpoint) or
`org/name:TAG` (the one GGUF file of a quantization, llama.cpp's `-hf` form), fetched
through huggingface_hub into its cache (HF_HOME, HF_TOKEN, HF_HUB_OFFLINE and HF_ENDPOINT
apply) with only the files the engine reads. Offline, the cache answers alone."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from swaserve.checkpoint.gguf_split import SPLIT_PART

DEFAULT_GGUF_TAG = "Q4_K_M"

# Beside the weights, what a checkpoint directory is read for: its config and tokenizer.
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
HF_SIDE_FOLDERS = ("additional_chat_templates/",)
# a sentence-transformers embedding model's modules (checkpoint/sentence.py)
SENTENCE_FILES = ("modules.json",)
SENTENCE_MODULE = re.compile(r"\d+_\w+/(config\.json|model\.safetensors)")
# transformers' own names for a safetensors checkpoint, which repos that also carry
# another layout (Mistral's consolidated.safetensors) are told apart by
TRANSFORMERS_WEIGHTS = re.compile(r"model(-\d+-of-\d+)?\.safetensors")
QUANT_WORD = re.compile(r"(?i)I?Q\d\w*|B?F\d+|MXFP4\w*|TQ\d\w*")
# org/name with an optional :TAG, in the characters the hub allows
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<tag>[\w.-]+))?")


class HubError(ValueError):
    """A hub model that cannot be had: the message says why and what to do."""


@dataclass(frozen=True)
class HubRef:
    """A model named by hub id, as the user wrote it."""

    repo_id: str
    tag: str | None = None  # a GGUF quantization, e.g. Q4_K_M


def parse_hub_id(model: str) -> HubRef | None:
    """`org/name` or `org/name:TAG` as a HubRef; None for what cannot be a hub id (a path
    such as `./x`, `/abs/x`, `a/b/c`, or one naming a .gguf file)."""
    m = HUB_ID.fullmatch(model)
    if m is None or m["repo"].endswith(".gguf") or ".." in m["repo"]:
        return None
    return HubRef(m["repo"], m["tag"])


def download(ref: HubRef, revision: str | None = None) -> Path:
    """The local copy of a hub model: the snapshot directory of a safetensors checkpoint,
    or the GGUF file (its first part when split) of the quantization asked for."""
    from huggingface_hub import snapshot_download

    files = _repo_files(ref, revision)
    wanted, gguf = pick_files(ref, files)
    try:
        snapshot = Path(snapshot_download(ref.repo_id, revision=revision,
                                          allow_patterns=wanted))
    except _download_errors() as e:
        raise _explain(e, ref, revision) from e
    return snapshot / gguf if gguf is not None else snapshot


def pick_files(ref: HubRef, files: list[str]) -> tuple[list[str], str | None]:
    """The files to download from a repo's listing, and the GGUF among them to load (None
    for a safetensors checkpoint). A tag, or a repo of GGUFs alone, picks a GGUF."""
    name = _display(ref)
    ggufs = [f for f in files if f.lower().endswith(".gguf")
             and not PurePosixPath(f).name.lower().startswith("mmproj")]
    weights = [f for f in files if "/" not in f and f.endswith(".safetensors")]
    if ref.tag is None and weights:
        own = [f for f in weights if TRANSFORMERS_WEIGHTS.fullmatch(f)]
        side = [f for f in files if f in HF_SIDE_FILES or f.startswith(HF_SIDE_FOLDERS)
                or f in SENTENCE_FILES or SENTENCE_MODULE.fullmatch(f)
                or (f.endswith(".safetensors.index.json") and "/" not in f)]
        return sorted(side + (own or weights)), None
    if not ggufs:
        if ref.tag is not None and weights:
            raise HubError(f"{name}: {ref.repo_id} has no GGUF files, so a quantization tag "
                           f"does not apply; name it as {ref.repo_id} for its safetensors")
        raise HubError(f"{name}: {ref.repo_id} has neither *.safetensors nor .gguf files, "
                       "so swaserve cannot load it")
    tag = ref.tag or DEFAULT_GGUF_TAG
    models = _gguf_models(ggufs)
    matching = [m for m in models if _carries_tag(m, tag)]
    if not matching and ref.tag is None and len(models) == 1:
        matching = list(models)  # one GGUF and no tag asked for: that one
    if not matching:
        tags = sorted({_tag_of(m) for m in models})
        raise HubError(f"{name}: no GGUF file of {ref.repo_id} carries the tag {tag!r}; "
                       f"its tags: {', '.join(tags)} (name one as {ref.repo_id}:TAG)")
    if len(matching) > 1:
        raise HubError(f"{name}: several GGUF files of {ref.repo_id} carry the tag {tag!r} "
                       f"({', '.join(matching)}); name one of them more exactly")
    parts = models[matching[0]]
    return parts, parts[0]


def _gguf_models(ggufs: list[str]) -> dict[str, list[str]]:
    """GGUF files grouped into models: a split model's parts under one name (its path
    without the -0000k-of-0000n), in part order."""
    models: dict[str, list[str]] = {}
    for f in sorted(ggufs):
        stem = f[:-len(".gguf")]
        models.setdefault(SPLIT_PART.sub("", stem), []).append(f)
    return models


def _carries_tag(model: str, tag: str) -> bool:
    """Whether a GGUF's path carries the tag as a whole word, case aside: Q4_K matches
    `x-Q4_K.gguf` and `Q4_K/x.gguf` but not `x-Q4_K_M.gguf`."""
    word = re.escape(tag.lower())
    return re.search(rf"(?:^|[-._/]){word}(?:$|[-./])", model.lower()) is not None


def _tag_of(model: str) -> str:
    """The quantization a GGUF's path names, its last word that looks like one
    (`x-Q4_K_M` -> Q4_K_M, `Q6_K/model` -> Q6_K), else its last word."""
    words = re.split(r"[-./]", model)
    quants = [w for w in words if QUANT_WORD.fullmatch(w)]
    return (quants or words)[-1].upper()


def _display(ref: HubRef) -> str:
    return ref.repo_id if ref.tag is None else f"{ref.repo_id}:{ref.tag}"


def _repo_files(ref: HubRef, revision: str | None) -> list[str]:
    """The repo's files at the revision, from the hub, or from the cache when the hub
    cannot be reached (offline mode included)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:  # the repo's info lists its files in one request (list_repo_files retries for long)
        info = HfApi().model_info(ref.repo_id, revision=revision)
        return sorted(s.rfilename for s in info.siblings or ())
    except HfHubHTTPError as e:  # the hub answered: not found, gated, refused
        raise _explain(e, ref, revision) from e
    except _unreachable_errors() as e:
        cached = _cached_files(ref.repo_id, revision)
        if cached is None:
            raise _not_cached(ref, revision, e) from e
        return cached


def _cached_files(repo_id: str, revision: str | None) -> list[str] | None:
    """The repo's files as the cache knows them (None when it has no snapshot of the
    revision): the listing a download saved, else the snapshot's own files."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    cached_tree = getattr(huggingface_hub, "get_cached_repo_tree", None)  # from 2.x
    if cached_tree is not None:
        try:
            return sorted(f.path for f in cached_tree(repo_id, revision=revision))
        except huggingface_hub.errors.CachedRepoTreeNotFoundError:
            pass
    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id,
                                                              repo_type="model")
    commit = revision or constants.DEFAULT_REVISION
    if not re.fullmatch(r"[0-9a-f]{40}", commit):  # a branch or tag: its commit's ref
        ref_file = storage / "refs" / commit
        if not ref_file.is_file():
            return None
        commit = ref_file.read_text().strip()
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*")
                  if p.is_file())


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the hub cannot be reached: offline mode, and the
    transport errors of its HTTP client (httpx2, httpx or requests, by its version)."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    errors: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError, TimeoutError]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"),
                         ("requests", "ConnectionError"), ("requests", "Timeout")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _download_errors() -> tuple[type[BaseException], ...]:
    """What snapshot_download raises that _explain turns into a HubError."""
    from huggingface_hub import errors

    return (errors.HfHubHTTPError, errors.LocalEntryNotFoundError,
            getattr(errors, "IncompleteSnapshotError", errors.LocalEntryNotFoundError),
            *_unreachable_errors())


def _not_cached(ref: HubRef, revision: str | None, why: BaseException) -> HubError:
    from huggingface_hub import constants, errors

    what = (f"{_display(ref)}{f' at revision {revision}' if revision else ''} is no local "
            f"path and not in the Hugging Face cache ({constants.HF_HUB_CACHE})")
    if constants.HF_HUB_OFFLINE:
        return HubError(f"{what} and HF_HUB_OFFLINE is set, so the hub is not asked: unset "
                        "it to download the model")
    detail = ("" if isinstance(why, errors.LocalEntryNotFoundError)
              else f": {_first_line(why)}")
    return HubError(f"{what} and the hub ({constants.ENDPOINT}) cannot be reached "
                    f"({type(why).__name__}{detail}); check the network and HF_ENDPOINT, "
                    "or set HF_HUB_OFFLINE=1 to use the cache alone")


def _explain(e: BaseException, ref: HubRef, revision: str | None) -> HubError:
    """One clear HubError for an error of huggingface_hub's."""
    from huggingface_hub import errors

    name = _display(ref)
    if isinstance(e, errors.GatedRepoError):
        return HubError(f"{name}: {ref.repo_id} is gated: accept its terms on its hub page "
                        "and set HF_TOKEN to a token of that account (or run `hf auth login`)")
    if isinstance(e, errors.RepositoryNotFoundError):
        return HubError(f"{name}: no such local path, and no model {ref.repo_id} on the "
                        "Hugging Face hub (or it is private and HF_TOKEN is not set to a token "
                        "with access to it)")
    if isinstance(e, errors.RevisionNotFoundError):
        return HubError(f"{name}: {ref.repo_id} has no revision {revision!r}")
    if isinstance(e, errors.LocalEntryNotFoundError):  # an HTTP error in older versions
        return _not_cached(ref, revision, e)
    if isinstance(e, errors.HfHubHTTPError):
        response = getattr(e, "response", None)
        status = response.status_code if response is not None else "?"
        if status in (401, 403):
            return HubError(f"{name}: the hub refused access to {ref.repo_id} (HTTP "
                            f"{status}); set HF_TOKEN to a token with access to it")
        return HubError(f"{name}: the hub answered HTTP {status} ({_first_line(e)})")
    return _not_cached(ref, revision, e)


def _first_line(e: BaseException, limit: int = 200) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line if len(line) <= limit else line[:limit] + "..."
