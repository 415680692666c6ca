"""A stand-in for the Hugging Face hub on a local port: the few endpoints huggingface_hub's
snapshot_download and list_repo_files call (repo info, the file tree, a file's resolve URL
with the headers it checks), so that huggingface_hub itself lays out its cache; and tiny
GGUF files (metadata only) to fill GGUF repos with."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def commit_of(repo_id: str) -> str:
    return hashlib.sha1(repo_id.encode()).hexdigest()


class FakeHub:
    """Repos as {repo_id: {path in repo: bytes}}; `gated` repos list their files but refuse
    to serve them (as the hub does without an accepted token)."""

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: frozenset[str] = frozenset()):
        self.repos, self.gated = repos, gated

    @contextmanager
    def serving(self):
        """The hub at http://127.0.0.1:PORT (yielded) until the block ends."""
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hub._answer(self, body=True)

            def do_HEAD(self):
                hub._answer(self, body=False)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()
            thread.join()

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+|/tree/[^/]+)?", path)
        if m is not None:
            repo = self.repos.get(m[1])
            if repo is None:
                return self._error(h, 404, "RepoNotFound", body)
            if "/tree/" in path:
                data = [{"type": "file", "path": f, "size": len(b),
                         "oid": hashlib.sha1(b).hexdigest()} for f, b in sorted(repo.items())]
            else:
                data = {"id": m[1], "sha": commit_of(m[1]), "private": False,
                        "siblings": [{"rfilename": f} for f in sorted(repo)]}
            return self._send(h, 200, json.dumps(data).encode(),
                              {"Content-Type": "application/json"}, body)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        repo = self.repos.get(m[1]) if m is not None else None
        if repo is None:
            return self._error(h, 404, "RepoNotFound", body)
        if m[1] in self.gated:
            return self._error(h, 401, "GatedRepo", body)
        data = repo.get(m[3])
        if data is None:
            return self._error(h, 404, "EntryNotFound", body)
        self._send(h, 200, data, {"X-Repo-Commit": commit_of(m[1]),
                                  "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                                  "Content-Type": "application/octet-stream"}, body)

    def _error(self, h, status: int, code: str, body: bool) -> None:
        self._send(h, status, json.dumps({"error": code}).encode(),
                   {"X-Error-Code": code, "X-Error-Message": code,
                    "Content-Type": "application/json"}, body)

    @staticmethod
    def _send(h, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        h.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(data))}.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)


def directory_files(path: str | Path) -> dict[str, bytes]:
    """A local checkpoint directory as a repo's files."""
    root = Path(path)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def tiny_gguf_bytes(tmp: Path, name: str, split: tuple[int, int] | None = None) -> bytes:
    """A GGUF with a small Gemma 3's metadata and no tensors; `general.name` says which
    file it is, `split` = (part index, parts) marks it a gguf-split part."""
    import gguf

    path = tmp / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name(name)
    w.add_block_count(6)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_context_length(512)
    w.add_sliding_window(8)
    w.add_vocab_size(128)
    if split is not None:
        w.add_uint16("split.no", split[0])
        w.add_uint16("split.count", split[1])
        w.add_int32("split.tensors.count", 0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()
