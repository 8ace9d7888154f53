"""The Hub as the checkpoint store and W&B across slices, with the real huggingface_hub client and real W&B.

The Hub is a loopback server (tests/hubserver.py) on 127.0.0.1; subprocesses get HF_ENDPOINT in their environment
before anything imports huggingface_hub, and in-process tests pass the endpoint explicitly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    ASSETS,
    COMMON,
    HF_TOK,
    WB_KEY,
    assert_clean_failure,
    hub_env,
    read_jsonl,
    run_cli,
    saved_names,
    wandb_records,
)
from hubserver import HubServer


def offline_runs(out_dir: Path) -> list[Path]:
    return sorted((out_dir / "wandb").glob("offline-run-*"))


def test_sessions_chain_through_the_hub(tmp_path):
    """Push every checkpoint (through injected 503s; --hub_keep_full 0 keeps them all), resume by `latest` and by
    name on empty machines, export, model card, one W&B run across slices, and no token anywhere."""
    with HubServer(token=HF_TOK) as server:
        server.fail("commit", 2)
        s1 = run_cli(
            COMMON
            + [
                "--start_idx",
                "0",
                "--end_idx",
                "48",
                "--eval_rows",
                "8",
                "--batch_size",
                "2",
                "--save_every_steps",
                "3",
                "--keep_last",
                "1",
                "--hf_repo",
                "me/run",
                "--hub_keep_full",
                "0",
                "--wandb_mode",
                "offline",
                "--output_dir",
                "s1",
            ],
            tmp_path,
            nproc=2,
            env=hub_env(tmp_path, server, "s1"),
        )
        assert s1.returncode == 0, s1.stdout + s1.stderr
        repo = server.repos["me/run"]
        assert repo.private
        assert server.count("commit", 503) == 2 and not server._failures["commit"]
        assert server.max_in_commit == 1
        # Every saved checkpoint is on the Hub, or was replaced by a newer one before its turn came.
        saved = saved_names(s1.stdout)
        replaced = set(re.findall(r"hub: (\S+) is replaced by", s1.stdout))
        assert len(saved) >= 5 and saved[-1] == "tiny_opt_0-48-epoch-1.pt"
        for name in saved:
            assert f"checkpoints/{name}" in repo.files or name in replaced, name
        for name in (saved[-1], saved[-2]):  # the epoch checkpoint and the newest step checkpoint
            assert f"checkpoints/{name}" in repo.files
        # Pruned locally only after the upload: what is left is the newest, byte for byte what the Hub has.
        local = sorted(p.name for p in (tmp_path / "s1").glob("*.pt"))
        assert local == [saved[-1]]
        assert (tmp_path / "s1" / saved[-1]).read_bytes() == repo.files[f"checkpoints/{saved[-1]}"]
        m1 = read_jsonl(tmp_path / "s1" / "metrics.jsonl")
        index = json.loads(repo.files["fsdp_opt_index.json"])
        assert index["checkpoints"][saved[-1]]["global_step"] == m1[-1]["step"]

        # Session 2: an empty machine resumes `latest` from the Hub, trains the next slice, exports the model.
        s2 = run_cli(
            COMMON
            + [
                "--start_idx",
                "48",
                "--end_idx",
                "80",
                "--batch_size",
                "2",
                "--resume_file",
                "latest",
                "--hf_repo",
                "me/run",
                "--wandb_mode",
                "offline",
                "--output_dir",
                "s2",
                "--export_hf",
                "s2/export",
            ],
            tmp_path,
            nproc=2,
            env=hub_env(tmp_path, server, "s2"),
        )
        assert s2.returncode == 0, s2.stdout + s2.stderr
        assert f"latest checkpoint is {saved[-1]} (global step {m1[-1]['step']})" in s2.stdout
        # The step log continues on the new machine: session 1's lines come from the repo, then session 2's.
        m2_all = read_jsonl(tmp_path / "s2" / "metrics.jsonl")
        assert m2_all[: len(m1)] == m1
        m2 = m2_all[len(m1) :]
        assert {m["slice"] for m in m2} == {"48-80"} and m2[0]["step"] == m1[-1]["step"] + 1
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(repo.files)

        # Session 3: resume by name (not present locally), plain python, one rank with the same global batch.
        name = saved_names(s2.stdout)[-1]
        assert name == "tiny_opt_48-80-epoch-1.pt"
        s3 = run_cli(
            COMMON
            + [
                "--start_idx",
                "80",
                "--end_idx",
                "112",
                "--batch_size",
                "4",
                "--resume_file",
                name,
                "--hf_repo",
                "me/run",
                "--wandb_mode",
                "offline",
                "--wandb_new_run",
                "--output_dir",
                "s3",
            ],
            tmp_path,
            nproc=0,
            env=hub_env(tmp_path, server, "s3"),
        )
        assert s3.returncode == 0, s3.stdout + s3.stderr
        assert f"downloading {name} from the Hub repo me/run" in s3.stdout
        m3 = [m for m in read_jsonl(tmp_path / "s3" / "metrics.jsonl") if m["slice"] == "80-112"]
        assert m3[0]["step"] == m2[-1]["step"] + 1 and m3[0]["epoch"] == 0

        # The exported model loads with from_pretrained straight from the repo.
        load = subprocess.run(
            [
                sys.executable,
                "-c",
                "from transformers import AutoModelForCausalLM as M; "
                "m = M.from_pretrained('me/run'); print(sum(p.numel() for p in m.parameters()))",
            ],
            env=hub_env(tmp_path, server, "load"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert load.returncode == 0, load.stderr
        from transformers import AutoConfig, AutoModelForCausalLM

        expected = sum(
            p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ASSETS)).parameters()
        )
        assert int(load.stdout.split()[-1]) == expected

        card = repo.files["README.md"].decode()
        index = json.loads(repo.files["fsdp_opt_index.json"])
        auth = {r.authorization for r in server.requests if r.route == "commit"}
        repo_files = dict(repo.files)

    # Model card: base model, data, one row per slice with its last loss, hyperparameters, load and resume.
    assert card.startswith("---\n") and "**tiny-opt**" in card and "**python-docs**" in card
    rows = [line for line in card.splitlines() if line.startswith("| [")]
    assert [r.split("|")[1].strip() for r in rows] == ["[0, 48)", "[48, 80)", "[80, 112)"]
    e1 = read_jsonl(tmp_path / "s1" / "eval.jsonl")
    assert len(e1) == len(saved) and e1[-1]["step"] == m1[-1]["step"]
    assert f"| {m1[-1]['loss']:.4f} | {e1[-1]['loss']:.4f} |" in rows[0] and f"| {m2[-1]['loss']:.4f} | - |" in rows[1]
    assert f"{m2[0]['step']}–{m2[-1]['step']}" in rows[1]
    assert "| lr | 0.003 |" in card and "| global_batch | 4 |" in card
    assert 'AutoModelForCausalLM.from_pretrained("me/run")' in card and "--resume_file latest --hf_repo me/run" in card
    assert index["export"]["global_step"] == m2[-1]["step"]
    assert "--start_idx 112 --end_idx 144 --resume_file latest" in card

    # W&B: the history holds every step's loss; session 2 continues the same run; session 3 opted out.
    (run1,), (run2,), (run3,) = (
        offline_runs(tmp_path / "s1"),
        offline_runs(tmp_path / "s2"),
        offline_runs(tmp_path / "s3"),
    )
    run_id = run1.name.rsplit("-", 1)[-1]
    assert run2.name.endswith("-" + run_id) and not run3.name.endswith("-" + run_id)
    records = wandb_records(run1)
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == [m["step"] for m in m1]
    for m in m1:
        assert history[m["step"]]["train/loss"] == pytest.approx(m["loss"], rel=1e-12)
        assert history[m["step"]]["train/grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-12)
    assert history[m1[-1]["step"]]["eval/loss"] == pytest.approx(e1[-1]["loss"], rel=1e-12)
    refs = [c["ref"] for r in records if r["type"] == "artifact" for c in r["artifact"]["manifest"]["contents"]]
    assert any(ref.startswith(f"{server.url}/me/run/resolve/") and ref.endswith(saved[-1]) for ref in refs), refs
    config = next(r["run"]["config"]["update"] for r in records if r["type"] == "run")
    assert config["hf_repo"] == "me/run"
    history2 = [r["history"]["step"]["num"] for r in wandb_records(run2) if r["type"] == "history"]
    assert history2 == [m["step"] for m in m2]

    # Tokens: used (the server saw them) but never printed, logged or stored.
    assert auth == {f"Bearer {HF_TOK}"}
    outputs = "".join(p.stdout + p.stderr for p in (s1, s2, s3, load))
    for secret in (HF_TOK, WB_KEY):
        assert secret not in outputs
        for f in tmp_path.rglob("*"):
            if f.is_file() and not f.is_symlink():
                assert secret.encode() not in f.read_bytes(), f
        for path, content in repo_files.items():
            assert secret.encode() not in content, path


def test_failed_uploads_never_stop_training(tmp_path):
    """A Hub that always fails (503): training finishes, every local checkpoint is kept and reported; the uploads are
    tried again at the end while --hub_wait lasts, and the session then ends with exit 3 (its newest checkpoint is
    not on the Hub)."""
    with HubServer(token=HF_TOK) as server:
        server.fail("commit", 1000)
        proc = run_cli(
            COMMON
            + [
                "--start_idx",
                "0",
                "--end_idx",
                "32",
                "--batch_size",
                "2",
                "--save_every_steps",
                "4",
                "--keep_last",
                "1",
                "--hf_repo",
                "me/run",
                "--hub_public",
                "--hub_retries",
                "1",
                "--wandb_mode",
                "disabled",
                "--output_dir",
                "out",
                "--hub_wait",
                "4s",
            ],
            tmp_path,
            nproc=2,
            env=hub_env(tmp_path, server, "a"),
        )
        assert server.repos["me/run"].files == {} and not server.repos["me/run"].private
    # rank 0 exits 3 (under torchrun, as here, the launcher's own code is 1 and its report names rank 0's 3)
    assert proc.returncode != 0 and "rank 0: exit 3" in proc.stderr, proc.stdout + proc.stderr
    assert "upload(s) failed for a passing reason (HTTP 503" in proc.stdout
    saved = saved_names(proc.stdout)
    assert len(saved) >= 3
    assert sorted(p.name for p in (tmp_path / "out").glob("*.pt")) == sorted(saved)  # --keep_last deleted nothing
    assert "retry 1/1" in proc.stdout
    epoch_file = tmp_path / "out" / saved[-1]
    assert f"warning: upload of {saved[-1]} to me/run failed (HTTP 503" in proc.stdout
    assert f"the local copy is kept: {epoch_file}" in proc.stdout


def test_hub_bad_input(tmp_path):
    with HubServer(token=HF_TOK) as server:
        # A token the Hub refuses: one line naming --hf_repo, on both ranks, before any training.
        env = hub_env(tmp_path, server, "bad")
        env["HF_TOKEN"] = "hf_wrong"
        proc = run_cli(
            COMMON + ["--end_idx", "16", "--hf_repo", "me/run", "--wandb_mode", "disabled"], tmp_path, nproc=2, env=env
        )
        assert_clean_failure(proc, "--hf_repo me/run", "HTTP 401", "HF_TOKEN")
        assert "hf_wrong" not in proc.stdout + proc.stderr

        # A name found nowhere: one line that lists what output_dir and the Hub repo hold.
        from huggingface_hub import HfApi

        api = HfApi(endpoint=server.url, token=HF_TOK)
        api.create_repo("me/run", private=True)
        api.upload_file(path_or_fileobj=b"x", path_in_repo="checkpoints/tiny_opt_0-16-epoch-1.pt", repo_id="me/run")
        proc = run_cli(
            COMMON
            + [
                "--end_idx",
                "16",
                "--hf_repo",
                "me/run",
                "--resume_file",
                "tiny_opt_0-99-epoch-1.pt",
                "--wandb_mode",
                "disabled",
            ],
            tmp_path,
            env=hub_env(tmp_path, server, "b"),
        )
        line = assert_clean_failure(proc, "--resume_file tiny_opt_0-99-epoch-1.pt", "me/run")
        assert "checkpoints there: tiny_opt_0-16-epoch-1.pt" in line


def test_uploader_order_one_at_a_time(tmp_path):
    """In process: a newer step checkpoint replaces a waiting one; epoch checkpoints are never dropped;
    a replaced file may be deleted only once something newer is on the Hub."""
    from fsdp_opt.hub.store import HubStore
    from fsdp_opt.hub.uploads import Uploader

    files = {}
    for name in ("m_0-8-epoch-1-step-1.pt", "m_0-8-epoch-1-step-2.pt", "m_0-8-epoch-1-step-3.pt", "m_0-8-epoch-1.pt"):
        files[name] = tmp_path / name
        files[name].write_bytes(os.urandom(1000))
    with HubServer(token=HF_TOK) as server:
        server.gate.clear()
        store = HubStore("me/q", endpoint=server.url)
        store.api.token = HF_TOK
        log: list[str] = []
        up = Uploader(
            store, lambda index: "---\n---\ncard\n", run={}, private=True, retries=2, backoff=0.1, log=log.append
        )
        jobs = [up.submit(files["m_0-8-epoch-1-step-1.pt"], "step", {"global_step": 1})]
        deadline = time.monotonic() + 30
        while server.in_commit == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.in_commit == 1  # step 1 is in flight, held by the server
        jobs.append(up.submit(files["m_0-8-epoch-1-step-2.pt"], "step", {"global_step": 2}))
        jobs.append(up.submit(files["m_0-8-epoch-1.pt"], "epoch", {"global_step": 2}))
        jobs.append(up.submit(files["m_0-8-epoch-1-step-3.pt"], "step", {"global_step": 3}))
        assert [j.status for j in jobs] == ["uploading", "superseded", "waiting", "waiting"]
        assert not up.is_on_hub(files["m_0-8-epoch-1-step-2.pt"])
        server.fail("commit", 1)  # the next commit fails once and is retried
        server.gate.set()
        assert up.finish(timeout=60) == []
        repo_files = server.files("me/q")
        # A later session that writes a checkpoint under a name the repo already has: until its own upload is
        # done, the local file is the only copy of what it holds.
        again = Uploader(
            store, lambda index: "---\n---\ncard\n", run={}, private=True, retries=0, backoff=0.1, log=log.append
        )
        step1 = files["m_0-8-epoch-1-step-1.pt"]
        assert again.is_on_hub(step1)
        server.gate.clear()
        again.submit(step1, "step", {"global_step": 1})
        assert not again.is_on_hub(step1)
        server.gate.set()
        assert again.finish(timeout=60) == [] and again.is_on_hub(step1)
    assert [j.status for j in jobs] == ["done", "superseded", "done", "done"]
    assert server.max_in_commit == 1
    assert "checkpoints/m_0-8-epoch-1-step-2.pt" not in repo_files
    for name in ("m_0-8-epoch-1-step-1.pt", "m_0-8-epoch-1.pt", "m_0-8-epoch-1-step-3.pt"):
        assert repo_files[f"checkpoints/{name}"] == files[name].read_bytes()
    assert up.is_on_hub(files["m_0-8-epoch-1-step-2.pt"])  # a newer checkpoint is on the Hub now
    assert any("retry 1/2" in line for line in log)
    index = json.loads(repo_files["fsdp_opt_index.json"])
    assert sorted(index["checkpoints"]) == ["m_0-8-epoch-1-step-1.pt", "m_0-8-epoch-1-step-3.pt", "m_0-8-epoch-1.pt"]


def test_sharded_checkpoints_through_the_hub(tmp_path):
    """A sharded checkpoint is a folder: pushed whole, and fetched whole by `latest` on an empty machine."""
    with HubServer(token=HF_TOK) as server:
        args = COMMON + [
            "--batch_size",
            "2",
            "--state_dict_type",
            "sharded",
            "--hf_repo",
            "me/run",
            "--wandb_mode",
            "disabled",
        ]
        s1 = run_cli(
            args + ["--end_idx", "24", "--output_dir", "s1"], tmp_path, nproc=2, env=hub_env(tmp_path, server, "s1")
        )
        assert s1.returncode == 0, s1.stdout + s1.stderr
        folder = tmp_path / "s1" / "tiny_opt_0-24-epoch-1"
        local = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        remote = {
            k.split("/", 2)[2]: v
            for k, v in server.files("me/run").items()
            if k.startswith("checkpoints/tiny_opt_0-24-epoch-1/")
        }
        # on a mismatch, the run's own account of its upload (a failed push is a line of its output, not an exit code)
        assert len(local) >= 3 and remote == local, [l for l in s1.stdout.splitlines() if l.startswith("hub:")]
        s2 = run_cli(
            args + ["--start_idx", "24", "--end_idx", "48", "--resume_file", "latest", "--output_dir", "s2"],
            tmp_path,
            nproc=2,
            env=hub_env(tmp_path, server, "s2"),
        )
        assert s2.returncode == 0, s2.stdout + s2.stderr
    m1, m2 = read_jsonl(tmp_path / "s1" / "metrics.jsonl"), read_jsonl(tmp_path / "s2" / "metrics.jsonl")
    assert m2[: len(m1)] == m1 and m2[len(m1)]["step"] == m1[-1]["step"] + 1 and m2[len(m1)]["slice"] == "24-48"
    assert f"resumed {tmp_path / 's2' / 'tiny_opt_0-24-epoch-1'}" in s2.stdout.replace("s2/", f"{tmp_path}/s2/")


def test_exit_wait_is_bounded(tmp_path):
    """A Hub that never answers: the run ends after --hub_wait, not 0 (3): its last line names the local file left
    behind and what a session elsewhere would resume from."""
    with HubServer(token=HF_TOK) as server:
        server.gate.clear()  # every commit hangs
        started = time.monotonic()
        proc = run_cli(
            COMMON
            + [
                "--end_idx",
                "16",
                "--hf_repo",
                "me/run",
                "--hub_wait",
                "3s",
                "--wandb_mode",
                "disabled",
                "--output_dir",
                "out",
            ],
            tmp_path,
            env=hub_env(tmp_path, server, "a"),
        )
        took = time.monotonic() - started
        server.gate.set()
    assert proc.returncode == 3, proc.stdout + proc.stderr
    name = saved_names(proc.stdout)[-1]
    assert "hub: waiting for 1 upload(s)" in proc.stdout
    assert (
        f"warning: upload of {name} to me/run did not finish in --hub_wait; the local copy is kept: {tmp_path / 'out' / name}"
        in proc.stdout
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"error: the checkpoint {name} did not reach me/run (its upload did not end within --hub_wait)"
    )
    assert f"kept whole here: {tmp_path / 'out' / name}" in last
    assert took < 60


def test_wandb_without_network_falls_back(tmp_path):
    """An API key but no reachable W&B server: online start fails, the run logs offline and trains on."""
    with HubServer(token=HF_TOK) as server:
        env = hub_env(tmp_path, server, "a")
    env.pop("WANDB_MODE")  # --wandb_mode auto with a key: online
    env.update(WANDB_BASE_URL="http://127.0.0.1:9", WANDB_INIT_TIMEOUT="8")
    proc = run_cli(COMMON + ["--end_idx", "16", "--output_dir", "out"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warning: W&B online start failed" in proc.stdout and "logging offline instead" in proc.stdout
    (run,) = offline_runs(tmp_path / "out")
    history = [r for r in wandb_records(run) if r["type"] == "history"]
    assert len(history) == len(read_jsonl(tmp_path / "out" / "metrics.jsonl"))
    assert WB_KEY not in proc.stdout + proc.stderr


def test_disk_budget_makes_room_with_hub_copies(tmp_path):
    """--disk_budget deletes local checkpoints only when the Hub has them, oldest first, before a save."""
    with HubServer(token=HF_TOK) as server:
        base = COMMON + [
            "--keep_last",
            "0",
            "--hf_repo",
            "me/run",
            "--hub_keep_full",
            "0",
            "--wandb_mode",
            "disabled",
            "--output_dir",
            "out",
        ]
        s1 = run_cli(
            base + ["--end_idx", "16", "--save_every_steps", "2"], tmp_path, env=hub_env(tmp_path, server, "a")
        )
        assert s1.returncode == 0, s1.stdout + s1.stderr
        first = sorted((tmp_path / "out").glob("*.pt"), key=lambda p: p.stat().st_mtime)
        assert len(first) >= 3 and all(f"checkpoints/{p.name}" in server.repos["me/run"].files for p in first)
        one = max(p.stat().st_size for p in first)
        budget = int(2.5 * one)
        s2 = run_cli(
            base + ["--start_idx", "16", "--end_idx", "32", "--resume_file", "latest", "--disk_budget", str(budget)],
            tmp_path,
            env=hub_env(tmp_path, server, "b"),
        )
        assert s2.returncode == 0, s2.stdout + s2.stderr
        repo = set(server.repos["me/run"].files)
    removed = [
        Path(p).name
        for p in re.findall(r"^removed (\S+) \([\d.,]+ GB; the Hub has it\) to make room", s2.stdout, flags=re.M)
    ]
    assert removed == [p.name for p in first[: len(removed)]] and len(removed) == len(first) - 1  # oldest first
    assert all(f"checkpoints/{name}" in repo for name in removed)
    left = list((tmp_path / "out").glob("*.pt"))
    assert sum(p.stat().st_size for p in left) <= budget and "warning: --disk_budget" not in s2.stdout
