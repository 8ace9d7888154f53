"""What must never go wrong with checkpoints: refusals, atomic writes under kill, a full disk, export."""

from __future__ import annotations

import hashlib
import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ASSETS,
    ROOT,
    assert_clean_failure,
    built_once,
    launch,
    make_local_model,
    run_cli,
    run_cli_concurrently,
    sandbox_env,
    torchrun_cmd,
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from fsdp_opt.checkpoint.atomic import remove_stale_temp
from fsdp_opt.checkpoint.names import MODEL_KEY, checkpoint_name, list_checkpoints
from fsdp_opt.checkpoint.save import STEP_KEY

END = 80
TINY = [
    "--model",
    "tiny-opt",
    "--dataset",
    "python-docs",
    "--end_idx",
    str(END),
    "--max_length",
    "64",
    "--batch_size",
    "2",
    "--lr",
    "2e-3",
]
NAME = checkpoint_name("tiny_opt", 0, END, 1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One epoch of tiny-opt on 2 ranks, saved both ways, with an fp32 export at the end."""

    def build(tmp: Path) -> None:
        for kind in ("full", "sharded"):
            args = TINY + ["--state_dict_type", kind, "--output_dir", str(tmp / kind)]
            if kind == "full":
                args += ["--export_hf", str(tmp / "export"), "--export_dtype", "fp32"]
            proc = run_cli(args, tmp, nproc=2)
            assert proc.returncode == 0, proc.stderr[-3000:]

    return built_once(tmp_path_factory, "trained", build)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ refusals


class _RunsCode:
    """Unpickling this would run code: it must be refused, never executed."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_refusals_name_the_file_and_what_is_wrong(tmp_path, trained):
    full = trained / "full" / NAME
    cases = []
    cases.append(([str(tmp_path / "nope.pt")], ["nope.pt", "not found"]))
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    cases.append(([str(truncated)], ["truncated.pt", "truncated or damaged"]))
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    cases.append(([str(foreign)], ["foreign.pt", "not an fsdp-opt checkpoint"]))
    evil = tmp_path / "evil.pt"
    marker = tmp_path / "code_ran"
    torch.save({"MODEL_STATE": {}, "payload": _RunsCode(str(marker))}, evil)
    cases.append(([str(evil)], ["evil.pt", "need code to load", "never run"]))
    bogus_dir = tmp_path / "not_sharded"
    bogus_dir.mkdir()
    cases.append(([str(bogus_dir)], ["not_sharded", "not a sharded fsdp-opt checkpoint"]))
    # each in its own output folder: runs side by side in one folder would meet the chain's lease
    runs = [
        (TINY + ["--resume_file"] + resume + ["--output_dir", str(tmp_path / f"out{i}")], tmp_path, None)
        for i, (resume, _) in enumerate(cases)
    ]
    for (_, needles), proc in zip(cases, run_cli_concurrently(runs, timeout=120)):
        assert_clean_failure(proc, "--resume_file", *needles)
        assert proc.returncode == 2
    assert not marker.exists(), "a checkpoint's pickled code was executed"
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize(
    "change,needle",
    [
        ({"hidden_size": 64, "word_embed_proj_dim": 64}, "has shape"),
        ({"vocab_size": 4000}, "another model size or vocabulary"),
    ],
)
def test_checkpoint_of_another_shape_is_refused_on_every_rank(tmp_path, trained, kind, change, needle):
    other = make_local_model(tmp_path / "other", **change)
    ckpt = trained / kind / checkpoint_name("tiny_opt", 0, END, 1, sharded=kind == "sharded")
    args = ["--model", str(other)] + TINY[2:] + ["--resume_file", str(ckpt), "--output_dir", str(tmp_path / "out")]
    # --allow_changes lets the other model through the settings check; its shapes are refused all the same
    proc = run_cli(args + ["--allow_changes"], tmp_path, nproc=2, timeout=120)
    assert_clean_failure(proc, "--resume_file", needle)
    assert "settings: --model tiny-opt -> " in proc.stdout


# ------------------------------------------------------------------ atomic writes


ATOMIC_SCRIPT = """
import sys, torch
from pathlib import Path
from fsdp_opt.checkpoint.atomic import atomic_save
path = Path(sys.argv[1])
atomic_save({"MODEL_STATE": {"w": torch.ones(4)}, "GLOBAL_STEP": 1}, path)
print("first", flush=True)
atomic_save({"MODEL_STATE": {"w": torch.randn(64, 1024, 1024)}, "GLOBAL_STEP": 2}, path)  # 256 MiB, killed midway
print("second", flush=True)
"""


def test_kill_during_save_leaves_the_previous_checkpoint_whole(tmp_path):
    path = tmp_path / "ckpt.pt"
    proc = subprocess.Popen(
        [sys.executable, "-c", ATOMIC_SCRIPT, str(path)],
        cwd=tmp_path,
        env=sandbox_env(tmp_path),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "first"
    deadline = time.time() + 60
    while time.time() < deadline:
        temps = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
        if temps and temps[0].stat().st_size > 10 * 2**20:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert temps, "the second save never started"
    old = torch.load(path, weights_only=True)
    assert old["GLOBAL_STEP"] == 1 and torch.equal(old["MODEL_STATE"]["w"], torch.ones(4))
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["ckpt.pt"]
    assert remove_stale_temp(tmp_path) and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("mode", ["in place", "background"])
def test_full_disk_stops_cleanly_and_keeps_the_previous_checkpoint(tmp_path, trained, mode):
    """In place: the epoch-end save fails. Background (--async_save): a mid-epoch write fails while training goes
    on; every rank stops at the next step with the writer's error."""
    out = tmp_path / "out"
    out.mkdir()
    previous = out / NAME
    previous.write_bytes((trained / "full" / NAME).read_bytes())
    before = _sha(previous)
    limit = 8 * 2**20  # a checkpoint is ~18 MiB; metrics lines are tiny

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    args = TINY + ["--num_epochs", "1", "--resume_file", NAME, "--output_dir", str(out)]
    if mode == "background":
        args += ["--async_save", "true", "--save_every_steps", "2"]
    proc = subprocess.run(
        torchrun_cmd(2) + args,
        cwd=tmp_path,
        env=sandbox_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=small_files,
    )
    resumed_at = torch.load(previous, weights_only=True)[STEP_KEY]
    first_save = next(k for k in (resumed_at + 1, resumed_at + 2) if k % 2 == 0)  # --save_every_steps 2
    failing = checkpoint_name("tiny_opt", 0, END, 2, first_save if mode == "background" else None)
    line = assert_clean_failure(proc, "cannot save", str(out / failing), "MiB needed")
    assert "earlier checkpoints are kept" in line
    assert _sha(previous) == before
    assert [p.name for p in list_checkpoints(out)] == [NAME]
    assert not [p for p in out.iterdir() if ".tmp" in p.name]


# ------------------------------------------------------------------ export


def _loss(model, tokenizer) -> float:
    text = "The name is rebound if it was already bound. This may cause the reference count to reach zero."
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return F.cross_entropy(logits[0, :-1], ids[0, 1:]).item()


def _checkpoint_model(path: Path):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ASSETS))
    model.load_state_dict(torch.load(path, weights_only=True)[MODEL_KEY])
    return model.eval()


def test_export_round_trip_gives_the_trained_models_loss(tmp_path, trained):
    tokenizer = AutoTokenizer.from_pretrained(ASSETS)
    want = _loss(_checkpoint_model(trained / "full" / NAME), tokenizer)
    assert want < 7.5  # trained, not the random init (about 8.3)
    # --export_hf at the end of training, fp32.
    exported = AutoModelForCausalLM.from_pretrained(trained / "export").eval()
    assert (trained / "export" / "model.safetensors").exists() and (
        trained / "export" / "generation_config.json"
    ).exists()
    assert _loss(exported, AutoTokenizer.from_pretrained(trained / "export")) == pytest.approx(want, abs=1e-5)
    # The command, from a full file (fp16 default) and from a sharded folder.
    for source in (trained / "full" / NAME, trained / "sharded" / checkpoint_name("tiny_opt", 0, END, 1, sharded=True)):
        dest = tmp_path / source.stem
        proc = launch(["-m", "fsdp_opt.export"], [str(source), str(dest)], tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        model = AutoModelForCausalLM.from_pretrained(dest)
        assert next(model.parameters()).dtype == torch.float16
        assert _loss(model.float().eval(), tokenizer) == pytest.approx(want, rel=5e-3)


def test_sharded_folder_converts_to_the_single_file_form(tmp_path, trained):
    folder = trained / "sharded" / checkpoint_name("tiny_opt", 0, END, 1, sharded=True)
    out = tmp_path / "single.pt"
    proc = launch(["-m", "fsdp_opt.export"], ["--single_file", str(folder), str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    single = torch.load(out, weights_only=True)
    full = torch.load(trained / "full" / NAME, weights_only=True)
    assert single["GLOBAL_STEP"] == full["GLOBAL_STEP"]
    assert set(single[MODEL_KEY]) == set(full[MODEL_KEY])
    # Same data, same seed, same math: the two runs end with the same weights.
    for k, v in full[MODEL_KEY].items():
        torch.testing.assert_close(single[MODEL_KEY][k], v, rtol=1e-5, atol=1e-6)
    assert set(single["optimizer"]["state"]) == set(full["optimizer"]["state"])
    # And the single file resumes like any other.
    proc = run_cli(TINY + ["--resume_file", str(out), "--output_dir", str(tmp_path / "o")], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_checkpoint_handed_to_the_background_writer_keeps_its_step(tmp_path):
    """--async_save: the gathered payload is not changed by the steps that run while it is written (on CPU the full
    optimizer state dict hands out AdamW's live step counters; they are copied at the hand-off)."""
    out = tmp_path / "handoff.json"
    proc = launch([str(ROOT / "tests" / "workers" / "handoff.py")], [str(out)], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    main, other = (json.loads((tmp_path / f"handoff.json.rank{r}").read_text()) for r in range(2))
    assert main["handed"] == 1 and other["handed"] == 0  # rank 0 writes
    assert main["copied"] > 0  # the payload did share tensors with the live optimizer state
    assert main["optimizer_unchanged"] and main["model_unchanged"] and main["steps"] == [1.0]
