"""The upload path against the faults a real Hub gives, at each of its calls (the preupload, the LFS upload of the
checkpoint's bytes, the commit), with the loopback Hub's fault injection: three faults of each passing kind end
with the checkpoint on the Hub; a refusal ends the retrying at once, with the Hub's reason; a Retry-After is waited
for as it says. In process (the uploader as a run starts it), and one training run end to end."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import COMMON, HF_TOK, hub_env, run_cli, saved_names, wandb_records
from hubserver import HubServer

from fsdp_opt.hub.retry import retry_after, with_retries
from fsdp_opt.hub.store import HubStore
from fsdp_opt.hub.uploads import Uploader

CALLS = ("preupload", "lfs-upload", "commit")
PASSING = {  # a name -> the loopback Hub's fault
    "429 Retry-After 1": {"status": 429, "retry_after": "1"},
    "500": {"status": 500},
    "502": {"status": 502},
    "503": {"status": 503},
    "reset": {"kind": "reset"},
    "timeout": {"kind": "timeout", "delay": 2.5},  # the client's timeout here: 1 s
    "409": {"status": 409},  # another commit at the same time: a push names no parent, so it is tried again
}
REFUSALS = {
    "401": (401, "HTTP 401"),
    "403 quota": (403, "HTTP 403"),
    "404 repo": (404, "HTTP 404"),
}
CARD = lambda index: "---\n---\ncard\n"  # noqa: E731


def uploader(server: HubServer, log: list[str], retries: int = 5) -> Uploader:
    store = HubStore("me/faults", retries=retries, backoff=0.05, endpoint=server.url, io_timeout=1.0)
    store.api.token = HF_TOK
    return Uploader(store, CARD, run={}, private=True, retries=retries, backoff=0.05, log=log.append)


@pytest.mark.parametrize("call", CALLS)
def test_three_faults_of_each_passing_kind_end_with_the_checkpoint_on_the_hub(tmp_path, call):
    """Each passing kind in turn, three times in a row at one call: the push ends with the checkpoint's bytes in the
    repo, no upload left behind, and the faults were met (the call asked more than once)."""
    with HubServer(token=HF_TOK) as server:
        for i, (kind, fault) in enumerate(PASSING.items()):
            if kind == "409" and call != "commit":
                continue  # a conflict is a commit's
            path = tmp_path / f"m_0-8-epoch-1-step-{i + 1}.pt"
            path.write_bytes(os.urandom(4096))
            log: list[str] = []
            up = uploader(server, log)
            before = server.count(call)
            server.fail(call, 3, **fault)
            started = time.monotonic()
            up.submit(path, "step", {"global_step": i + 1})
            left = up.finish(timeout=120, pause=0.5)
            took = time.monotonic() - started
            assert left == [], (kind, [(j.name, j.status, j.error) for j in left], log)
            assert server.files("me/faults")[f"checkpoints/{path.name}"] == path.read_bytes(), kind
            assert server.count(call) - before >= 4, (kind, server.count(call) - before)  # 3 faults, then through
            if kind.startswith("429"):
                assert took >= 3.0, took  # each Retry-After: 1 waited for
            server.clear_failures()


def test_a_refusal_ends_the_retrying_at_once_with_the_hubs_reason(tmp_path):
    """401, 403 (a quota, say) and a 404 of the repo at the commit: one commit asked, the upload failed with the
    status named, the local file kept, and no further round at the session's end."""
    path = tmp_path / "m_0-8-epoch-1.pt"
    path.write_bytes(os.urandom(4096))
    with HubServer(token=HF_TOK) as server:
        for name, (status, said) in REFUSALS.items():
            log: list[str] = []
            up = uploader(server, log)
            before = server.count("commit")
            server.fail("commit", 10, status=status)
            up.submit(path, "epoch", {"global_step": 8})
            started = time.monotonic()
            [job] = up.finish(timeout=60, pause=0.5)
            assert time.monotonic() - started < 10, name
            assert job.status == "failed" and said in job.error and not job.transient, (name, job.error)
            assert server.count("commit") - before == 1, name
            assert any("the Hub refused it: not tried again" in line for line in log), log
            assert path.exists()
            server.clear_failures()


class _Refused(Exception):
    def __init__(self, headers: dict[str, str], status: int = 429) -> None:
        super().__init__(f"{status}")
        self.response = type("R", (), {"headers": headers, "status_code": status})()


def test_retry_after_is_waited_for_as_it_says():
    """A 429 whose Retry-After is 0.4 s: the next try comes after at least that, not after the backoff (0.01 s); an
    HTTP date is read too; a 403 is not tried again."""
    assert retry_after(_Refused({"Retry-After": "7"})) == 7.0 and retry_after(_Refused({})) is None
    assert (
        29
        <= retry_after(
            _Refused({"Retry-After": time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 31))})
        )
        <= 31
    )
    calls: list[float] = []

    def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise _Refused({"Retry-After": "0.4"})
        return "ok"

    assert with_retries(flaky, retries=5, backoff=0.01) == "ok"
    assert [b - a >= 0.4 for a, b in zip(calls, calls[1:])] == [True, True]
    refused: list[int] = []

    def forbidden() -> None:
        refused.append(1)
        raise _Refused({}, status=403)

    with pytest.raises(_Refused):
        with_retries(forbidden, retries=5, backoff=0.01)
    assert refused == [1]


def test_a_training_run_pushes_through_faults_at_every_call_and_exits_0(tmp_path):
    """The training command on the loopback Hub, every call of its push failing three times (a 503, a reset
    connection, a 502): the run ends with exit 0, its checkpoint on the Hub."""
    with HubServer(token=HF_TOK) as server:
        server.fail("preupload", 3, status=503)
        server.fail("lfs-upload", 3, kind="reset")
        server.fail("commit", 3, status=502)
        proc = run_cli(
            COMMON
            + [
                "--end_idx",
                "16",
                "--hf_repo",
                "me/run",
                "--wandb_mode",
                "disabled",
                "--output_dir",
                "out",
                "--hub_retries",
                "5",
            ],
            tmp_path,
            env=hub_env(tmp_path, server, "a"),
        )
        repo = server.files("me/run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = saved_names(proc.stdout)[-1]
    assert repo[f"checkpoints/{name}"] == (tmp_path / "out" / name).read_bytes()
    assert "hub: uploads done: 1 pushed to me/run" in proc.stdout
    assert Path(tmp_path / "out" / name).exists()


def test_a_hub_that_refuses_every_checkpoint_ends_the_session_non_zero_and_the_checkpoint_resumes(tmp_path):
    """The Hub takes the chain's lease but refuses every checkpoint commit (403): the session trains and saves, then
    exits 3; its last line names the checkpoint, says it is kept whole and where, and what a session on another
    machine would resume from; W&B's summary says the same. The local checkpoint then resumes the next range."""
    with HubServer(token=HF_TOK) as server:
        server.fail("commit", 1000, status=403, match=b"checkpoints/")
        proc = run_cli(
            COMMON
            + [
                "--end_idx",
                "16",
                "--hf_repo",
                "me/run",
                "--wandb_mode",
                "offline",
                "--output_dir",
                "out",
                "--hub_wait",
                "20s",
            ],
            tmp_path,
            env=hub_env(tmp_path, server, "a"),
        )
        assert not any(k.startswith("checkpoints/") for k in server.files("me/run"))
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = saved_names(proc.stdout)[-1]
    path = tmp_path / "out" / name
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the checkpoint {name} did not reach me/run (the upload failed: HTTP 403"), last
    assert f"it is kept whole here: {path}" in last and "finds no checkpoint there and starts the chain again" in last
    (run,) = sorted((tmp_path / "out" / "wandb").glob("offline-run-*"))
    summary = {k: v for r in wandb_records(run) if r["type"] == "summary" for k, v in _summary(r).items()}
    assert summary.get("hub/not_pushed") == name and summary.get("hub/kept_at") == str(path), summary
    resumed = run_cli(
        COMMON
        + [
            "--start_idx",
            "16",
            "--end_idx",
            "24",
            "--resume_file",
            name,
            "--output_dir",
            "out",
            "--wandb_mode",
            "disabled",
        ],
        tmp_path,
    )
    assert resumed.returncode == 0 and f"resumed out/{name} at global step" in resumed.stdout, resumed.stderr[-2000:]


def _summary(record: dict) -> dict:
    """A W&B summary record's updated keys (leet's JSON: {"summary": {"update": {key: value}}})."""
    update = record["summary"].get("update", {})
    return update if isinstance(update, dict) else {}
