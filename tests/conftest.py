"""Shared helpers: run the real CLI (torchrun or plain python) in a sandboxed environment."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

import pytest
from hubserver import HubServer
from launcher import Zygote

from fsdp_opt import demo

# The loopback Hub (tests/hubserver.py) speaks LFS, not Xet: set before anything imports huggingface_hub.
os.environ["HF_HUB_DISABLE_XET"] = "1"

ROOT = Path(__file__).resolve().parents[1]
ENTRY = ROOT / "fsdp_finetune.py"
ASSETS = ROOT / "fsdp_opt" / "assets" / "tiny-opt"
# A port nothing listens on: any Hub request fails at once instead of waiting on a network.
DEAD_ENDPOINT = "http://127.0.0.1:9"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sandbox_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "WANDB_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(
        HF_HOME=str(tmp / "hf_home"),
        HF_ENDPOINT=DEAD_ENDPOINT,
        HF_HUB_DISABLE_TELEMETRY="1",
        WANDB_MODE="disabled",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        # the repo first; an outer PYTHONPATH (scripts/floors.sh: the lowest declared versions) is kept after it
        PYTHONPATH=os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
        HF_HUB_DISABLE_XET="1",
        # the interpreter running the tests first: a command block's `python` is the test environment's
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )
    env.update(extra)
    return env


def torchrun_cmd(
    nproc: int, script: Path | str = ENTRY, nnodes: int = 1, node_rank: int = 0, port: int | None = None
) -> list[str]:
    if nnodes == 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        "--rdzv_id=fsdp-opt-test",
        str(script),
    ]


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def fast_launcher(env: dict[str, str]) -> Zygote | None:
    """This pytest worker's launcher server (tests/launcher.py), or None where it cannot stand in for a fresh process
    (another PYTHONPATH) or FSDP_OPT_REAL_LAUNCH=1 asks for real processes everywhere."""
    global _zygote
    if os.environ.get("FSDP_OPT_REAL_LAUNCH") == "1":
        return None
    with _zygote_lock:  # run_cli_concurrently's threads ask at once
        if _zygote is None:
            _zygote = Zygote(sandbox_env(Path(os.environ.get("TMPDIR", "/tmp"))))
    return _zygote if _zygote.serves(env) else None


_KERNELS: list[str] = []  # FSDP_OPT_REPORT_KERNEL=1: what pytest_sessionfinish found, for the terminal summary


def pytest_sessionfinish(session, exitstatus):  # noqa: ANN001
    if os.environ.get("FSDP_OPT_REPORT_KERNEL") == "1" and not os.environ.get("PYTEST_XDIST_WORKER"):
        # the nested session of tests/test_kernels.py: the CPU kernels this process and the runs it starts (forked
        # from the launcher's server, as its training runs were) dispatch to; asked before the server closes
        import torch

        with tempfile.TemporaryDirectory() as tmp:
            run = launch([str(ROOT / "tests" / "workers" / "cpu_capability.py")], [], Path(tmp))
        _KERNELS.append(f"kernels: session {torch.backends.cpu.get_cpu_capability()}, runs {run.stdout.strip()}")
    if _zygote is not None:
        _zygote.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ANN001
    for line in _KERNELS:
        terminalreporter.write_line(line)


def launch(
    target: list[str],
    args: list[str],
    tmp: Path,
    nproc: int = 0,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    real: bool = False,
    late: dict[int, float] | None = None,
) -> subprocess.CompletedProcess:
    """`target` ([script] or ["-m", module]) with `args`, as `python ...` (nproc 0) or `torchrun --standalone
    --nproc_per_node=nproc ...` would run it: forked from the launcher's server unless `real` (the real python or
    torchrun: for tests of the entry points and of torchrun's own behaviour)."""
    env = env or sandbox_env(tmp)
    zygote = None if real else fast_launcher(env)
    if zygote is not None:
        return zygote.run(target, args, tmp, env, nproc, timeout, late)
    assert not late, "only the launcher's server starts a rank late"
    cmd = [sys.executable, *target] if nproc == 0 else torchrun_cmd(nproc, target[0]) + target[1:]
    return subprocess.run(cmd + args, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)


def plan_cli(args: list[str], cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m fsdp_opt.plan ARGS` (forked by the launcher's server)."""
    return launch(["-m", "fsdp_opt.plan"], list(args), cwd, timeout=timeout)


def run_cli(
    args: list[str],
    tmp: Path,
    nproc: int = 0,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    real: bool = False,
) -> subprocess.CompletedProcess:
    """The training command: nproc=0 as `python fsdp_finetune.py`, otherwise under torchrun with nproc workers
    (forked by the launcher's server unless `real`)."""
    return launch([str(ENTRY)], args, tmp, nproc, timeout, env, real)


def run_cli_concurrently(
    runs: list[tuple[list[str], Path, dict[str, str] | None]],
    timeout: float = 300,
    nproc: int = 0,
    workers: int | None = None,
) -> list[subprocess.CompletedProcess]:
    """CLI runs (args, cwd, env) side by side, as many at once as there are cores (a single-process run keeps one core
    busy; one after another they leave the others idle). Results in the order given."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers or max(1, (os.cpu_count() or 1) // max(1, nproc))) as pool:
        futures = [pool.submit(run_cli, args, cwd, nproc, timeout, env) for args, cwd, env in runs]
        return [f.result() for f in futures]


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder of an expensive module fixture (training runs, a set of CLI runs), built once for the whole session:
    pytest-xdist's workers share the parent of their base temp folders, and the first worker to ask builds it under
    a file lock while the others wait, then reuse it. (Module scope alone builds it once per worker.)"""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / f"shared-{name}"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not (folder / ".done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            (folder / ".done").touch()
    return folder


def build_wheel(dest: Path) -> Path:
    """`pip wheel` of the checkout into dest: the package as a Kaggle notebook installs it."""
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dest), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = dest.glob("fsdp_opt-*.whl")
    return wheel


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built once for the session (whichever worker asks first)."""
    (built,) = built_once(tmp_path_factory, "wheel", build_wheel).glob("fsdp_opt-*.whl")
    return built


def build_wheel_venv(dest: Path, wheel: Path) -> None:
    """A fresh virtualenv in dest/venv with the wheel installed in it; the libraries come from the test environment's
    site-packages, named as a path (so its editable install of the checkout is not read)."""
    venv = dest / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "libraries.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run(
        [str(python), "-c", "import fsdp_opt; print(fsdp_opt.__file__)"],
        cwd=dest,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert where.startswith(str(site)), where  # the wheel's copy, not the checkout


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory, request) -> Path:
    """The virtualenv's folder (python in bin/), built once for the session (or the one FSDP_OPT_WHEEL_VENV names: the
    enclosing suite's, for the session of tests/test_kernels.py)."""
    given = os.environ.get("FSDP_OPT_WHEEL_VENV")
    if given and (Path(given) / "bin" / "python").exists():
        return Path(given)
    wheel = request.getfixturevalue("wheel")
    folder = built_once(tmp_path_factory, "wheel-venv", lambda dest: build_wheel_venv(dest, wheel))
    return folder / "venv"


def run_demo(venv: Path, flags: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python -m fsdp_opt.demo FLAGS` as a user of the installed package runs it: the wheel's virtualenv, a folder
    of the user's own (the demo's outputs land in cwd/outputs/), nothing of the checkout on the path.

    With FSDP_OPT_DEMO_FORKED=1 (the session of tests/test_kernels.py, after the suite's own run of each demo from the
    wheel): the demo's code in this process and its commands forked from the launcher's server (run_demo_forked)."""
    if os.environ.get("FSDP_OPT_DEMO_FORKED") == "1":
        return run_demo_forked(flags, cwd, timeout)
    env = sandbox_env(cwd)
    env.pop("PYTHONPATH")
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    return subprocess.run(
        [str(venv / "bin" / "python"), "-m", "fsdp_opt.demo", *flags],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_demo_forked(flags: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """The demo as run_demo runs it, with each command it starts (the training under torchrun, the evaluation, the
    export) forked from the launcher's server instead of started fresh: the same steps, without the imports of about
    a dozen fresh processes. For a session whose question is what the demos learn under another CPU kernel (the
    server, started in that session, runs under its kernel); whether the installed package launches its own commands
    is the suite's run of the demo from the wheel."""
    out, err = io.StringIO(), io.StringIO()
    env = sandbox_env(cwd)

    def call(cmd: list[str]) -> int:
        print("$ python " + " ".join(cmd[1:]), flush=True)
        if cmd[1:3] == ["-m", "torch.distributed.run"]:  # python -m torch.distributed.run ... -m MODULE ARGS
            at = cmd.index("-m", 3)
            nproc = int(next(a for a in cmd[3:at] if a.startswith("--nproc_per_node=")).partition("=")[2])
            target, args = cmd[at : at + 2], cmd[at + 2 :]
        else:  # python -m MODULE ARGS
            nproc, target, args = 0, cmd[1:3], cmd[3:]
        proc = launch(target, args, cwd, nproc, timeout, env)
        out.write(proc.stdout)
        err.write(proc.stderr)
        return proc.returncode

    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(demo, "echo_and_call", call)
        patch.chdir(cwd)
        code = demo.main(list(flags))
    return subprocess.CompletedProcess(["fsdp_opt.demo", *flags], code, out.getvalue(), err.getvalue())


def row_pieces(tokenizer, texts, max_length: int) -> list[list[int]]:
    """What --packing docs trains on, made here without the packing code: each row's tokens with EOS appended,
    cut into pieces of at most max_length."""
    rows = [ids + [tokenizer.eos_token_id] for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    return [r[i : i + max_length] for r in rows for i in range(0, len(r), max_length)]


def loss_alone(model, pieces: list[list[int]]) -> tuple[float, int]:
    """(summed next-token loss, target count) of each piece run through `model` by itself: no padding, no mask."""
    import torch

    total, tokens = 0.0, 0
    with torch.no_grad():
        for piece in pieces:
            if len(piece) > 1:
                ids = torch.tensor([piece])
                total += model(input_ids=ids, labels=ids).loss.item() * (len(piece) - 1)
                tokens += len(piece) - 1
    return total, tokens


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_local_model(dest: Path, seed: int = 0, **overrides) -> Path:
    """A local OPT model folder (config, safetensors weights, tokenizer) from the tiny-opt config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ASSETS)
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / name, dest / name)
    return dest


@pytest.fixture(scope="session")
def det_model(tmp_path_factory) -> Path:
    """tiny-opt shape with dropout off: runs on different rank counts are comparable number for number."""
    return make_local_model(tmp_path_factory.mktemp("det_model") / "tiny-det", dropout=0.0)


def as_flags(**values: object) -> list[str]:
    """Flags from keywords, in their order: as_flags(method="rloo", batch_size=8) is ["--method", "rloo",
    "--batch_size", "8"]."""
    return [item for name, value in values.items() for item in (f"--{name}", str(value))]


def assert_same_step(ours: dict, loss: float, grads: dict, tol: float = 1e-5, floor: float = 1e-4) -> None:
    """One step of ours (a worker's report: its loss and each weight's gradient) against the reference library's on
    the same inputs: the loss and every gradient within `tol`, the same weights trained, and gradients that are not
    all zero (the largest above `floor`)."""
    import torch

    assert abs(ours["loss"] - loss) <= tol, (ours["loss"], loss)
    assert set(ours["grads"]) == set(grads)
    diffs = {n: (torch.tensor(ours["grads"][n]) - g).abs().max().item() for n, g in grads.items()}
    assert max(diffs.values()) <= tol, sorted(diffs.items(), key=lambda kv: -kv[1])[:4]
    assert max(g.abs().max().item() for g in grads.values()) > floor  # the gradients are not all zero


def assert_clean_failure(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Non-zero exit, the project's one error line naming the problem, and no Python traceback from a worker. Under
    torchrun the line comes once more, after torchrun's report: the last line (runtime/exits.after_the_launcher)."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
    if "torch.distributed.run" in " ".join(proc.args):
        assert len(lines) == 2 and lines[0] == lines[1] == proc.stderr.strip().splitlines()[-1], proc.stderr
        lines = lines[:1]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    worker_traceback = [l for l in proc.stderr.splitlines() if l.startswith(("Traceback", "[rank"))]
    if "torch.distributed.run" not in " ".join(proc.args):
        assert not worker_traceback, proc.stderr
    else:
        # torchrun prints its own ChildFailedError report; the workers must not print tracebacks.
        assert not [l for l in worker_traceback if l.startswith("[rank")], proc.stderr
    return lines[0]


# The longest tests (minutes each on 2 cores) start first, so parallel workers (pytest-xdist, scripts/test.sh) do
# not end with one of them running alone.
LONGEST_FIRST = (
    "test_kernels.py::test_the_learned_behaviour_holds_under_the_default_kernel[long]",
    "test_kernels.py::test_the_learned_behaviour_holds_under_the_default_kernel[gate]",
    "test_chat_data.py::test_the_chat_demo_answers_in_the_template_and_the_grpo_demo_learns_its_reward",
    "test_notebooks.py::test_notebooks_run_end_to_end",
    "test_docs.py::test_every_command_block_of_the_readme_and_docs_runs_or_says_why_not",
    "test_auto_chain.py::test_the_same_command_on_fresh_machines_walks_the_chain_and_equals_it_typed_by_hand",
    "test_fp16_reduce.py::test_fp16_reduce_tracks_the_fp32_reduce_over_thirty_steps",
    "test_retention.py::test_chain_of_four_slices_keeps_the_policy",
    "test_dpo.py::test_the_dpo_demo_learns_the_held_out_preferences",
    "test_cli.py::test_demo_trains_and_loss_falls",
    "test_fp16_reduce.py::test_overflows_are_skipped_and_halve_the_scale_not_applied",
    "test_benchmark.py::test_throughput_report_runs_the_trainer_under_fsdp2",
    "test_benchmark.py::test_memory_only_report",
    "test_fp16_width.py::test_the_trainer_in_fp16_at_real_width_probes_then_trains_without_overflow[google/gemma-2-2b]",
    "test_disk_room.py::test_saves_every_few_steps_run_to_the_end_on_a_disk_for_two_checkpoints",
    "test_benchmark.py::test_data_benchmark_reports_a_range_against_the_whole_split",
    "test_lora.py::test_lora_checkpoint_is_small_resumes_exactly_after_sigkill_and_merges",
    "test_benchmark.py::test_session_benchmark_reports_every_stage_against_its_floor",
    "test_hub.py::test_sessions_chain_through_the_hub",
    "test_auto_chain.py::test_end_of_data_and_of_passes_and_several_ranges_in_one_session",
    "test_evaluate.py::test_base_vs_checkpoints_match_reference",
    "test_lmeval.py::test_two_chained_sessions_score_each_save_in_wandb_eval_jsonl_and_the_card_as_evaluate_does",
    "test_simulate.py::test_fake_step_measures_what_a_real_step_holds_and_the_plan_agrees",
)


# The quick tier (`bash scripts/test.sh --quick`, `pytest -m quick`): the unit tests (whole files), and one end-to-end
# run per concern. Matched against each test's id: a file, or file::test (every parameter of it).
QUICK = (
    # units: flags, layout, data, drift, chain, planner, model families, CUDA paths (no GPU), the docs' pages, the
    # warning before a run that does not fit, gpu_check's choice of a run that fits, the benchmark's launches
    "tests/test_units.py",
    "tests/test_layout.py",
    "tests/data/test_data.py",
    "tests/data/test_formats.py",
    "tests/data/test_sources.py",
    "tests/checkpoint/test_drift.py",
    "tests/checkpoint/test_chain.py",
    "tests/planner/test_plan.py",
    "tests/planner/test_catalog.py",
    "tests/model/test_families.py",
    "tests/runtime/test_cuda_paths.py",
    "tests/runtime/test_torchao_gate.py::test_install_line",
    "tests/commands/test_docs.py::test_the_flags_page",
    "tests/commands/test_docs.py::test_the_docs_check_fails",
    "tests/commands/test_docs.py::test_the_version_is_one_number",
    "tests/planner/test_steptime.py::test_the_trainer_warns_before_the_first_step",
    "tests/commands/test_gpu_check.py::test_on_one_t4_sized_gpu",
    "tests/commands/test_benchmark.py::test_one_launch",
    # mixtures: the definition, the file, each source's format and held-out rows (no run)
    "tests/data/test_mixture.py::test_the_worked_table",
    "tests/data/test_mixture.py::test_counts_are",
    "tests/data/test_mixture.py::test_integer_weights",
    "tests/data/test_mixture.py::test_the_length",
    "tests/data/test_mixture.py::test_a_range_reads",
    "tests/data/test_mixture.py::test_the_file_in_trls",
    "tests/data/test_mixture.py::test_a_bad_mixture_file",
    "tests/data/test_mixture_formats.py::test_three_formats",
    "tests/data/test_mixture_formats.py::test_the_held_out_rows",
    # one run each: the engine against a plain loop, sharded state, a resume, the Hub chain, W&B, Hub datasets by
    # range, a mixture of three formats, LoRA against peft, DPO against the pairs alone, chat targets, evaluate, the
    # planner's collectives, bad input and the error line under torchrun's rule
    "tests/engine/test_training_math.py::test_sharded_run_matches_unsharded_reference[2-2-2-FULL_SHARD-extra0]",
    "tests/engine/test_training_math.py::test_the_optimizer_steps_the_shards",
    "tests/checkpoint/test_sharded_state.py",
    "tests/checkpoint/test_resume.py::test_one_epoch_plus_resume_equals_two_epochs[sharded]",
    "tests/hub/test_hub.py::test_sessions_chain_through_the_hub",
    "tests/hub/test_hub.py::test_wandb_without_network",
    "tests/data/test_hub_ranges.py::test_rows_read_by_range",
    "tests/data/test_mixture_formats.py::test_a_run_on_three",
    "tests/model/test_lora.py::test_two_rank_lora_matches_one_process_peft[FULL_SHARD",
    "tests/train/test_dpo.py::test_the_first_step_is_the_dpo_loss_of_the_pairs_alone_full_and_lora[strings]",
    "tests/train/test_chat_data.py::test_first_step_loss_is_the_mean_over_exactly_the_answer_tokens",
    "tests/train/test_evaluate.py::test_evaluate_bad_input",
    "tests/engine/test_lmeval.py::test_two_ranks_score_what_lm_evals_hflm_scores_on_the_exported_folder",
    "tests/planner/test_steptime.py::test_collective_bytes",
    "tests/commands/test_cli.py::test_bad_input_fails_fast",
    "tests/commands/test_cli.py::test_the_error_line",
)


# The long tier (`bash scripts/test.sh --all`, marker `long`): the runs of minutes and the second and third run of a
# concern the gate already runs once. `bash scripts/test.sh` (CI, the README's test command) leaves them out, so it
# fits its budget on a 2-core machine; run `--all` before a change lands (CONTRIBUTING.md). Matched as QUICK is.
LONG = (
    # the chat, GRPO and DPO demos (the gate runs the Quick start's), the notebooks and every command block of the docs
    "tests/train/test_chat_data.py::test_the_chat_demo_answers_in_the_template_and_the_grpo_demo_learns_its_reward",
    "tests/train/test_dpo.py::test_the_dpo_demo_learns_the_held_out_preferences",
    "tests/commands/test_notebooks.py",
    "tests/commands/test_docs.py::test_every_command_block",
    "tests/test_kernels.py::test_the_learned_behaviour_holds_under_the_default_kernel[long]",
    # the GPU check's whole run, the benchmarks' reports, the planner's simulations and calibration, host RAM
    "tests/commands/test_gpu_check.py::test_gpu_check_trains_saves_resumes_and_reports",
    "tests/commands/test_benchmark.py::test_session_benchmark",
    "tests/commands/test_benchmark.py::test_throughput_report",
    "tests/commands/test_benchmark.py::test_data_benchmark",
    "tests/commands/test_benchmark.py::test_allocator_benchmark",
    "tests/commands/test_benchmark.py::test_generation_benchmark",
    "tests/commands/test_benchmark.py::test_memory_only_report",
    "tests/commands/test_benchmark.py::test_head_loss_benchmark",
    "tests/commands/test_benchmark.py::test_decode_step_benchmark",
    "tests/planner/test_simulate.py",
    "tests/planner/test_search.py::test_plan_calibrate",
    "tests/planner/test_host_memory.py",
    "tests/engine/test_lmeval.py::test_the_benchmark_sets_requests_per_second",
    # faults, signals, leases, full disks and limits beyond the first of each kind
    "tests/hub/test_faults.py::test_three_faults_of_each_passing_kind",
    "tests/hub/test_faults.py::test_a_training_run_pushes_through_faults_at_every_call",
    "tests/hub/test_hub.py::test_exit_wait_is_bounded",
    "tests/hub/test_lease.py::test_a_killed_session_leaves_its_lease",
    "tests/hub/test_lease.py::test_two_identical_auto_chain_commands",
    "tests/hub/test_lease.py::test_two_sessions_in_the_same_instant",
    "tests/checkpoint/test_checkpoint_safety.py::test_full_disk_stops_cleanly",
    "tests/checkpoint/test_disk_room.py",
    "tests/checkpoint/test_resume.py::test_time_limit_saves_before_the_budget",
    "tests/checkpoint/test_resume.py::test_sigkill_after_mid_epoch_checkpoint",
    "tests/checkpoint/test_resume.py::test_sigterm_saves_and_exits_cleanly",
    "tests/commands/test_launch.py::test_a_user_error_is_the_last_line_on_the_screen",
    "tests/commands/test_launch.py::test_a_clean_run_and_a_stopped_ones_resume_command",
    "tests/commands/test_cli.py::test_unreachable_hub_ids",
    "tests/runtime/test_torchao_gate.py::test_an_unsuitable_torchao",
    # chains of three or four sessions through the Hub, per method and row format, beside the gate's one of each
    "tests/train/test_auto_chain.py",
    "tests/hub/test_retention.py::test_chain_of_four_slices_keeps_the_policy",
    "tests/hub/test_hub.py::test_sharded_checkpoints_through_the_hub",
    "tests/hub/test_model_repo.py::test_a_lora_chain_pushed_as_a_model_repo",
    "tests/model/test_lora.py::test_lora_chain_of_three_slices_through_the_hub",
    "tests/model/test_lora.py::test_lora_checkpoint_is_small_resumes_exactly_after_sigkill",
    "tests/train/test_dpo.py::test_three_auto_sessions_through_the_hub",
    "tests/train/test_grpo.py::test_three_auto_sessions_through_the_hub",
    "tests/train/test_kto.py::test_lora_kto_through_the_hub",
    "tests/train/test_distill.py::test_lora_distillation_through_the_hub",
    "tests/train/test_distill.py::test_a_session_resumed_mid_range",
    "tests/train/test_chat_data.py::test_a_chain_over_conversations",
    "tests/data/test_mixture.py::test_a_range_far_into_a_mixture",
    "tests/data/test_hub_ranges.py::test_runs_train_where_datasets_cannot_fingerprint",
    "tests/data/test_hub_ranges.py::test_three_fresh_sessions_of_an_auto_chain",
    "tests/engine/test_lmeval.py::test_two_chained_sessions_score_each_save",
    "tests/train/test_dpo.py::test_a_resumed_session_is_scored_against_the_model",
    "tests/data/test_mixture_formats.py::test_a_dpo_mixture_of_explicit_and_implicit_pairs",
    "tests/train/test_data_pin.py::test_a_mixtures_hub_source_is_read_at_the_revision",
    "tests/data/test_hub_ranges.py::test_a_short_range_far_into_the_split",
    # fp16 at real width and over thirty steps, 4-bit bases against peft and TRL, HYBRID_SHARD across two nodes, NO_SHARD
    # compiled
    "tests/engine/test_fp16_reduce.py",
    "tests/model/test_fp16_width.py::test_the_trainer_in_fp16_at_real_width",
    "tests/commands/test_cli.py::test_fp16_with_loss_scaling",
    "tests/model/test_lora.py::test_4bit_base_matches_peft",
    "tests/engine/test_training_math.py::test_hybrid_shard_across_two_nodes",
    "tests/engine/test_training_math.py::test_sharded_run_matches_unsharded_reference[2-1-4-NO_SHARD",  # compiled
    "tests/train/test_distill.py::test_a_4bit_teacher",
    # the families alike in what they test (Mistral runs as Llama, Gemma 3 as Gemma 2), fp16 at real width, the DPO
    # first step's conversational rows, the batch search's run
    "tests/train/test_model_families.py::test_trains_learns_and_resumes_exactly[gemma3_text]",
    "tests/train/test_model_families.py::test_trains_learns_and_resumes_exactly[mistral]",
    "tests/train/test_model_families.py::test_first_step_is_the_rows_alone_bos_included_and_lora_trains[gemma3_text]",
    "tests/train/test_model_families.py::test_first_step_is_the_rows_alone_bos_included_and_lora_trains[mistral]",
    "tests/model/test_fp16_width.py::test_fp16_stays_finite",
    "tests/train/test_dpo.py::test_the_first_step_is_the_dpo_loss_of_the_pairs_alone_full_and_lora[conversational]",
    "tests/train/test_batch_auto.py",
    # scores and exports beyond the gate's first of each: arc_easy from the Hub, LoRA's, bad tasks, a 7b-shaped GGUF
    "tests/engine/test_lmeval.py::test_arc_easy_from_the_loopback_hub",
    "tests/engine/test_lmeval.py::test_a_lora_checkpoint_scores_as_hflm",
    "tests/engine/test_lmeval.py::test_unknown_unreadable_and_unsafe_tasks",
    "tests/train/test_evaluate.py::test_base_vs_checkpoints_match_reference",
    "tests/checkpoint/test_gguf.py::test_a_7b_shaped_export",
)


# What a training run learned (a loss drop, an accuracy, a format, an answer): these must hold under any CPU kernel.
# The suite runs them a second time under ATEN_CPU_CAPABILITY=default (tests/test_kernels.py: `pytest -m learns` in a
# session of its own); docs/testing.md has each margin.
LEARNS = (
    "tests/commands/test_cli.py::test_demo_trains_and_loss_falls",
    "tests/train/test_chat_data.py::test_the_chat_demo_answers_in_the_template_and_the_grpo_demo_learns_its_reward",
    "tests/train/test_dpo.py::test_the_dpo_demo_learns_the_held_out_preferences",
    "tests/commands/test_cli.py::test_fp16_with_loss_scaling_trains_and_counts_skipped_steps",
    "tests/engine/test_fp16_reduce.py::test_fp16_reduce_tracks_the_fp32_reduce_over_thirty_steps",
    "tests/engine/test_fp16_reduce.py::test_overflows_are_skipped_and_halve_the_scale_not_applied",
    "tests/train/test_model_families.py::test_trains_learns_and_resumes_exactly",
    "tests/train/test_model_families.py::test_first_step_is_the_rows_alone_bos_included_and_lora_trains",
    "tests/train/test_evaluate.py::test_base_vs_checkpoints_match_reference",
    "tests/train/test_evaluate.py::test_lora_checkpoint",
    "tests/train/test_chat_data.py::test_lora_and_a_4bit_base_train_on_the_answers",
)


# The `learns` tests whose second run, under the default kernel (tests/test_kernels.py), belongs to the long tier
# (marker kernel_long) although their first run is in the gate: those in LONG, and these. The gate's default-kernel
# session keeps the cheap ones, so CI still sees each kind of claim under that kernel.
KERNEL_LONG = (
    "tests/commands/test_cli.py::test_demo_trains_and_loss_falls",
    "tests/train/test_model_families.py::test_trains_learns_and_resumes_exactly",
    "tests/train/test_chat_data.py::test_lora_and_a_4bit_base_train_on_the_answers",
)


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    def rank(item) -> int:  # noqa: ANN001
        for i, suffix in enumerate(LONGEST_FIRST):
            if item.nodeid.endswith(suffix):
                return i
        return len(LONGEST_FIRST)

    for item in items:
        if item.nodeid.startswith(QUICK):
            item.add_marker(pytest.mark.quick)
        if item.nodeid.startswith(LEARNS):
            item.add_marker(pytest.mark.learns)
        if item.nodeid.startswith(LONG):
            item.add_marker(pytest.mark.long)
        if item.nodeid.startswith(LEARNS) and item.nodeid.startswith(LONG + KERNEL_LONG):
            item.add_marker(pytest.mark.kernel_long)
    items.sort(key=rank)  # stable: the rest keep their order


def kill_all_with(marker: str, sig: int) -> None:
    """Signal every process whose command line mentions `marker`."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and int(entry.name) != os.getpid():
                try:
                    os.kill(int(entry.name), sig)
                except ProcessLookupError:
                    pass


def losses_by_step(path: Path) -> dict[int, float]:
    """The last logged loss of each step (a killed run may have logged steps a resume repeats)."""
    return {r["step"]: r["loss"] for r in read_jsonl(path)}


HF_TOK = "hf_fake-token-for-loopback-tests-0123456789"


WB_KEY = "wandbtestkey" + "7" * 28


COMMON = ["--model", "tiny-opt", "--dataset", "python-docs", "--max_length", "64", "--lr", "3e-3", "--num_epochs", "1"]


def hub_env(tmp: Path, server: HubServer, name: str) -> dict[str, str]:
    env = sandbox_env(
        tmp,
        HF_ENDPOINT=server.url,
        HF_TOKEN=HF_TOK,
        WANDB_API_KEY=WB_KEY,
        HF_HOME=str(tmp / f"hf_home_{name}"),  # a fresh, empty cache for every session
        HF_HUB_DISABLE_XET="1",  # large files take the LFS path, which the loopback Hub serves
        WANDB_CONFIG_DIR=str(tmp / "wandb_config"),
        WANDB_CACHE_DIR=str(tmp / "wandb_cache"),
        WANDB_DATA_DIR=str(tmp / "wandb_data"),
    )
    # W&B for real, offline: with the key set, `--wandb_mode auto` would start online and wait out its init timeout
    # (60 s) for a server this machine cannot reach, then log offline anyway. That fallback has its own test
    # (tests/hub/test_hub.py::test_wandb_without_network_falls_back, an 8 s timeout).
    env["WANDB_MODE"] = "offline"
    return env


def saved_names(out: str) -> list[str]:
    return [Path(m).name for m in re.findall(r"^saved (\S+) \(", out, flags=re.M)]


def hub_sessions(args: list[str], tmp: Path, repo: str, sessions: int = 3) -> list[subprocess.CompletedProcess]:
    """`sessions` runs of the same 2-rank command through a loopback Hub repo, each on an empty machine (its own
    folder, Hugging Face cache and output_dir, W&B off), one after another; each must succeed."""
    procs = []
    with HubServer() as server:
        for i in range(sessions):
            machine = tmp / f"m{i}"
            machine.mkdir()
            env = hub_env(tmp, server, f"m{i}")
            env["WANDB_MODE"] = "disabled"
            proc = run_cli(args + ["--hf_repo", repo, "--output_dir", str(machine / "out")], machine, nproc=2, env=env)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            procs.append(proc)
    return procs


# A Llama-3-style chat template written for the tests: the template writes the BOS itself, each turn ends with
# <|eot_id|>, and the generation prompt is the assistant's header.
LLAMA_STYLE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The families GGUF is written for, each small, with the settings llama.cpp and transformers' GGUF loader agree on:
# Gemma scales attention by the head size; transformers' loader reads Qwen3 at its default head size (128).
GGUF_FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 128},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16},
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16},
    "phi3": {},
}


def make_chat_llama(dest: Path, seed: int = 0, template: str | None = LLAMA_STYLE_TEMPLATE, **overrides) -> Path:
    """A local Llama-architecture model folder whose tokenizer adds a BOS (as Llama 3's does) and has a chat template:
    random weights, the built-in tokenizer's vocabulary, dropout off."""
    return make_family_model(
        dest, "llama", bos=True, seed=seed, template=template, **{"tie_word_embeddings": True, **overrides}
    )


SPM_STYLES = {
    # Llama 2's and Mistral's: transformers 5 builds LlamaTokenizer with Metaspace, ▁ put before a text's start only
    "llama": ["<unk>", "<s>", "</s>"],
    # Phi-3's tokenizer.json, which transformers 5 keeps for Phi-3: a normalizer puts ▁ before every piece of text
    "phi3": ["<unk>", "<s>", "</s>"],
    # Gemma's: GemmaTokenizer, spaces become ▁ and none is put before the text
    "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"],
}
# The chat tokens each style adds after its pieces. Phi-3's take the whitespace after them (rstrip), as </s> does,
# but <|endoftext|> (its padding); Gemma's take none.
SPM_CHAT_TOKENS = {
    "llama": [],
    "phi3": ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    "gemma": ["<start_of_turn>", "<end_of_turn>"],
}


def make_spm_tokenizer(style: str, bos: bool = True, pieces: int = 1000):
    """A SentencePiece-style tokenizer laid out as the released Llama 2 and Mistral (`llama`), Phi-3 (`phi3`) and
    Gemma (`gemma`) ones are, small and offline: BPE over characters with byte fallback, its control tokens first,
    then the 256 byte tokens <0x00>..<0xFF>, then pieces and merges learned here (the `tokenizers` trainer) from the
    Python docs' paragraphs, split at spaces as SentencePiece splits, then the style's chat tokens. Built through
    transformers' own class for the family (LlamaTokenizer, GemmaTokenizer), which sets the normalizer, pre-tokenizer
    and decoder it runs with; Phi-3's pipeline is its tokenizer.json's."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import GemmaTokenizer, LlamaTokenizer, PreTrainedTokenizerFast

    from fsdp_opt.data.builtins import python_docs_texts

    space = "\u2581"
    learner = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    learner.normalizer = normalizers.Replace(" ", space)
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement=space, prepend_scheme="always", split=True)
    learner.train_from_iterator(python_docs_texts()[:400], trainers.BpeTrainer(vocab_size=pieces, show_progress=False))
    spec = json.loads(learner.to_str())["model"]
    learned = sorted(spec["vocab"], key=spec["vocab"].get)
    vocab = {t: i for i, t in enumerate(SPM_STYLES[style] + [f"<0x{b:02X}>" for b in range(256)] + learned)}
    merges = [tuple(m) for m in spec["merges"]]
    chat = SPM_CHAT_TOKENS[style]
    if style != "phi3":
        family = LlamaTokenizer if style == "llama" else GemmaTokenizer
        tokenizer = family(vocab=vocab, merges=merges, add_bos_token=bos)
        tokenizer.add_special_tokens({"additional_special_tokens": chat})
        return tokenizer
    raw = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend(space), normalizers.Replace(" ", space)])
    raw.decoder = decoders.Sequence(
        [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    if bos:
        raw.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    strip = {t: AddedToken(t, rstrip=t != "<|endoftext|>", special=True, normalized=False) for t in chat + ["</s>"]}
    raw.add_special_tokens(list(strip.values()))
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token=strip["</s>"],
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        additional_special_tokens=chat,
    )


def make_family_model(
    dest: Path,
    model_type: str,
    bos: bool,
    seed: int = 0,
    template: str | None = None,
    tokenizer=None,  # noqa: ANN001 - a transformers tokenizer (make_spm_tokenizer's); None: the built-in vocabulary
    **overrides,
) -> Path:
    """A local model folder of one architecture (transformers' model_type), small, with random weights, and a
    tokenizer of the built-in vocabulary that puts a BOS first (as Llama 3's, Gemma's and Mistral's do) or not (as
    Qwen's), or the tokenizer given: the config, safetensors weights and tokenizer files `from_pretrained` reads."""
    import torch
    from tokenizers import Tokenizer, processors
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    if tokenizer is None:
        raw = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
        steps = [processors.ByteLevel(trim_offsets=False)]
        if bos:
            steps.append(
                processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
            )
        raw.post_processor = processors.Sequence(steps)
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=raw,
            bos_token="<s>" if bos else None,
            eos_token="</s>",
            pad_token="<pad>",
            unk_token="<unk>",
        )
    if template:
        tokenizer.chat_template = template
    settings = dict(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id if bos else None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings)).save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def wandb_records(run_dir: Path) -> list[dict]:
    """The records of an offline W&B run folder, as `wandb leet inspect --json` reads them back."""
    files = sorted(run_dir.glob("run-*.wandb"))
    assert len(files) == 1, list(run_dir.iterdir())
    cli = Path(sys.executable).parent / "wandb"
    # The reader is the test environment's own wandb, not the one under test (scripts/floors.sh puts an older wandb
    # on PYTHONPATH, whose CLI cannot print the records as JSON).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(cli), "leet", "inspect", "--json", str(files[0])], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip().startswith("{")]
