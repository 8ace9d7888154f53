"""A loopback stand-in for the Hugging Face Hub, for tests that run the real huggingface_hub client.

It serves the routes an upload and a download use, on 127.0.0.1 only:
  POST /api/repos/create
  POST /api/validate-yaml                        called before a README.md is committed
  POST /api/models/{repo}/preupload/{rev}        every file is a "regular" (inline) upload
  POST /api/models/{repo}/commit/{rev}           NDJSON: header, file (base64), deletedFile, deletedFolder
  GET  /api/models/{repo}[/revision/{rev}]       model info with siblings
  GET  /api/models/{repo}/tree/{rev}[/{path}]    files and folders
  HEAD/GET /{repo}/resolve/{rev}/{path}          with X-Repo-Commit and ETag
Repos live in memory. `fail(route, times, status)` makes the next matching requests fail, to test retries.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    private: bool
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[str] = field(default_factory=list)

    @property
    def sha(self) -> str:
        return self.commits[-1] if self.commits else "0" * 40


@dataclass
class Request:
    method: str
    path: str
    route: str
    status: int
    authorization: str | None


class HubServer:
    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self.commit_bodies: list[bytes] = []
        self._failures: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self.gate = threading.Event()  # commits wait for it: clear() holds them, set() lets them through
        self.gate.set()
        self.in_commit = 0
        self.max_in_commit = 0  # the most commits that were in progress at one time
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

            def do_GET(self) -> None:
                server._handle(self, "GET")

            def do_HEAD(self) -> None:
                server._handle(self, "HEAD")

            def do_POST(self) -> None:
                server._handle(self, "POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------ test controls

    def fail(self, route: str, times: int, status: int = 503) -> None:
        """The next `times` requests to `route` (create, preupload, commit, info, tree, resolve) get `status`."""
        with self._lock:
            self._failures.setdefault(route, []).extend([status] * times)

    def count(self, route: str, status: int | None = None) -> int:
        return sum(1 for r in self.requests if r.route == route and (status is None or r.status == status))

    def files(self, repo_id: str) -> dict[str, bytes]:
        return dict(self.repos[repo_id].files)

    # ------------------------------------------------------------ routing

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        if h.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        route, handler, args = self._route(method, path)
        with self._lock:
            pending = self._failures.get(route)
            injected = pending.pop(0) if pending else None
        if injected is not None:
            status, headers, payload = injected, {}, json.dumps({"error": "injected failure"}).encode()
        elif handler is None:
            status, headers, payload = 404, {}, json.dumps({"error": f"no route {method} {path}"}).encode()
        else:
            status, headers, payload = handler(h, body, *args)
        self.requests.append(Request(method, path, route, status, h.headers.get("Authorization")))
        h.send_response(status)
        if isinstance(payload, (dict, list)):
            payload = json.dumps(payload).encode()
            headers.setdefault("Content-Type", "application/json")
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        if method != "HEAD":
            h.wfile.write(payload)

    def _route(self, method: str, path: str):
        repo = r"(?P<repo>[^/]+/[^/]+)"
        table = [
            ("POST", r"^/api/repos/create$", "create", self._create),
            ("POST", r"^/api/validate-yaml$", "validate-yaml", self._validate_yaml),
            ("POST", rf"^/api/models/{repo}/preupload/(?P<rev>[^/]+)$", "preupload", self._preupload),
            ("POST", rf"^/api/models/{repo}/commit/(?P<rev>[^/]+)$", "commit", self._commit),
            ("GET", rf"^/api/models/{repo}/tree/(?P<rev>[^/]+)(?:/(?P<sub>.*))?$", "tree", self._tree),
            ("GET", rf"^/api/models/{repo}(?:/revision/(?P<rev>[^/]+))?$", "info", self._info),
            ("GET", rf"^/{repo}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$", "resolve", self._resolve),
            ("HEAD", rf"^/{repo}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$", "resolve", self._resolve),
        ]
        for m, pattern, name, fn in table:
            match = re.match(pattern, path)
            if m == method and match:
                return name, fn, tuple(v for v in match.groupdict().values())
        return "unknown", None, ()

    # ------------------------------------------------------------ helpers

    def _authorized(self, h: BaseHTTPRequestHandler, repo: Repo | None) -> bool:
        if repo is None or not repo.private or self.token is None:
            return True
        return h.headers.get("Authorization") == f"Bearer {self.token}"

    def _not_found(self, code: str):
        return 404, {"X-Error-Code": code, "X-Error-Message": code}, {"error": code}

    def _repo(self, h, repo_id: str):
        repo = self.repos.get(repo_id)
        if repo is None or not self._authorized(h, repo):
            return None
        return repo

    # ------------------------------------------------------------ routes

    def _create(self, h, body: bytes):
        if self.token is not None and h.headers.get("Authorization") != f"Bearer {self.token}":
            return 401, {}, {"error": "Invalid credentials"}
        data = json.loads(body or b"{}")
        repo_id = f"{data.get('organization') or 'user'}/{data['name']}"
        private = data.get("visibility", "private" if data.get("private") else "public") == "private"
        if repo_id in self.repos:
            return 409, {}, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
        self.repos[repo_id] = Repo(private=private)
        return 200, {}, {"url": f"{self.url}/{repo_id}", "name": repo_id}

    def _validate_yaml(self, h, body: bytes):
        """A model card's metadata block must be closed: `---` first line, then a later `---` line."""
        lines = json.loads(body).get("content", "").splitlines()
        if lines and lines[0].strip() == "---" and "---" not in [x.strip() for x in lines[1:]]:
            return 400, {}, {"errors": [{"message": "unclosed metadata block"}]}
        return 200, {}, {"warnings": []}

    def _preupload(self, h, body: bytes, repo_id: str, rev: str):
        repo = self._repo(h, repo_id)
        if repo is None:
            return self._not_found("RepoNotFound")
        files = json.loads(body)["files"]
        return 200, {}, {
            "files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None} for f in files],
            "commitOid": repo.sha,
        }

    def _commit(self, h, body: bytes, repo_id: str, rev: str):
        repo = self._repo(h, repo_id)
        if repo is None:
            return self._not_found("RepoNotFound")
        self.commit_bodies.append(body)
        with self._lock:
            self.in_commit += 1
            self.max_in_commit = max(self.max_in_commit, self.in_commit)
        try:
            self.gate.wait(60)
            return self._apply_commit(repo, repo_id, body)
        finally:
            with self._lock:
                self.in_commit -= 1

    def _apply_commit(self, repo: Repo, repo_id: str, body: bytes):
        changes: dict[str, bytes | None] = {}
        folders: list[str] = []
        for line in body.decode().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "file":
                changes[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                changes[value["path"]] = None
            elif key == "deletedFolder":
                folders.append(value["path"].rstrip("/") + "/")
            elif key != "header":
                return 400, {}, {"error": f"unsupported commit line {key}"}
        with self._lock:
            for prefix in folders:
                for p in [p for p in repo.files if p.startswith(prefix)]:
                    del repo.files[p]
            for p, content in changes.items():
                if content is None:
                    repo.files.pop(p, None)
                else:
                    repo.files[p] = content
            sha = hashlib.sha1(repo.sha.encode() + body).hexdigest()
            repo.commits.append(sha)
        return 200, {}, {"commitUrl": f"{self.url}/{repo_id}/commit/{sha}", "commitOid": sha, "success": True}

    def _info(self, h, body: bytes, repo_id: str, rev: str | None):
        repo = self._repo(h, repo_id)
        if repo is None:
            return self._not_found("RepoNotFound")
        return 200, {}, {
            "id": repo_id,
            "modelId": repo_id,
            "sha": repo.sha,
            "private": repo.private,
            "siblings": [{"rfilename": p} for p in sorted(repo.files)],
        }

    def _tree(self, h, body: bytes, repo_id: str, rev: str, sub: str | None):
        repo = self._repo(h, repo_id)
        if repo is None:
            return self._not_found("RepoNotFound")
        recursive = "recursive=true" in (urlparse(h.path).query or "").lower()
        prefix = (sub.strip("/") + "/") if sub else ""
        entries, folders = [], set()
        for p, content in sorted(repo.files.items()):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix) :]
            parts = rest.split("/")
            for i in range(1, len(parts)):
                folder = prefix + "/".join(parts[:i])
                if (recursive or i == 1) and folder not in folders:
                    folders.add(folder)
                    entries.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": folder})
            if recursive or len(parts) == 1:
                entries.append({"type": "file", "oid": _git_oid(content), "size": len(content), "path": p})
        if sub and not entries:
            return self._not_found("EntryNotFound")
        return 200, {}, entries

    def _resolve(self, h, body: bytes, repo_id: str, rev: str, file: str):
        repo = self._repo(h, repo_id)
        if repo is None:
            return self._not_found("RepoNotFound")
        content = repo.files.get(file)
        if content is None:
            return self._not_found("EntryNotFound")
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{_git_oid(content)}"', "Content-Type": "application/octet-stream"}
        return 200, headers, content


def _git_oid(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
