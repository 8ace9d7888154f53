"""The chain's lease: one session writes to a chain at a time.

A training run holds a lease for as long as it may write: in the Hub repo (`fsdp_opt_lease.json` at its root) with
--hf_repo, else in --output_dir (`.fsdp_opt_lease.json`) for runs that share a disk. The lease names the session
(an id, its host and process, when it started, the range it trains) and when it expires: the session's own end
(--time_limit plus --hub_wait, or 12 hours plus --hub_wait without a time limit), moved on with each push.

- Taking it is one commit whose parent is the head the session read (huggingface_hub's `parent_commit`): two
  sessions that read the same head cannot both commit, so exactly one wins; the other reads again and finds the
  winner's lease. On disk, the file is created with O_EXCL, which only one process can do.
- A live lease of another session stops this one before it trains, in one line, with exit 0.
- A lease past its expiry, or one whose process is gone from this very host, is taken over with one line, as is any
  lease with --take_over.
- The lease is renewed in the commits that push checkpoints (no commits of its own), and released at exit: the end,
  a time limit, SIGTERM, an error. A session killed outright leaves it until it expires.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete

from fsdp_opt.base import ConfigError
from fsdp_opt.hub.retry import describe, status_code
from fsdp_opt.hub.store import HubStore

LEASE_FILE = "fsdp_opt_lease.json"  # at the root of the Hub repo
LOCAL_LEASE = ".fsdp_opt_lease.json"  # in --output_dir
HOLD_WITHOUT_LIMIT_S = 12 * 3600  # a session with no --time_limit: Kaggle's longest session
TRIES = 8  # commits that lose a race are tried again against the new head this many times
COMMIT_WAIT_S = 15.0  # the most a session waits for its lease commit before it trains without waiting
RELEASE_WAIT_S = 10.0  # the most a session waits at exit to give the lease back


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(seconds: float) -> str:
    minutes = max(0, int(seconds // 60))
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed process stays a zombie until its parent (or init) reaps it: it answers signal 0 but is gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


@dataclass
class Holder:
    """What a lease says of the session that holds it."""

    session: str
    host: str
    pid: int
    started: float  # seconds since the epoch
    expires: float
    start: int | None  # the range it trains, rows [start, end)
    end: int | None

    def to_bytes(self) -> bytes:
        data = {**asdict(self), "started_utc": _iso(self.started), "expires_utc": _iso(self.expires)}
        return json.dumps(data, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Holder | None:
        try:
            data = json.loads(raw)
            return cls(
                str(data["session"]),
                str(data["host"]),
                int(data["pid"]),
                float(data["started"]),
                float(data["expires"]),
                data.get("start"),
                data.get("end"),
            )
        except (ValueError, KeyError, TypeError):
            return None  # an unreadable lease holds nothing

    def why_not_live(self, now: float) -> str | None:
        """None while the lease holds; else why it no longer does."""
        if self.expires <= now:
            return f"it expired at {_iso(self.expires)}"
        if self.host == socket.gethostname() and not _alive(self.pid):
            return f"its process ({self.pid}) is gone from this host"
        return None

    def describe(self, now: float) -> str:
        rows = rows_text(self.start, self.end) or "its range"
        return (
            f"session {self.session[:8]} on {self.host}, started {_iso(self.started)} "
            f"({_ago(now - self.started)} ago), training {rows}"
        )


def new_holder(start: int | None, end: int | None, hold_s: float) -> Holder:
    now = time.time()
    return Holder(uuid.uuid4().hex, socket.gethostname(), os.getpid(), now, now + hold_s, start, end)


def hold_seconds(time_limit_s: float | None, hub_wait_s: float) -> float:
    """How long a session may write: its --time_limit (or 12 hours) and then --hub_wait for the last uploads."""
    return (time_limit_s if time_limit_s else HOLD_WITHOUT_LIMIT_S) + hub_wait_s + 60.0


@dataclass
class Outcome:
    won: bool
    line: str  # what to print: the lease taken (or taken over), or why this session stops
    conflict: bool = False  # the head moved since the caller read it: decide again


def rows_text(start: int | None, end: int | None) -> str | None:
    """A lease's rows as a line names them: [start, end), or from start to the end of the data (no --end_idx)."""
    if start is None:
        return None
    return f"rows [{start}, {end})" if end is not None else f"rows from {start} to the end of the data"


class Lease:
    """The lease of one session; `take` before anything is written, `release` at exit."""

    where: str

    def __init__(self, holder: Holder, hold_s: float) -> None:
        self.holder, self.hold_s = holder, hold_s
        self.held = False
        self.lost = False  # another session took it over while this one held it

    def _judge(self, current: Holder | None, take_over: bool) -> tuple[str | None, str | None]:
        """(refusal line, takeover note) against the lease found."""
        if current is None or current.session == self.holder.session:
            return None, None
        now = time.time()
        why = "--take_over" if take_over else current.why_not_live(now)
        if why is None:
            return (
                f"chain: another session holds the lease on {self.where}: {current.describe(now)}, until "
                f"{_iso(current.expires)}. This one stops without training. Run it again when that session has "
                "ended; if it died, its lease ends at its expiry, or --take_over takes it now"
            ), None
        return None, f"chain: took over the lease of {current.describe(now)} ({why})"

    def _taken(self, note: str | None) -> Outcome:
        self.held = True
        h = self.holder
        rows = rows_text(h.start, h.end) or "this session"
        return Outcome(True, note or f"chain: lease on {self.where} taken for {rows} until {_iso(h.expires)}")

    def renew(self) -> None:
        self.holder.expires = max(self.holder.expires, time.time() + self.hold_s)


class FileLease(Lease):
    """The lease as a file in --output_dir: for runs that share a disk."""

    def __init__(self, folder: Path, holder: Holder, hold_s: float) -> None:
        super().__init__(holder, hold_s)
        self.path = folder / LOCAL_LEASE
        self.where = str(folder)
        self.made_folder = False

    def current(self) -> Holder | None:
        try:
            return Holder.from_bytes(self.path.read_bytes())
        except FileNotFoundError:
            return None

    def take(self, take_over: bool, head: str | None = None) -> Outcome:
        self.made_folder = not self.path.parent.exists()  # a run that writes nothing else leaves no folder behind
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--output_dir {self.where}: cannot write there ({exc.strerror or exc})") from None
        note = None
        for _ in range(TRIES):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                current = self.current()
                refusal, taken_over = self._judge(current, take_over)
                if refusal:
                    return Outcome(False, refusal)
                note = note or taken_over
                try:  # one process moves the old lease away; the others find it gone and try again
                    self.path.rename(self.path.with_name(f"{LOCAL_LEASE}.old-{self.holder.session}"))
                    self.path.with_name(f"{LOCAL_LEASE}.old-{self.holder.session}").unlink()
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "wb") as f:
                f.write(self.holder.to_bytes())
            return self._taken(note)
        return Outcome(False, f"chain: could not take the lease in {self.where} after {TRIES} tries")

    def renew(self) -> None:
        super().renew()
        if self.held and (self.current() or self.holder).session == self.holder.session:
            tmp = self.path.with_name(f"{LOCAL_LEASE}.{self.holder.session}.tmp")
            tmp.write_bytes(self.holder.to_bytes())
            tmp.replace(self.path)

    def release(self) -> None:
        if self.held and (current := self.current()) is not None and current.session == self.holder.session:
            self.path.unlink(missing_ok=True)
            if self.made_folder and not any(self.path.parent.iterdir()):
                self.path.parent.rmdir()
        self.held = False


class HubLease(Lease):
    """The lease as a file in the Hub repo, taken and released in commits that name their parent."""

    def __init__(self, store: HubStore, holder: Holder, hold_s: float) -> None:
        super().__init__(holder, hold_s)
        self.store = store
        self.where = store.repo_id

    def head(self) -> str | None:
        """The repo's head commit; None when the Hub cannot say now (then `take` reads it itself)."""
        try:
            return self.store._call(lambda: self.store.api.model_info(self.store.repo_id)).sha
        except Exception:  # noqa: BLE001
            return None

    def current(self) -> Holder | None:
        if LEASE_FILE not in self.store.files():
            return None
        with tempfile.TemporaryDirectory() as tmp:
            return Holder.from_bytes(self.store.fetch(LEASE_FILE, Path(tmp) / LEASE_FILE).read_bytes())

    def _commit(self, ops: list, message: str, parent: str) -> bool:
        """One commit on `parent` (network errors and 5xx retried); False when another commit landed first (412)."""
        try:
            self.store._call(
                lambda: self.store.api.create_commit(
                    self.store.repo_id, ops, commit_message=message, parent_commit=parent
                )
            )
        except Exception as exc:  # noqa: BLE001
            if status_code(exc) == 412:
                return False
            raise
        return True

    def _commit_within(
        self, ops: list, message: str, parent: str | None, timeout: float, then_held: bool
    ) -> bool | None:
        """`_commit` that waits at most `timeout` seconds: None when the Hub has not answered by then. The commit may
        still land later; with `then_held` the lease is then held (and released at exit) all the same."""
        result: dict[str, object] = {}

        def work() -> None:
            try:
                result["ok"] = self._commit(ops, message, parent)
            except Exception as exc:  # noqa: BLE001
                result["error"] = exc
            if then_held and result.get("ok") and result.get("late"):
                self.held = True

        thread = threading.Thread(target=work, name="fsdp-opt-lease", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            result["late"] = True
            return None
        if "error" in result:
            raise result["error"]  # type: ignore[misc]
        return bool(result["ok"])

    def take(self, take_over: bool, head: str | None = None) -> Outcome:
        """Take the lease in a commit on `head` (the commit the caller decided its range at; None: read it now).
        `conflict` when the head has moved since: the caller decides again and calls this with the new head."""
        try:
            parent = head or self.head()
            refusal, note = self._judge(self.current(), take_over)
            if refusal:
                return Outcome(False, refusal)
            op = CommitOperationAdd(LEASE_FILE, self.holder.to_bytes())
            landed = self._commit_within(
                [op], f"fsdp-opt: lease for session {self.holder.session[:8]}", parent, COMMIT_WAIT_S, then_held=True
            )
            if landed is None:
                return Outcome(
                    True,
                    f"warning: the Hub did not answer the lease commit on {self.where} in "
                    f"{COMMIT_WAIT_S:.0f} s: this session trains without waiting for it",
                )
            if not landed:
                return Outcome(False, "", conflict=True)
        except Exception as exc:  # noqa: BLE001 - the Hub failing after its retries: train, as the uploads would retry
            return Outcome(
                True,
                f"warning: the chain's lease on {self.where} could not be taken ({describe(exc)}): "
                "this session trains without it",
            )
        return self._taken(note)

    def still_held(self) -> bool:
        current = self.current()
        return current is not None and current.session == self.holder.session

    def held_by_another(self) -> bool:
        """Whether the repo's lease file now names another session (a takeover: this one must write nothing more).
        A lease file that cannot be read back whole is not taken for one: that raises a network error, and the push
        that asked is retried (the cause of a push once lost with its checkpoint whole on disk, never explained)."""
        if LEASE_FILE not in self.store.files():
            return False
        with tempfile.TemporaryDirectory() as tmp:
            raw = self.store.fetch(LEASE_FILE, Path(tmp) / LEASE_FILE).read_bytes()
        current = Holder.from_bytes(raw)
        if current is None:
            raise ConnectionError(f"the chain's lease file in {self.where} read back unreadable ({len(raw)} bytes)")
        return current.session != self.holder.session

    def renew_op(self):  # noqa: ANN201
        """The lease, moved on, as one more operation of a push's commit."""
        self.renew()
        return CommitOperationAdd(LEASE_FILE, self.holder.to_bytes())

    def release(self) -> None:
        deadline = time.monotonic() + RELEASE_WAIT_S  # a Hub that does not answer: the lease ends at its expiry
        for _ in range(TRIES if self.held else 0):
            parent = self.head()
            if not self.still_held():
                break
            left = deadline - time.monotonic()
            landed = (
                self._commit_within(
                    [CommitOperationDelete(LEASE_FILE)],
                    "fsdp-opt: lease released",
                    parent,
                    max(left, 0.1),
                    then_held=False,
                )
                if left > 0
                else None
            )
            if landed is None:
                self.held = False
                raise TimeoutError(f"the Hub did not answer in {RELEASE_WAIT_S:.0f} s")
            if landed:
                break
        self.held = False
