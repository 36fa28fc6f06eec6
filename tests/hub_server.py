"""A local stand-in for the Hugging Face Hub: the part of its HTTP API that huggingface_hub's
``snapshot_download`` and ``hf_hub_download`` use, serving folders on disk, so that tests of
Hub ids need no internet (point ``HF_ENDPOINT`` at ``HubServer.endpoint``).

Routes: ``GET /api/models/{repo}/revision/{rev}`` (the commit a revision names),
``GET /api/models/{repo}/tree/{commit}`` (the files), ``HEAD|GET /{repo}/resolve/{rev}/{path}``
(a file, with the commit, ETag and size headers). A repository may require a token
(``Authorization: Bearer TOKEN``): without it every route answers 401 with the Hub's
``GatedRepo`` error code. Unknown repositories and revisions answer 404 with the Hub's error
codes. Every request is recorded (``requests``), so a test can see that nothing was asked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclasses.dataclass
class Repo:
    """A repository: its revisions (branch or tag name -> commit) and each commit's folder."""

    commits: dict[str, Path]
    refs: dict[str, str]
    token: str | None = None

    def commit(self, revision: str) -> str | None:
        """The commit ``revision`` (a ref or a commit) names, or None."""
        return revision if revision in self.commits else self.refs.get(revision)


def commit_id(folder: Path, salt: str = "") -> str:
    """A 40-hex commit id for a folder's files (stable across runs)."""
    digest = hashlib.sha1(salt.encode())
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(folder).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class HubServer:
    """``with HubServer() as hub:`` a threaded server on 127.0.0.1; ``hub.add(...)`` serves a
    repository; ``hub.endpoint`` is the value for ``HF_ENDPOINT``."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(
        self, repo_id: str, revisions: dict[str, Path], token: str | None = None
    ) -> dict[str, str]:
        """Serves ``repo_id``: each {ref name: folder} as a commit of that folder; returns
        {ref name: commit id}."""
        refs = {name: commit_id(folder, name) for name, folder in revisions.items()}
        commits = {refs[name]: folder for name, folder in revisions.items()}
        self.repos[repo_id] = Repo(commits, refs, token)
        return refs

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append((self.command, path))
                parts = path.strip("/").split("/")
                api = parts[:2] == ["api", "models"]
                repo_id = "/".join(parts[2:4] if api else parts[0:2])
                repo = hub.repos.get(repo_id)
                if repo is None:
                    return self._error(404, "RepoNotFound")
                if repo.token and self.headers.get("authorization") != f"Bearer {repo.token}":
                    return self._error(401, "GatedRepo")
                rest = parts[4:] if api else parts[2:]
                if len(rest) < 2:
                    return self._error(404, "EntryNotFound")
                kind, revision, file_parts = rest[0], rest[1], rest[2:]
                commit = repo.commit(revision)
                if commit is None:
                    return self._error(404, "RevisionNotFound")
                folder = repo.commits[commit]
                if api and kind == "revision":
                    info = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False}
                    info["siblings"] = [{"rfilename": p} for p in _files(folder)]
                    return self._json(info, body)
                if api and kind == "tree":
                    tree = [
                        {
                            "type": "file",
                            "path": p,
                            "size": (folder / p).stat().st_size,
                            "oid": _oid(folder / p),
                        }
                        for p in _files(folder)
                    ]
                    return self._json(tree, body)
                if not api and kind == "resolve":
                    file = folder.joinpath(*file_parts)
                    if not file.is_file():
                        return self._error(404, "EntryNotFound")
                    data = file.read_bytes()
                    headers = {"X-Repo-Commit": commit, "ETag": f'"{_oid(file)}"'}
                    return self._send(200, data, "application/octet-stream", headers, body)
                return self._error(404, "EntryNotFound")

            def _json(self, value, body: bool) -> None:
                self._send(200, json.dumps(value).encode(), "application/json", {}, body)

            def _error(self, status: int, code: str) -> None:
                data = json.dumps({"error": code}).encode()
                self._send(status, data, "application/json", {"X-Error-Code": code}, True)

            def _send(self, status, data: bytes, kind: str, headers: dict, body: bool) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                if body:
                    self.wfile.write(data)

        return Handler


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _oid(path: Path) -> str:
    """The git blob id of a file, as the Hub reports it for files outside LFS."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
