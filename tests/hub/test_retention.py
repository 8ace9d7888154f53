"""What the Hub repo keeps (--hub_keep_full): the policy itself, a chain of five slices on fresh machines against
the loopback Hub (which counts storage as the Hub does: a deleted file's LFS object counts until it is purged),
a push that fails, resume from a retired range's weights file, and a purge that a later session finishes."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from conftest import COMMON, HF_TOK, hub_env, read_jsonl, run_cli, saved_names
from hubserver import HubServer

from fsdp_opt.checkpoint.names import MODEL_KEY
from fsdp_opt.hub.retention import decide

ROWS = 20  # rows per slice


def test_policy_keeps_the_newest_full_and_one_weights_file_per_range():
    steps = {"m_0-8-epoch-1-step-2.pt": 2, "m_0-8-epoch-1.pt": 4, "m_8-16-epoch-1-step-6.pt": 6, "m_8-16-epoch-1.pt": 8}
    full = set(steps) | {"foreign_0-8-epoch-1.pt"}  # pushed by something else: never touched
    weights = {n.replace(".pt", ".safetensors") for n in steps}
    d = decide(steps, full, weights, keep_full=1)
    assert d.keep_full == ["foreign_0-8-epoch-1.pt", "m_8-16-epoch-1.pt"]
    assert d.delete_full == ["m_0-8-epoch-1-step-2.pt", "m_0-8-epoch-1.pt", "m_8-16-epoch-1-step-6.pt"]
    assert d.keep_weights == ["m_0-8-epoch-1.safetensors", "m_8-16-epoch-1.safetensors"]
    assert d.delete_weights == ["m_0-8-epoch-1-step-2.safetensors", "m_8-16-epoch-1-step-6.safetensors"]
    # Two full checkpoints kept: the newest two by global step, a mid-epoch one included.
    d2 = decide(steps, full, weights, keep_full=2)
    assert set(d2.keep_full) == {"foreign_0-8-epoch-1.pt", "m_8-16-epoch-1.pt", "m_8-16-epoch-1-step-6.pt"}
    assert d2.delete_weights == d.delete_weights
    # 0 keeps everything; a range whose newest checkpoint has no weights file keeps its full state.
    assert not decide(steps, full, weights, keep_full=0).changes
    d3 = decide(steps, full, weights - {"m_0-8-epoch-1.safetensors"}, keep_full=1)
    assert d3.kept_without_weights == ["m_0-8-epoch-1.pt"] and "m_0-8-epoch-1.pt" in d3.keep_full
    # Only the weights left for a range (its full state retired earlier): they stay, and older ones go.
    d4 = decide(steps, {"m_8-16-epoch-1.pt"}, {"m_0-8-epoch-1.safetensors", "m_0-8-epoch-1-step-2.safetensors"}, 1)
    assert d4.keep_weights == ["m_0-8-epoch-1.safetensors"] and d4.delete_weights == [
        "m_0-8-epoch-1-step-2.safetensors"
    ]


def _stored_equals_head(server: HubServer, repo_id: str) -> None:
    """Storage holds exactly the LFS objects the head uses: everything removed was purged, nothing used was."""
    repo = server.repos[repo_id]
    assert server.broken_refs == []
    assert set(repo.lfs) == set(repo.lfs_paths().values())
    assert repo.used_storage == sum(b.size for b in repo.tree.values())


def test_chain_of_four_slices_keeps_the_policy(tmp_path):
    with HubServer(token=HF_TOK) as server:
        finals: list[str] = []

        def session(i: int, name: str, nproc: int, extra: list[str] = ()):
            start = i * ROWS
            args = COMMON + [
                "--start_idx",
                str(start),
                "--end_idx",
                str(start + ROWS),
                "--total_batch_size",
                "4",
                "--batch_size",
                str(4 // max(1, nproc)),
                "--save_every_steps",
                "2",
                "--hf_repo",
                "me/run",
                "--wandb_mode",
                "disabled",
                "--output_dir",
                name,
                *extra,
            ]
            if i:
                args += ["--resume_file", "latest"]
            return run_cli(args, tmp_path, nproc=nproc, env=hub_env(tmp_path, server, name))

        def check_repo(names: list[str]) -> dict:
            repo = server.repos["me/run"]
            expected = {"README.md", "fsdp_opt_index.json", "metrics.jsonl", f"checkpoints/{names[-1]}"}
            expected |= {f"weights/{n.replace('.pt', '.safetensors')}" for n in names}
            assert set(repo.tree) == expected
            _stored_equals_head(server, "me/run")
            return repo.files

        for i in range(4):
            if i == 2:
                # The newest push fails (the Hub answers 503 to every upload): nothing is deleted, and the repo
                # still holds slice 1's full checkpoint, byte for byte.
                before = dict(server.repos["me/run"].files)
                server.fail("lfs-batch", 1000)
                failed = session(i, "s2-failed", nproc=0, extra=["--hub_retries", "0", "--hub_wait", "2s"])
                server.clear_failures()
                assert failed.returncode == 3, failed.stdout + failed.stderr  # its newest checkpoint is not on the Hub
                assert "warning: upload of" in failed.stdout and "retired" not in failed.stdout
                assert server.repos["me/run"].files == before
            proc = session(i, f"s{i}", nproc=2 if i % 2 == 0 else 0)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            if i:
                assert f"latest checkpoint is {finals[-1]}" in proc.stdout  # a fresh machine: from the Hub
            saved = saved_names(proc.stdout)
            assert len(saved) >= 3 and saved[-1] == f"tiny_opt_{i * ROWS}-{(i + 1) * ROWS}-epoch-1.pt"
            finals.append(saved[-1])
            files = check_repo(finals)
            # The weights file is the final checkpoint's model in fp16, and says which step it is.
            local = torch.load(tmp_path / f"s{i}" / saved[-1], weights_only=True)
            weights_path = tmp_path / "w.safetensors"
            weights_path.write_bytes(files[f"weights/{saved[-1].replace('.pt', '.safetensors')}"])
            from safetensors.torch import load_file, safe_open

            stored = load_file(str(weights_path))
            assert stored.keys() == local[MODEL_KEY].keys() - {"lm_head.weight"}  # the tied head once
            for k, v in stored.items():
                assert v.dtype == torch.float16 and torch.equal(v, local[MODEL_KEY][k].half())
            with safe_open(str(weights_path), "pt") as f:
                assert json.loads(f.metadata()["fsdp_opt"])["GLOBAL_STEP"] == local["GLOBAL_STEP"]

        index = json.loads(files["fsdp_opt_index.json"])
        card = files["README.md"].decode()
        storage = index["storage"]
        assert storage == {**storage, "full_checkpoints": 1, "weights_files": 4}
        # Measured before the commit that records it: that commit's own small files (index, card) come on top.
        assert abs(server.repos["me/run"].used_storage - storage["bytes"]) <= 64 * 1024
        assert f"Repo storage: {storage['bytes'] / 1e9:,.2f} GB (1 full resumable checkpoint(s)" in card
        rows = [line for line in card.splitlines() if line.startswith("| [")]
        assert [r.split("|")[7].strip() for r in rows[:3]] == [
            f"`weights/{n.replace('.pt', '.safetensors')}`" for n in finals[:3]
        ]
        assert rows[3].split("|")[7].strip() == f"`checkpoints/{finals[3]}`"

        # A retired range resumes from its weights file: the weights and the global step continue.
        first_step = index["checkpoints"][finals[0]]["global_step"]
        proc = run_cli(
            COMMON
            + [
                "--start_idx",
                str(ROWS),
                "--end_idx",
                str(2 * ROWS),
                "--total_batch_size",
                "4",
                "--batch_size",
                "4",
                "--hf_repo",
                "me/run",
                "--hub_keep_full",
                "0",
                "--wandb_mode",
                "disabled",
                "--output_dir",
                "branch",
                "--resume_file",
                finals[0],
                "--overwrite",  # the repo has rows [20, 40) trained already: trained again on purpose
            ],
            tmp_path,
            env=hub_env(tmp_path, server, "branch"),
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"only the weights of {finals[0]} are left in the Hub repo me/run" in proc.stdout
        assert "AdamW moments start from zero" in proc.stdout and "RNG is not restored" in proc.stdout
        assert read_jsonl(tmp_path / "branch" / "metrics.jsonl")[-1]["step"] > first_step
        assert (
            f"resumed {Path('branch') / finals[0].replace('.pt', '.safetensors')} at global step {first_step}"
            in proc.stdout
        )


def test_a_purge_the_hub_refused_is_finished_by_the_next_session(tmp_path):
    """In process: the Hub refuses the storage purge; the run's index keeps the objects to purge, and the next
    session's uploader purges them after its first push. A commit that failed after its upload is purged too."""
    from fsdp_opt.hub.store import HubStore
    from fsdp_opt.hub.uploads import Uploader

    names = ["m_0-8-epoch-1.pt", "m_8-16-epoch-1.pt", "m_16-24-epoch-1.pt", "m_24-32-epoch-1.pt"]
    for i, name in enumerate(names):
        torch.save({MODEL_KEY: {"w": torch.randn(64, 64)}, "GLOBAL_STEP": i + 1}, tmp_path / name)
    with HubServer(token=HF_TOK) as server:
        store = HubStore("me/q", retries=0, endpoint=server.url)  # a refusal is final, not retried
        store.api.token = HF_TOK
        log: list[str] = []

        def uploader() -> Uploader:
            return Uploader(
                store,
                lambda index: "---\n---\ncard\n",
                run={},
                private=True,
                retries=0,
                backoff=0.1,
                log=log.append,
                keep_full=1,
            )

        up = uploader()
        up.submit(tmp_path / names[0], "epoch", {"global_step": 1})
        server.fail("lfs-delete", 1)
        up.submit(tmp_path / names[1], "epoch", {"global_step": 2})
        assert up.finish(timeout=60) == []
        repo = server.repos["me/q"]
        assert set(repo.tree) >= {f"checkpoints/{names[1]}", "weights/m_0-8-epoch-1.safetensors"}
        assert f"checkpoints/{names[0]}" not in repo.tree
        pending = json.loads(repo.files["fsdp_opt_index.json"])["purge_pending"]
        assert pending and set(pending) == set(repo.lfs) - set(repo.lfs_paths().values())  # names[0]'s object
        assert any("tried again after the next upload" in line for line in log)

        # The next session: its push's commit fails after the upload once, then a push lands and purges it all.
        up2 = uploader()
        assert up2.repo.to_purge == set(pending)
        server.fail("commit", 1)
        up2.submit(tmp_path / names[2], "epoch", {"global_step": 3})
        deadline = time.monotonic() + 60
        while up2.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert up2.jobs[0].status == "failed" and len(up2.repo.to_purge) > len(pending)  # its uploaded objects queued
        up2.submit(tmp_path / names[3], "epoch", {"global_step": 4})
        assert up2.finish(timeout=60) == [up2.jobs[0]]
        _stored_equals_head(server, "me/q")
        assert set(repo.tree) == {
            "README.md",
            "fsdp_opt_index.json",
            f"checkpoints/{names[3]}",
            "weights/m_0-8-epoch-1.safetensors",
            "weights/m_8-16-epoch-1.safetensors",
            "weights/m_24-32-epoch-1.safetensors",
        }
        assert json.loads(repo.files["fsdp_opt_index.json"])["purge_pending"] == []


@pytest.mark.parametrize(
    "argv,needles",
    [
        (["--hub_keep_full", "2"], ["--hub_keep_full", "--hf_repo"]),
        (["--hub_keep_full", "-1", "--hf_repo", "me/run"], ["--hub_keep_full -1"]),
        (["--hub_keep_full", "one", "--hf_repo", "me/run"], ["--hub_keep_full", "one"]),
    ],
)
def test_bad_retention_flags_get_one_line(tmp_path, argv, needles):
    from conftest import assert_clean_failure

    proc = run_cli(
        ["--model", "tiny-opt", "--dataset", "python-docs", "--output_dir", str(tmp_path / "out"), *argv],
        tmp_path,
        timeout=120,
    )
    assert_clean_failure(proc, *needles)
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    assert not re.search(r"Traceback", proc.stderr)


def test_network_errors_of_the_hub_client_are_worth_a_retry():
    """huggingface_hub talks through httpx, whose network errors are not OSErrors: a refused connection or a dropped
    read is retried (and an unreachable Hub at start is 'not reachable now'), a 4xx is not."""
    import httpx

    from fsdp_opt.hub.retry import is_transient

    request = httpx.Request("GET", "http://127.0.0.1:9/api/models/me/run")
    assert is_transient(httpx.ConnectError("[Errno 111] Connection refused", request=request))
    assert is_transient(httpx.ReadError("connection reset", request=request))
    assert is_transient(httpx.ReadTimeout("timed out", request=request))
    assert is_transient(ConnectionResetError())
    refused = httpx.HTTPStatusError("401", request=request, response=httpx.Response(401, request=request))
    assert not is_transient(refused)
    assert is_transient(httpx.HTTPStatusError("503", request=request, response=httpx.Response(503, request=request)))
    assert not is_transient(ValueError("bad"))
