"""The chain's lease: one session writes to a chain at a time. Real huggingface_hub against the loopback Hub, which
answers a commit whose parent is no longer the head with 412 as the Hub does; real CLI sessions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import ENTRY, HF_TOK, hub_env, read_jsonl, run_cli, sandbox_env, saved_names
from hubserver import HubServer

from fsdp_opt.hub.lease import LEASE_FILE, LOCAL_LEASE, FileLease, Holder, HubLease, new_holder

REPO = "me/chain"
BASE = [
    "--model",
    "tiny-opt",
    "--dataset",
    "python-docs",
    "--max_length",
    "64",
    "--lr",
    "3e-3",
    "--num_epochs",
    "1",
    "--batch_size",
    "2",
    "--seed",
    "3",
]
CHAIN = BASE + ["--start_idx", "auto", "--range_size", "120", "--hf_repo", REPO, "--hub_retries", "1"]


def _store(server: HubServer, repo: str = REPO):
    os.environ["HF_ENDPOINT"] = server.url  # read by huggingface_hub's HfApi at construction (endpoint=None)
    from fsdp_opt.hub.store import HubStore

    store = HubStore(repo, retries=1, endpoint=server.url)
    store.api.token = HF_TOK
    assert store.ensure_repo(private=True)
    return store


def test_two_sessions_in_the_same_instant_exactly_one_wins_every_time():
    """20 races: two sessions read the same head and commit their lease on it at once; one commit lands, the other
    gets 412, reads again, finds the winner's live lease and stops."""
    with HubServer(token=HF_TOK) as server:
        for attempt in range(20):
            store = _store(server, f"me/race-{attempt}")
            leases = [HubLease(store, new_holder(0, 120, 3600), 3600) for _ in range(2)]
            head = leases[0].head()
            start, results = threading.Barrier(2), [None, None]

            def take(i: int) -> None:
                start.wait()
                outcome = leases[i].take(False, head)
                if outcome.conflict:  # the head moved under it: decide again, as the run does
                    outcome = leases[i].take(False, None)
                results[i] = outcome

            threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sorted(r.won for r in results) == [False, True], results
            loser = results[[r.won for r in results].index(False)]
            assert loser.line.startswith(f"chain: another session holds the lease on me/race-{attempt}: session ")
            winner = leases[[r.won for r in results].index(True)]
            holder = Holder.from_bytes(server.repos[f"me/race-{attempt}"].files[LEASE_FILE])
            assert holder.session == winner.holder.session
            winner.release()
            assert LEASE_FILE not in server.repos[f"me/race-{attempt}"].files


def test_a_lease_past_its_expiry_or_of_a_gone_process_is_taken_over(tmp_path):
    folder = tmp_path / "out"
    old = new_holder(0, 10, 3600)
    old.host = "kaggle-other-machine"  # a live process elsewhere: only its expiry or --take_over ends its lease
    folder.mkdir()
    (folder / LOCAL_LEASE).write_bytes(old.to_bytes())
    refused = FileLease(folder, new_holder(10, 20, 60), 60).take(False)
    assert not refused.won and "session " + old.session[:8] + " on kaggle-other-machine" in refused.line
    assert "rows [0, 10)" in refused.line and "--take_over" in refused.line
    forced = FileLease(folder, new_holder(10, 20, 60), 60)
    outcome = forced.take(True)
    assert outcome.won and outcome.line.endswith("(--take_over)") and "took over the lease of session" in outcome.line
    forced.release()
    old.expires = time.time() - 1  # expired
    (folder / LOCAL_LEASE).write_bytes(old.to_bytes())
    outcome = FileLease(folder, new_holder(10, 20, 60), 60).take(False)
    assert outcome.won and "(it expired at " in outcome.line
    gone = new_holder(0, 10, 3600)
    gone.pid = 2**22 + 12345  # above any pid this host hands out
    (folder / LOCAL_LEASE).write_bytes(gone.to_bytes())
    outcome = FileLease(folder, new_holder(10, 20, 60), 60).take(False)
    assert outcome.won and f"(its process ({gone.pid}) is gone from this host)" in outcome.line


def _start(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ENTRY)] + args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_two_identical_auto_chain_commands_two_seconds_apart_one_trains_one_stops(tmp_path):
    with HubServer(token=HF_TOK) as server:
        runs = []
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            env = hub_env(tmp_path, server, name)
            env["WANDB_MODE"] = "offline"
            runs.append(_start(CHAIN + ["--output_dir", str(tmp_path / name / "out")], tmp_path / name, env))
            time.sleep(2)
        started = time.monotonic()
        finished: dict[int, float] = {}
        while len(finished) < 2 and time.monotonic() - started < 300:
            for i, p in enumerate(runs):
                if i not in finished and p.poll() is not None:
                    finished[i] = time.monotonic() - started
            time.sleep(0.2)
        outs = [p.communicate(timeout=60) for p in runs]
        assert [p.returncode for p in runs] == [0, 0], outs
        stopped = [i for i, (out, _) in enumerate(outs) if "chain: another session holds the lease" in out]
        assert len(stopped) == 1, outs
        loser, winner = stopped[0], 1 - stopped[0]
        out = outs[loser][0]
        line = [l for l in out.splitlines() if l.startswith("chain: another session holds the lease")]
        assert len(line) == 1 and f"on {REPO}: session " in line[0] and "training rows [0, 120)" in line[0]
        # It stopped while the winner was still training: it did not wait for the lease (a bound in seconds failed
        # on a machine running other tests beside the suite: 35 s for the loser, 64 for the winner).
        assert finished[loser] < finished[winner], finished
        assert "Traceback" not in outs[loser][1] and "fsdp-opt run" not in out  # stopped before building anything
        name = "a" if loser == 0 else "b"
        assert not (tmp_path / name / "out" / "wandb").exists() and not list((tmp_path / name).glob("**/*.pt"))
        # the repo: the winner's checkpoints, one step axis, no lease left
        repo = server.repos[REPO]
        assert saved_names(outs[winner][0]) == ["tiny_opt_0-120-epoch-1.pt"]
        assert "checkpoints/tiny_opt_0-120-epoch-1.pt" in repo.files and LEASE_FILE not in repo.files
        steps = [json.loads(l)["step"] for l in repo.files["metrics.jsonl"].decode().splitlines()]
        assert steps == list(range(1, len(steps) + 1))
        # every lease the repo ever held is one session's: no commit of the loser landed (when the two start together
        # on a loaded machine, the loser's attempt on the same head can reach the Hub, which refuses it)
        sessions = {
            Holder.from_bytes(tree[LEASE_FILE].content).session
            for tree in repo.snapshots.values()
            if LEASE_FILE in tree
        }
        assert len(sessions) == 1, sessions


def test_a_killed_session_leaves_its_lease_the_next_takes_it_over_and_finishes_the_range_exactly(tmp_path):
    """A session on another machine killed with SIGKILL mid-range: its lease stays. The next session stops in one
    line (exit 0) until the lease expires; with --take_over it takes the lease and finishes the range, with the
    losses of an uninterrupted chain."""
    with HubServer(token=HF_TOK) as server:
        (tmp_path / "straight").mkdir()
        ref = run_cli(
            BASE + ["--end_idx", "120", "--output_dir", str(tmp_path / "straight" / "out")], tmp_path / "straight"
        )
        assert ref.returncode == 0, ref.stderr[-2000:]
        want = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "straight" / "out" / "metrics.jsonl")}

        (tmp_path / "s1").mkdir()
        env = hub_env(tmp_path, server, "s1")
        killed = _start(
            CHAIN + ["--save_every_steps", "10", "--output_dir", str(tmp_path / "s1" / "out")], tmp_path / "s1", env
        )
        deadline = time.monotonic() + 240
        while "checkpoints/tiny_opt_0-120-epoch-1-step-20.pt" not in server.repos.get(REPO, _Empty).files:
            assert time.monotonic() < deadline and killed.poll() is None, killed.communicate()
            time.sleep(0.2)
        killed.send_signal(signal.SIGKILL)
        killed.communicate()
        repo = server.repos[REPO]
        holder = Holder.from_bytes(repo.files[LEASE_FILE])
        assert holder is not None and holder.expires > time.time() + 3600  # 12 h + --hub_wait from its start
        # That session ran on another machine (here, all run on one host, where a gone process frees its lease)
        holder.host = "kaggle-other-machine"
        store = _store(server)
        from huggingface_hub import CommitOperationAdd

        store.api.create_commit(
            REPO, [CommitOperationAdd(LEASE_FILE, holder.to_bytes())], commit_message="as elsewhere"
        )

        (tmp_path / "s2").mkdir()
        blocked = run_cli(
            CHAIN + ["--output_dir", str(tmp_path / "s2" / "out")], tmp_path / "s2", env=hub_env(tmp_path, server, "s2")
        )
        assert blocked.returncode == 0, blocked.stderr[-2000:]
        assert (
            f"chain: another session holds the lease on {REPO}: session {holder.session[:8]} on kaggle-other-machine"
            in blocked.stdout
        )
        assert "fsdp-opt run" not in blocked.stdout

        (tmp_path / "s3").mkdir()
        took = run_cli(
            CHAIN + ["--take_over", "--output_dir", str(tmp_path / "s3" / "out")],
            tmp_path / "s3",
            env=hub_env(tmp_path, server, "s3"),
        )
        assert took.returncode == 0, took.stderr[-2000:]
        assert f"chain: took over the lease of session {holder.session[:8]} on kaggle-other-machine" in took.stdout
        assert "(--take_over)" in took.stdout and "stopped inside its range: finishing it" in took.stdout
        got = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "s3" / "out" / "metrics.jsonl")}
        assert sorted(got) == sorted(want) and all(got[k] == want[k] for k in want), (got, want)
        assert LEASE_FILE not in server.repos[REPO].files  # released at the end


class _Empty:
    files: dict = {}


def test_without_a_repo_the_lease_is_a_file_in_output_dir_for_runs_that_share_a_disk(tmp_path):
    out = tmp_path / "shared" / "out"
    args = BASE + ["--end_idx", "120", "--output_dir", str(out)]
    first = _start(args, tmp_path, sandbox_env(tmp_path))
    deadline = time.time() + 120  # the second starts once the first holds the lease (its start takes seconds)
    while not (out / LOCAL_LEASE).exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    second = run_cli(args, tmp_path)
    done = first.communicate(timeout=300)
    assert first.returncode == 0 and second.returncode == 0, (done, second.stderr[-2000:])
    outs = [done[0], second.stdout]
    stopped = [o for o in outs if "chain: another session holds the lease on " + str(out) in o]
    assert len(stopped) == 1 and "fsdp-opt run" not in stopped[0], outs
    assert not (out / LOCAL_LEASE).exists()  # released at the end
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(
        range(1, len(read_jsonl(out / "metrics.jsonl")) + 1)
    )
