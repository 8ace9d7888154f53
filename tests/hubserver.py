"""A loopback stand-in for the Hugging Face Hub, for tests and benchmarks that run the real huggingface_hub client.

It serves the routes an upload, a download and storage management use, on 127.0.0.1 only:
  POST /api/repos/create
  POST /api/validate-yaml                        called before a README.md is committed
  POST /api/models/{repo}/preupload/{rev}        "lfs" for weight files and files of 10 MiB or more, else "regular"
  POST /{repo}.git/info/lfs/objects/batch        LFS basic transfer: an upload URL per object not stored yet
  PUT  /lfs-upload/{repo}/{oid}                  the object's bytes, streamed to disk and checked against its sha256
  POST /api/models/{repo}/commit/{rev}           NDJSON: header, file (base64), lfsFile, deletedFile, deletedFolder;
                                                 412 when the header's parentCommit is not the head
  GET  /api/models/{repo}[/revision/{rev}]       model info with siblings and usedStorage
  GET  /api/models/{repo}/tree/{rev}[/{path}]    files (with their LFS pointer info) and folders
  GET  /api/models/{repo}/lfs-files              every LFS object the repo stores
  POST /api/models/{repo}/lfs-files/batch        permanently delete LFS objects
  HEAD/GET /{repo}/resolve/{rev}/{path}          with X-Repo-Commit and ETag; LFS files streamed from disk
  GET  /api/datasets/{repo}[/revision/{rev}], GET /api/datasets/{repo}/tree/{rev}[/{path}],
  POST /api/datasets/{repo}/paths-info/{rev}, HEAD/GET /datasets/{repo}/resolve/{rev}/{path}
                                                 dataset repos (`commit_dataset`), read at any branch (main, or one
                                                 such as refs/convert/parquet, URL-encoded as the client sends it) or
                                                 commit; data files and files of 10 MiB or more stored as LFS objects
HTTP Range (`bytes=a-b`, `bytes=a-`) is answered with 206 and the part asked for; `sent` counts the body bytes of
every response by route (e.g. sent["dataset-resolve"]: what the dataset downloads cost).
Storage is counted as the Hub counts it: an LFS object keeps counting after the file that used it is deleted or
replaced, until it is permanently deleted. Use it with HF_HUB_DISABLE_XET=1, so the client takes the LFS path.
`fail(route, times, status)` makes the next matching requests fail, to test retries. A 503 or 429 says
`Retry-After: 0` unless told another (`retry_after`), as a Hub that asks for an immediate retry would: huggingface_hub's
own backoff then waits 1 s a try (without it, 1 + 2 + 4 + 8 + 8 s for every call it retries). `kind="reset"` closes
the connection instead of answering (a connection reset mid-request), `kind="timeout"` holds the request `delay`
seconds and then closes it unanswered (a Hub that stopped answering).
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import json
import re
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".pt", ".bin", ".safetensors", ".pth", ".distcp")
DATA_LFS_SUFFIXES = (".parquet", ".arrow")
LFS_MIN_BYTES = 10 * 2**20
CHUNK = 4 * 2**20


@dataclass
class Blob:
    content: bytes | None  # a regular file's bytes; None for an LFS file
    size: int
    sha256: str | None = None  # the LFS object this file points to


@dataclass
class LfsObject:
    size: int
    pushed_at: str
    filename: str = ""


@dataclass
class Repo:
    private: bool
    server: HubServer
    tree: dict[str, Blob] = field(default_factory=dict)
    lfs: dict[str, LfsObject] = field(default_factory=dict)
    commits: list[str] = field(default_factory=list)
    snapshots: dict[str, dict[str, Blob]] = field(default_factory=dict)  # the tree at each commit

    def tree_at(self, rev: str | None) -> dict[str, Blob] | None:
        """The tree at a revision: main (the head) or a commit; None for one the repo does not have."""
        if rev in (None, "main", self.sha):
            return self.tree
        return self.snapshots.get(rev)

    @property
    def sha(self) -> str:
        return self.commits[-1] if self.commits else "0" * 40

    @property
    def files(self) -> dict[str, bytes]:
        """Every file at the head with its bytes (LFS files read from disk: for small test repos). The tree is copied
        first (in one step, under the GIL): a test polls this while the server's threads commit to it."""
        tree = dict(self.tree)
        return {
            p: (b.content if b.content is not None else self.server.object_path(b.sha256).read_bytes())
            for p, b in tree.items()
        }

    def lfs_paths(self) -> dict[str, str]:
        """Path -> sha256 of every LFS file at the head."""
        return {p: b.sha256 for p, b in dict(self.tree).items() if b.sha256}

    @property
    def used_storage(self) -> int:
        """Every stored LFS object (deleted files' ones too, until permanently deleted) and the head's regular files."""
        return sum(o.size for o in self.lfs.values()) + sum(b.size for b in self.tree.values() if b.sha256 is None)


@dataclass(frozen=True)
class Fault:
    """One injected failure: an HTTP status (with Retry-After for 429 and 503), or a connection closed unanswered
    (reset, or after `delay` seconds: timeout)."""

    status: int = 503
    kind: str = "status"  # status | reset | timeout
    retry_after: str | None = None
    delay: float = 0.0
    match: bytes | None = None  # only a request whose body holds these bytes (a commit of one path, say)


@dataclass
class Request:
    method: str
    path: str
    route: str
    status: int
    authorization: str | None


class HubServer:
    def __init__(self, token: str | None = None, storage_dir: str | Path | None = None) -> None:
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.datasets: dict[str, Repo] = {}  # dataset repos, served read-only at any of their revisions
        self.requests: list[Request] = []
        self.commit_bodies: list[bytes] = []
        self.broken_refs: list[str] = []  # files at the head whose LFS object was permanently deleted: must stay empty
        self._failures: dict[str, list[Fault]] = {}
        self._lock = threading.Lock()
        self._own_dir = storage_dir is None
        self.storage = Path(storage_dir or tempfile.mkdtemp(prefix="hubserver-"))
        (self.storage / "objects").mkdir(parents=True, exist_ok=True)
        self.gate = threading.Event()  # commits wait for it: clear() holds them, set() lets them through
        self.gate.set()
        self.in_commit = 0
        self.max_in_commit = 0  # the most commits that were in progress at one time
        self.sent: dict[str, int] = {}  # body bytes sent, by route
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

            def do_PUT(self) -> None:
                server._handle(self, "PUT")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._own_dir:
            shutil.rmtree(self.storage, ignore_errors=True)

    # ------------------------------------------------------------ test controls

    def fail(
        self,
        route: str,
        times: int,
        status: int = 503,
        *,
        kind: str = "status",
        retry_after: str | None = None,
        delay: float = 0.0,
        match: bytes | None = None,
    ) -> None:
        """The next `times` requests to `route` (create, preupload, commit, info, tree, resolve, lfs-batch,
        lfs-upload, lfs-files, lfs-delete) get `status`, or are closed unanswered (`kind` reset or timeout); with
        `match`, only those whose body holds it (not for lfs-upload, whose body is streamed)."""
        with self._lock:
            self._failures.setdefault(route, []).extend([Fault(status, kind, retry_after, delay, match)] * times)

    def clear_failures(self) -> None:
        with self._lock:
            self._failures.clear()

    def count(self, route: str, status: int | None = None) -> int:
        return sum(1 for r in self.requests if r.route == route and (status is None or r.status == status))

    def files(self, repo_id: str) -> dict[str, bytes]:
        return dict(self.repos[repo_id].files)

    def commit_dataset(self, repo_id: str, files: dict[str, bytes | Path], branch: str = "main") -> str:
        """A new revision of a dataset repo's branch (created if missing) with these files (bytes, or a file to copy)
        added or replaced; its commit. Data files (parquet, arrow) and files of 10 MiB or more are LFS objects, as
        the Hub stores them."""
        blobs = {}
        for path, content in files.items():
            if isinstance(content, Path) or path.endswith(DATA_LFS_SUFFIXES) or len(content) >= LFS_MIN_BYTES:
                blobs[path] = self._store_object(content)
            else:
                blobs[path] = Blob(content, len(content))
        with self._lock:
            key = repo_id if branch == "main" else f"{repo_id}@{branch}"
            repo = self.datasets.setdefault(key, Repo(private=False, server=self))
            repo.tree.update(blobs)
            marks = json.dumps(sorted((p, b.sha256 or _git_oid(b.content)) for p, b in blobs.items())).encode()
            sha = hashlib.sha1(repo.sha.encode() + branch.encode() + marks).hexdigest()
            repo.commits.append(sha)
            repo.snapshots[sha] = dict(repo.tree)
        return sha

    def _store_object(self, content: bytes | Path) -> Blob:
        digest = hashlib.sha256()
        with tempfile.NamedTemporaryFile(dir=self.storage, delete=False) as tmp:
            source = content.open("rb") if isinstance(content, Path) else None
            chunks = iter(lambda: source.read(CHUNK), b"") if source else [content]
            size = 0
            for chunk in chunks:
                digest.update(chunk)
                tmp.write(chunk)
                size += len(chunk)
            if source:
                source.close()
        Path(tmp.name).replace(self.object_path(digest.hexdigest()))
        return Blob(None, size, digest.hexdigest())

    def dataset_bytes(self, repo_id: str, branch: str = "main") -> int:
        """Every file's bytes at a dataset branch's head."""
        return sum(b.size for b in self.datasets[repo_id if branch == "main" else f"{repo_id}@{branch}"].tree.values())

    def object_path(self, sha256: str) -> Path:
        return self.storage / "objects" / sha256

    # ------------------------------------------------------------ routing

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        route, handler, args = self._route(method, url.path)  # matched before unquoting: a revision may hold "%2F"
        with self._lock:
            pending = self._failures.get(route)
            injected = pending[0] if pending else None
            if injected is not None and injected.match is None:
                pending.pop(0)
        streamed = route == "lfs-upload" and injected is None and handler is not None
        reset = injected is not None and injected.kind == "reset" and injected.match is None  # its body never read
        body = b"" if streamed or reset else _read_body(h)
        if injected is not None and injected.match is not None:  # a fault for some bodies only
            with self._lock:
                if injected.match in body and pending and pending[0] is injected:
                    pending.pop(0)
                else:
                    injected = None
        if injected is not None and injected.kind != "status":  # the request read, then no answer: closed
            self.requests.append(Request(method, path, route, 0, h.headers.get("Authorization")))
            time.sleep(injected.delay)
            h.close_connection = True
            with contextlib.suppress(OSError):
                h.connection.shutdown(socket.SHUT_RDWR)
            return
        if injected is not None:
            status, payload = injected.status, json.dumps({"error": "injected failure"}).encode()
            headers = {"Retry-After": injected.retry_after or "0"} if status in (429, 503) else {}
        elif handler is None:
            status, headers, payload = 404, {}, json.dumps({"error": f"no route {method} {path}"}).encode()
        else:
            status, headers, payload = handler(h, body, *args)
        self.requests.append(Request(method, path, route, status, h.headers.get("Authorization")))
        if isinstance(payload, (dict, list)):
            payload = json.dumps(payload).encode()
            headers.setdefault("Content-Type", "application/json")
        if isinstance(payload, Path):  # a stored LFS object: streamed, or only its headers for HEAD
            self._send_file(h, method, status, headers, payload, route)
            return
        size = len(payload)
        start, end = _range(h, method, status, size)
        if (start, end) != (0, size):
            status, headers["Content-Range"] = 206, f"bytes {start}-{end - 1}/{size}"
            payload = payload[start:end]
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        if method != "HEAD":
            h.wfile.write(payload)
            self._count(route, len(payload))

    def _count(self, route: str, n: int) -> None:
        with self._lock:
            self.sent[route] = self.sent.get(route, 0) + n

    def _send_file(
        self, h: BaseHTTPRequestHandler, method: str, status: int, headers: dict, path: Path, route: str
    ) -> None:
        size = path.stat().st_size
        start, end = _range(h, method, status, size)
        if (start, end) != (0, size):
            status, headers["Content-Range"] = 206, f"bytes {start}-{end - 1}/{size}"
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(end - start))
        h.end_headers()
        if method == "HEAD":
            return
        with path.open("rb") as f:
            f.seek(start)
            left = end - start
            while left and (chunk := f.read(min(CHUNK, left))):
                h.wfile.write(chunk)
                left -= len(chunk)
        self._count(route, end - start)

    def _route(self, method: str, path: str):
        repo = r"(?P<repo>[^/]+/[^/]+?)"
        table = [
            ("POST", r"^/api/repos/create$", "create", self._create),
            ("POST", r"^/api/validate-yaml$", "validate-yaml", self._validate_yaml),
            ("POST", rf"^/api/models/{repo}/preupload/(?P<rev>[^/]+)$", "preupload", self._preupload),
            ("POST", rf"^/{repo}\.git/info/lfs/objects/batch$", "lfs-batch", self._lfs_batch),
            ("PUT", rf"^/lfs-upload/{repo}/(?P<oid>[0-9a-f]{{64}})$", "lfs-upload", self._lfs_upload),
            ("POST", rf"^/api/models/{repo}/commit/(?P<rev>[^/]+)$", "commit", self._commit),
            ("GET", rf"^/api/models/{repo}/lfs-files$", "lfs-files", self._lfs_files),
            ("POST", rf"^/api/models/{repo}/lfs-files/batch$", "lfs-delete", self._lfs_delete),
            ("GET", rf"^/api/models/{repo}/tree/(?P<rev>[^/]+)(?:/(?P<sub>.*))?$", "tree", self._tree),
            ("GET", rf"^/api/models/{repo}(?:/revision/(?P<rev>[^/]+))?$", "info", self._info),
            (
                "GET",
                rf"^/api/datasets/{repo}/tree/(?P<rev>[^/]+)(?:/(?P<sub>.*))?$",
                "dataset-tree",
                self._dataset_tree,
            ),
            ("POST", rf"^/api/datasets/{repo}/paths-info/(?P<rev>[^/]+)$", "dataset-paths", self._dataset_paths),
            ("GET", rf"^/api/datasets/{repo}(?:/revision/(?P<rev>[^/]+))?$", "dataset-info", self._dataset_info),
            (
                "GET",
                rf"^/datasets/{repo}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$",
                "dataset-resolve",
                self._dataset_resolve,
            ),
            (
                "HEAD",
                rf"^/datasets/{repo}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$",
                "dataset-resolve",
                self._dataset_resolve,
            ),
            ("GET", rf"^/{repo}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$", "resolve", self._resolve),
            ("HEAD", rf"^/{repo}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$", "resolve", self._resolve),
        ]
        for m, pattern, name, fn in table:
            match = re.match(pattern, path)
            if m == method and match:
                return name, fn, tuple(None if v is None else unquote(v) for v in match.groupdict().values())
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
        self.repos[repo_id] = Repo(private=private, server=self)
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

        def mode(f: dict) -> str:
            return "lfs" if f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_MIN_BYTES else "regular"

        return (
            200,
            {},
            {
                "files": [
                    {"path": f["path"], "uploadMode": mode(f), "shouldIgnore": False, "oid": None} for f in files
                ],
                "commitOid": repo.sha,
            },
        )

    def _lfs_batch(self, h, body: bytes, repo_id: str):
        repo = self._repo(h, repo_id)
        if repo is None:
            return self._not_found("RepoNotFound")
        objects = []
        for o in json.loads(body)["objects"]:
            entry = {"oid": o["oid"], "size": o["size"]}
            if o["oid"] not in repo.lfs:  # stored already: no actions, the client skips the upload
                entry["actions"] = {"upload": {"href": f"{self.url}/lfs-upload/{repo_id}/{o['oid']}"}}
            objects.append(entry)
        return 200, {}, {"transfer": "basic", "objects": objects}

    def _lfs_upload(self, h, body: bytes, repo_id: str, oid: str):
        repo = self.repos.get(repo_id)  # the URL from the batch answer is the permission, as a presigned one is
        if repo is None:
            _read_body(h)
            return self._not_found("RepoNotFound")
        digest, size = hashlib.sha256(), 0
        with tempfile.NamedTemporaryFile(dir=self.storage, delete=False) as tmp:
            for chunk in _body_chunks(h):
                digest.update(chunk)
                tmp.write(chunk)
                size += len(chunk)
        if digest.hexdigest() != oid:
            Path(tmp.name).unlink()
            return 400, {}, {"error": "sha256 does not match the object id"}
        Path(tmp.name).replace(self.object_path(oid))
        with self._lock:
            repo.lfs[oid] = LfsObject(
                size=size, pushed_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
            )
        return 200, {}, b""

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
        changes: dict[str, Blob | None] = {}
        folders: list[str] = []
        parent = None
        for line in body.decode().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                parent = value.get("parentCommit")
            elif key == "file":
                content = base64.b64decode(value["content"])
                changes[value["path"]] = Blob(content, len(content))
            elif key == "lfsFile":
                stored = repo.lfs.get(value["oid"])
                if stored is None:
                    return 400, {}, {"error": f"LFS object {value['oid']} of {value['path']} was never uploaded"}
                changes[value["path"]] = Blob(None, stored.size, value["oid"])
            elif key == "deletedFile":
                changes[value["path"]] = None
            elif key == "deletedFolder":
                folders.append(value["path"].rstrip("/") + "/")
            else:
                return 400, {}, {"error": f"unsupported commit line {key}"}
        with self._lock:
            if parent is not None and parent != repo.sha:
                # as the Hub answers a commit whose parent is no longer the head (optimistic concurrency)
                return 412, {}, {"error": "A commit has happened since. Please refresh and try again."}
            for prefix in folders:
                for p in [p for p in repo.tree if p.startswith(prefix)]:
                    del repo.tree[p]
            for p, blob in changes.items():
                if blob is None:
                    repo.tree.pop(p, None)
                else:
                    repo.tree[p] = blob
                    if blob.sha256:
                        repo.lfs[blob.sha256].filename = p
            sha = hashlib.sha1(repo.sha.encode() + body).hexdigest()
            repo.commits.append(sha)
            repo.snapshots[sha] = dict(repo.tree)
        return 200, {}, {"commitUrl": f"{self.url}/{repo_id}/commit/{sha}", "commitOid": sha, "success": True}

    def _info(self, h, body: bytes, repo_id: str, rev: str | None):
        repo = self._repo(h, repo_id)
        if repo is None:
            return self._not_found("RepoNotFound")
        return (
            200,
            {},
            {
                "id": repo_id,
                "modelId": repo_id,
                "sha": repo.sha,
                "private": repo.private,
                "siblings": [{"rfilename": p} for p in sorted(repo.tree)],
                "usedStorage": repo.used_storage,
            },
        )

    def _tree(self, h, body: bytes, repo_id: str, rev: str, sub: str | None):
        repo = self._repo(h, repo_id)
        if repo is None:
            return self._not_found("RepoNotFound")
        entries = _listing(repo.tree, h, sub)
        if sub and not entries:
            return self._not_found("EntryNotFound")
        return 200, {}, entries

    def _lfs_files(self, h, body: bytes, repo_id: str):
        repo = self._repo(h, repo_id)
        if repo is None:
            return self._not_found("RepoNotFound")
        return (
            200,
            {},
            [
                {
                    "fileOid": oid,
                    "oid": oid,
                    "size": o.size,
                    "filename": o.filename,
                    "pushedAt": o.pushed_at,
                    "ref": "main",
                }
                for oid, o in sorted(repo.lfs.items())
            ],
        )

    def _lfs_delete(self, h, body: bytes, repo_id: str):
        repo = self._repo(h, repo_id)
        if repo is None:
            return self._not_found("RepoNotFound")
        shas = json.loads(body)["deletions"]["sha"]
        with self._lock:
            for sha in shas:
                if repo.lfs.pop(sha, None) is not None:
                    self.object_path(sha).unlink(missing_ok=True)
                self.broken_refs += [p for p, b in repo.tree.items() if b.sha256 == sha]
        return 200, {}, b""

    def _resolve(self, h, body: bytes, repo_id: str, rev: str, file: str):
        repo = self._repo(h, repo_id)
        if repo is None:
            return self._not_found("RepoNotFound")
        blob = repo.tree.get(file)
        if blob is None:
            return self._not_found("EntryNotFound")
        headers = {"X-Repo-Commit": repo.sha, "Content-Type": "application/octet-stream"}
        if blob.sha256:
            if blob.sha256 not in repo.lfs:
                return self._not_found("EntryNotFound")
            headers["ETag"] = f'"{blob.sha256}"'
            return 200, headers, self.object_path(blob.sha256)
        headers["ETag"] = f'"{_git_oid(blob.content)}"'
        return 200, headers, blob.content

    # ------------------------------------------------------------ dataset repos, at any revision

    def _dataset(self, repo_id: str, rev: str | None):
        repo = self.datasets.get(repo_id)
        if repo is None:
            return None, None, self._not_found("RepoNotFound")
        branch = self.datasets.get(f"{repo_id}@{rev}")
        if branch is not None:  # a branch other than main, at its head
            return branch, (branch.tree, branch.sha), None
        for candidate in [repo] + [r for k, r in self.datasets.items() if k.startswith(repo_id + "@")]:
            tree = candidate.tree_at(rev)
            if tree is not None and (rev in (None, "main") or rev in candidate.snapshots):
                return candidate, (tree, candidate.sha if rev in (None, "main") else rev), None
        return None, None, self._not_found("RevisionNotFound")

    def _dataset_info(self, h, body: bytes, repo_id: str, rev: str | None):
        repo, at, error = self._dataset(repo_id, rev)
        if error:
            return error
        tree, sha = at
        return (
            200,
            {},
            {
                "id": repo_id,
                "sha": sha,
                "private": False,
                "siblings": [{"rfilename": p} for p in sorted(tree)],
                "cardData": {},
                "tags": [],
                "lastModified": "2026-01-01T00:00:00.000Z",
            },
        )

    def _dataset_tree(self, h, body: bytes, repo_id: str, rev: str, sub: str | None):
        repo, at, error = self._dataset(repo_id, rev)
        if error:
            return error
        return 200, {}, _listing(at[0], h, sub)

    def _dataset_paths(self, h, body: bytes, repo_id: str, rev: str):
        repo, at, error = self._dataset(repo_id, rev)
        if error:
            return error
        tree, _ = at
        from urllib.parse import parse_qs

        asked = json.loads(body)["paths"] if body.strip().startswith(b"{") else parse_qs(body.decode()).get("paths", [])
        out = []
        for p in asked:
            p = p.strip("/")
            if p in tree:
                out.append(_entry(p, tree[p]))
            elif any(q.startswith(p + "/") for q in tree) or p == "":
                out.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": p})
        return 200, {}, out

    def _dataset_resolve(self, h, body: bytes, repo_id: str, rev: str, file: str):
        repo, at, error = self._dataset(repo_id, rev)
        if error:
            return error
        tree, sha = at
        blob = tree.get(file)
        if blob is None:
            return self._not_found("EntryNotFound")
        headers = {"X-Repo-Commit": sha, "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        if blob.sha256:
            headers["ETag"] = f'"{blob.sha256}"'
            return 200, headers, self.object_path(blob.sha256)
        headers["ETag"] = f'"{_git_oid(blob.content)}"'
        return 200, headers, blob.content


def _range(h: BaseHTTPRequestHandler, method: str, status: int, size: int) -> tuple[int, int]:
    """The byte range [start, end) a GET asks for with `Range: bytes=a-b` or `bytes=a-` (all of it otherwise)."""
    m = re.fullmatch(r"bytes=(\d+)-(\d*)", h.headers.get("Range", "") or "")
    if not m or method != "GET" or status != 200 or int(m.group(1)) >= size:
        return 0, size
    start = int(m.group(1))
    return start, min(size, int(m.group(2)) + 1) if m.group(2) else size


def _entry(path: str, blob: Blob) -> dict:
    entry = {"type": "file", "oid": _git_oid(_pointer(blob)), "size": blob.size, "path": path}
    if blob.sha256:
        entry["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": len(_pointer(blob))}
    return entry


def _listing(tree: dict[str, Blob], h: BaseHTTPRequestHandler, sub: str | None) -> list[dict]:
    """A tree listing: the files and folders under `sub`, one level or (?recursive=true) all of them."""
    recursive = "recursive=true" in (urlparse(h.path).query or "").lower()
    prefix = (sub.strip("/") + "/") if sub else ""
    entries, folders = [], set()
    for p, blob in sorted(tree.items()):
        if not p.startswith(prefix):
            continue
        parts = p[len(prefix) :].split("/")
        for i in range(1, len(parts)):
            folder = prefix + "/".join(parts[:i])
            if (recursive or i == 1) and folder not in folders:
                folders.add(folder)
                entries.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": folder})
        if recursive or len(parts) == 1:
            entries.append(_entry(p, blob))
    return entries


def _read_body(h: BaseHTTPRequestHandler) -> bytes:
    body = b"".join(_body_chunks(h))
    if h.headers.get("Content-Encoding") == "gzip":
        body = gzip.decompress(body)
    return body


def _body_chunks(h: BaseHTTPRequestHandler):
    """The request body in pieces: by Content-Length, or decoding chunked transfer encoding."""
    if "chunked" in (h.headers.get("Transfer-Encoding") or "").lower():
        while True:
            size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return
            left = size
            while left:
                chunk = h.rfile.read(min(left, CHUNK))
                left -= len(chunk)
                yield chunk
            h.rfile.readline()
    left = int(h.headers.get("Content-Length") or 0)
    while left:
        chunk = h.rfile.read(min(left, CHUNK))
        if not chunk:
            return
        left -= len(chunk)
        yield chunk


def _pointer(blob: Blob) -> bytes:
    """What git stores for the file: its bytes, or an LFS pointer."""
    if blob.sha256 is None:
        return blob.content
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{blob.sha256}\nsize {blob.size}\n".encode()


def _git_oid(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
