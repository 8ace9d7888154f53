"""--start_idx auto: one command for every session. The same command on fresh machines (empty output folder, empty
cache) with the loopback Hub walks the ranges, finishes a range a SIGTERM cut, and equals the chain typed by hand,
name for name and loss for loss; the end of the data and of the passes; several ranges in one session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import torch
from conftest import COMMON, HF_TOK, WB_KEY, hub_env, read_jsonl, run_cli, saved_names, torchrun_cmd
from hubserver import HubServer

from fsdp_opt.checkpoint.chain import CHAIN_KEY

RANGE = 20  # rows per range: about 13 steps of 2 blocks at 2 ranks x batch 1
R1, R2, R3, R4 = RANGE, 2 * RANGE, 3 * RANGE, 4 * RANGE  # where the ranges end
ARGS = COMMON + ["--batch_size", "1", "--save_every_steps", "10", "--precision", "fp32", "--seed", "5"]


def auto_args(out: Path) -> list[str]:
    return ARGS + [
        "--start_idx",
        "auto",
        "--range_size",
        str(RANGE),
        "--hf_repo",
        "me/run",
        "--hub_keep_full",
        "0",
        "--keep_last",
        "1",
        "--wandb_mode",
        "offline",
        "--output_dir",
        str(out),
    ]


def by_step(path: Path) -> dict[int, tuple[float, str]]:
    return {r["step"]: (r["loss"], r["slice"]) for r in read_jsonl(path)}


def test_the_same_command_on_fresh_machines_walks_the_chain_and_equals_it_typed_by_hand(tmp_path):
    # The chain typed by hand, on one machine without the Hub: the reference for names and losses.
    ref = tmp_path / "ref"
    ref.mkdir()
    ref_saved = []
    for i, start in enumerate(range(0, 4 * RANGE, RANGE)):
        resume = ["--resume_file", "latest"] if i else []
        proc = run_cli(
            ARGS
            + [
                "--start_idx",
                str(start),
                "--end_idx",
                str(start + RANGE),
                "--wandb_mode",
                "disabled",
                "--output_dir",
                str(ref / "out"),
                *resume,
            ],
            ref,
            nproc=2,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ref_saved += saved_names(proc.stdout)
    want = by_step(ref / "out" / "metrics.jsonl")

    with HubServer(token=HF_TOK) as server:
        runs = []

        def session(i: int) -> subprocess.CompletedProcess:
            machine = tmp_path / f"m{i}"  # a fresh machine: empty folders, an empty Hugging Face cache
            machine.mkdir()
            proc = run_cli(auto_args(machine / "out"), machine, nproc=2, env=hub_env(tmp_path, server, f"m{i}"))
            runs.append(proc)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            return proc

        s1, s2 = session(1), session(2)
        assert f"chain: no checkpoint yet: the chain starts with rows [0, {R1}) (pass 1 of 1)" in s1.stdout
        assert f"ends its range: going on with rows [{R1}, {R2}) (pass 1 of 1)" in s2.stdout
        assert (
            f"ranges done 1; range now [{R1}, {R2}) of 754 rows, pass 1 of 1, 0% trained; rows left {754 - R1}"
            in s2.stdout
        )

        # Session 3 is stopped by SIGTERM inside its range [R2, R3).
        m3 = tmp_path / "m3"
        m3.mkdir()
        before = sum(1 for _, s in want.values() if s in (f"0-{R1}", f"{R1}-{R2}"))
        proc = subprocess.Popen(
            torchrun_cmd(2) + auto_args(m3 / "out"),
            cwd=m3,
            env=hub_env(tmp_path, server, "m3"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        metrics = m3 / "out" / "metrics.jsonl"
        deadline = time.time() + 240
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= before + 4):
            time.sleep(0.05)
        # The workers are held still while the signal is sent, so the range (about 13 steps) cannot end before it
        # lands, however loaded the machine: SIGTERM to torchrun, which forwards it to the workers; they take it as
        # they go on, save and exit.
        workers = [
            int(p)
            for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        ]
        assert len(workers) == 2, workers
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # torchrun's agent has forwarded it by now
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
        out3, err3 = proc.communicate(timeout=240)
        runs.append(subprocess.CompletedProcess(proc.args, proc.returncode, out3, err3))
        assert "stopping: received SIGTERM" in out3, out3 + err3
        stop_name = saved_names(out3)[-1]
        assert stop_name.startswith(f"tiny_opt_{R2}-{R3}-epoch-1-step-"), stop_name
        lines = out3.splitlines()
        assert f"--start_idx auto --range_size {RANGE}" in lines[lines.index("resume with:") + 1]  # the same command
        assert "--resume_file" not in lines[lines.index("resume with:") + 1]

        # Session 4 finishes that range exactly where it stopped, then stops; session 5 moves on.
        s4 = session(4)
        assert (
            f"the newest checkpoint, {stop_name}" in s4.stdout and f"finishing it with rows [{R2}, {R3})" in s4.stdout
        )
        assert saved_names(s4.stdout)[-1] == f"tiny_opt_{R2}-{R3}-epoch-1.pt"
        assert f"the next session goes on with [{R3}, {R4})" in s4.stdout
        s5 = session(5)
        assert (
            f"going on with rows [{R3}, {R4})" in s5.stdout
            and saved_names(s5.stdout)[-1] == f"tiny_opt_{R3}-{R4}-epoch-1.pt"
        )

        repo = server.repos["me/run"]
        index = json.loads(repo.files["fsdp_opt_index.json"])
        card = repo.files["README.md"].decode()
        repo_files = dict(repo.files)

    # Losses: the chain with its cut equals the chain typed by hand, bit for bit (CPU, fp32). The last machine's
    # metrics.jsonl continues the Hub's copy, so it holds every step of every session.
    got = by_step(tmp_path / "m5" / "out" / "metrics.jsonl")
    assert got == want
    assert sorted({s for _, s in got.values()}) == sorted([f"0-{R1}", f"{R1}-{R2}", f"{R2}-{R3}", f"{R3}-{R4}"])
    # Names: what the sessions saved is what the hand-typed chain saved, plus the save of the SIGTERM.
    auto_saved = [n for r in runs for n in saved_names(r.stdout)]
    assert [n for n in auto_saved if n != stop_name] == ref_saved
    # Hub files: every one of those checkpoints is in the repo (--hub_keep_full 0 keeps them all).
    assert set(index["checkpoints"]) == set(auto_saved)
    assert {f"checkpoints/{n}" for n in auto_saved} <= set(repo_files)
    # One W&B run across the five machines.
    run_ids = {
        torch.load(tmp_path / f"m{i}" / "out" / name, weights_only=True)["wandb_run_id"]
        for i, name in ((1, f"tiny_opt_0-{R1}-epoch-1.pt"), (5, f"tiny_opt_{R3}-{R4}-epoch-1.pt"))
    }
    assert len(run_ids) == 1 and None not in run_ids

    # The card: where the chain stands as of the newest checkpoint, and the one command to run next.
    last = index["checkpoints"][f"tiny_opt_{R3}-{R4}-epoch-1.pt"]
    assert last[CHAIN_KEY]["ranges_done"] == 4 and last[CHAIN_KEY]["position"] == R4
    assert "## Where the chain stands" in card
    assert f"- **ranges done**: 4, the last [{R3}, {R4}) in pass 1 of 1" in card
    assert f"- **range now**: [{R4}, {R4 + RANGE}) next, pass 1 of 1" in card
    assert f"- **rows left**: {754 - R4:,}" in card
    assert "rows/h measured" in card
    assert f"--start_idx auto --range_size {RANGE} --num_epochs 1 --hf_repo me/run" in card
    for secret in (HF_TOK, WB_KEY):
        assert all(secret not in r.stdout + r.stderr for r in runs)
        assert all(secret.encode() not in content for content in repo_files.values())


def _rows(path: Path, n: int) -> Path:
    path.write_text(
        "\n".join(json.dumps({"text": f"row {i}: " + "some words of text " * (2 + i % 4)}) for i in range(n))
    )
    return path


LOCAL = [
    "--model",
    "tiny-opt",
    "--max_length",
    "32",
    "--batch_size",
    "2",
    "--lr",
    "3e-3",
    "--precision",
    "fp32",
    "--wandb_mode",
    "disabled",
]


def test_end_of_data_and_of_passes_and_several_ranges_in_one_session(tmp_path):
    """10 rows, ranges of 4, 2 passes: [0,4) [4,8) [8,10) then again, each a separate session; then `done` trains
    nothing and writes nothing. The same chain typed by hand, and in one session (--session_ranges 0), log the
    same losses and save the same names."""
    data = _rows(tmp_path / "rows.jsonl", 10)
    auto = LOCAL + ["--dataset", str(data), "--start_idx", "auto", "--range_size", "4", "--num_epochs", "2"]
    expected = [("0-4", 1), ("4-8", 1), ("8-10", 1), ("0-4", 2), ("4-8", 2), ("8-10", 2)]
    separate = []
    for rows, epoch in expected:
        proc = run_cli(auto + ["--output_dir", "sep"], tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert saved_names(proc.stdout) == [f"tiny_opt_{rows}-epoch-{epoch}.pt"], proc.stdout
        separate.append(proc)
    assert "(pass 2 of 2)" in separate[3].stdout and "going on with rows [0, 4)" in separate[3].stdout
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "sep").iterdir()}
    started = time.perf_counter()
    done = run_cli(auto + ["--output_dir", "sep"], tmp_path)
    assert done.returncode == 0 and time.perf_counter() - started < 15, done.stderr
    assert done.stdout.strip().splitlines() == [
        f"chain: done: 2 pass(es) over the 10 rows of {data} in ranges of 4; the newest checkpoint, "
        "tiny_opt_8-10-epoch-2.pt (global step 10), ends the last range. Nothing to train."
    ]
    # nothing trained twice, nothing written (no lease taken)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "sep").iterdir()} == before

    # By hand: the same six ranges with explicit flags.
    by_hand = []
    for i, (rows, epoch) in enumerate(expected):
        start, end = rows.split("-")
        resume = ["--resume_file", "latest"] if i else []
        proc = run_cli(
            LOCAL
            + [
                "--dataset",
                str(data),
                "--start_idx",
                start,
                "--end_idx",
                end,
                "--initial_epoch",
                str(epoch - 1),
                "--output_dir",
                "hand",
                *resume,
            ],
            tmp_path,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        by_hand += saved_names(proc.stdout)
    # One session trains all six (no --time_limit, no range limit), with the names and losses of separate sessions.
    one = run_cli(auto + ["--session_ranges", "0", "--output_dir", "one"], tmp_path)
    assert one.returncode == 0, one.stdout + one.stderr
    assert one.stdout.count("next range in this session") == 5 and "chain: done: every pass" in one.stdout
    assert [n for p in separate for n in saved_names(p.stdout)] == by_hand == saved_names(one.stdout)
    want = read_jsonl(tmp_path / "hand" / "metrics.jsonl")
    for folder in ("sep", "one"):
        got = read_jsonl(tmp_path / folder / "metrics.jsonl")
        assert [(r["step"], r["loss"], r["slice"]) for r in got] == [(r["step"], r["loss"], r["slice"]) for r in want]


def test_a_further_range_starts_only_when_the_time_limit_holds_it(tmp_path):
    """Range 1 is 4 short rows (2 steps); range 2 is 4 rows of 10,000 words (thousands of steps of 32 tokens). With 20 s
    of --time_limit, range 1 runs (its save estimate plus the 10 s margin fit) and range 2 cannot fit (minutes of steps
    at any plausible step time); with 10 minutes and short rows, the next range starts."""
    long_rows = tmp_path / "long.jsonl"
    rows = [f"short row {i}" for i in range(4)] + [" ".join(f"word{j}" for j in range(10_000)) for _ in range(4)]
    long_rows.write_text("\n".join(json.dumps({"text": t}) for t in rows))
    base = LOCAL + ["--start_idx", "auto", "--range_size", "4", "--session_ranges", "0"]
    short = run_cli(base + ["--dataset", str(long_rows), "--time_limit", "20s", "--output_dir", "a"], tmp_path)
    assert short.returncode == 0, short.stdout + short.stderr
    assert saved_names(short.stdout) == ["tiny_opt_0-4-epoch-1.pt"]
    assert "chain: the next range, [4, 8) (" in short.stdout and "does not fit in the" in short.stdout
    roomy = run_cli(
        base + ["--dataset", str(_rows(tmp_path / "rows.jsonl", 8)), "--time_limit", "10m", "--output_dir", "b"],
        tmp_path,
    )
    assert roomy.returncode == 0, roomy.stdout + roomy.stderr
    assert saved_names(roomy.stdout) == ["tiny_opt_0-4-epoch-1.pt", "tiny_opt_4-8-epoch-1.pt"]


def test_the_last_range_trains_without_held_out_rows_after_it(tmp_path):
    """--eval_rows evaluates the rows after a range; the last range of an auto chain has none: it says so and trains
    (a range typed by hand at the end of the data is refused instead, see test_eval)."""
    base = LOCAL + [
        "--dataset",
        str(_rows(tmp_path / "rows.jsonl", 6)),
        "--start_idx",
        "auto",
        "--range_size",
        "4",
        "--eval_rows",
        "2",
        "--output_dir",
        "o",
    ]
    first = run_cli(base, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "on rows [4, 6)" in first.stdout and "eval at step" in first.stdout
    last = run_cli(base, tmp_path)
    assert last.returncode == 0, last.stdout + last.stderr
    assert "note: no rows after [4, 6), the end of the data, to evaluate on" in last.stdout
    assert "eval at step" not in last.stdout and saved_names(last.stdout) == ["tiny_opt_4-6-epoch-1.pt"]
