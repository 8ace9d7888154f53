# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% tags=["parameters"]
# Settings of this session. papermill (or you) may change any of them.
model = "facebook/opt-1.3b"  # Hub id, local folder, or the built-in "tiny-opt"
dataset = "ash001/arxiv-abstract"  # Hub id, local file, or the built-in "python-docs"
start_idx = 0  # this session trains rows [start_idx, end_idx)
end_idx = 5000
num_epochs = 1
batch_size = 4  # per GPU
accum_steps = 16  # global batch = batch_size x GPUs x accum_steps
max_length = 512  # tokens per training sequence
hf_repo = None  # "user/name": checkpoints are pushed there and the next session resumes from there
output_dir = "/kaggle/working/outputs"
nproc = "gpu"  # processes: "gpu" = one per GPU; a number on CPU
install = None  # pip install this first: a wheel ("/kaggle/input/fsdp-opt/fsdp_opt-0.1.0-py3-none-any.whl") or a git URL
repo_dir = None  # without `install`: the fsdp-opt checkout; None: this folder or a parent, else /kaggle/working/fsdp-opt
session_hours = 12.0  # Kaggle ends a session after about 12 hours
reserve_minutes = 30  # stop this long before the end: the last save and push fit in it
disk_budget = "19GB"  # checkpoints in output_dir stay under this (Kaggle keeps 20 GB of /kaggle/working)
run_next_slice = True  # also run the launch that resumes on the next range
extra_flags = ""  # more fsdp_finetune.py flags, e.g. "--save_every_steps 200 --eval_rows 200"

# %% [markdown]
# # Fine-tune with FSDP on Kaggle, one range of rows per session
#
# This notebook drives `fsdp_finetune.py` from the **fsdp-opt** package. Each session trains one index range
# of the dataset; checkpoints are named by range, pushed to the Hugging Face Hub (with `hf_repo`), and the next
# session resumes from them, so the chain of sessions is one training run with one global step and one W&B run.
#
# Change the settings in the first cell. Nothing else needs editing.

# %% [markdown]
# ## 1. Setup
#
# Install the package: from `install` (a wheel attached as a Kaggle dataset works with the internet off; a
# `git+https://...` URL needs it on), else from the checkout at `repo_dir` (skipped when it is installed already).
# pip keeps Kaggle's own torch: it meets the requirement.

# %%
import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

if repo_dir is None:
    here = Path.cwd().resolve()
    repo_dir = next((str(p) for p in [here, *here.parents] if (p / "fsdp_finetune.py").exists()), "/kaggle/working/fsdp-opt")
if install:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", install], check=True)
elif importlib.util.find_spec("fsdp_opt") is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", repo_dir], check=True)

import fsdp_opt
from fsdp_opt import notebook as nb

print("fsdp-opt from", Path(fsdp_opt.__file__).parent)

# %% [markdown]
# **Tokens.** `HF_TOKEN` (write access, for `hf_repo`) and `WANDB_API_KEY` come from the environment or from
# Kaggle's secrets (Add-ons → Secrets). They are put into this process's environment for the launches below
# and never printed: the cell shows only where each one came from. Without `WANDB_API_KEY`, W&B logs offline
# into `output_dir/wandb`.

# %%
print(nb.load_secrets())

# %% [markdown]
# **GPUs.** Two T4s: 15 GiB each, fp16 with loss scaling (no bf16). Without a GPU the same commands run on
# CPU processes.

# %%
print(nb.gpu_summary())

# %% [markdown]
# ## 2. The plan
#
# Before launching: memory per GPU by component for each sharding strategy (FULL_SHARD is the default), the
# largest micro-batch that fits, checkpoint sizes against the 20 GB of `/kaggle/working`, and the host RAM a
# full save needs. If FULL_SHARD does not fit, lower `batch_size` (raising `accum_steps`), or add
# `--reduce_every_microbatch` to `extra_flags`, which drops the unsharded gradient kept between micro-batches.

# %%
plan_cmd = nb.python_module("fsdp_opt.plan", nb.flags(
    model=model, gpus=nb.process_count(nproc), batch_size=batch_size, max_length=max_length, accum_steps=accum_steps,
    cpu=nb.gpu_summary().startswith("no CUDA"),
))  # fmt: skip
# !{plan_cmd}

# %% [markdown]
# ## 3. Train this session's range
#
# One process per GPU under `torchrun`. `--time_limit` is what is left of the session less `reserve_minutes`:
# before it runs out the run saves, pushes and exits cleanly, printing the command that resumes.

# %%
limit = nb.time_limit(session_hours, reserve_minutes)
args = nb.flags(
    model=model, dataset=dataset, start_idx=start_idx, end_idx=end_idx, num_epochs=num_epochs, batch_size=batch_size,
    accum_steps=accum_steps, max_length=max_length, hf_repo=hf_repo, output_dir=output_dir, time_limit=limit,
    disk_budget=disk_budget,
) + shlex.split(extra_flags)  # fmt: skip
train_cmd = nb.torchrun(nproc, "fsdp_opt", args, module=True)  # the training command of the package
print(train_cmd)

# %%
# !{train_cmd}
assert _exit_code == 0, "training stopped with an error: see the lines above"  # noqa: F821 - set by IPython

# %% [markdown]
# ## 4. The next session: resume on the next range
#
# A new session (even on an empty machine) continues from the newest checkpoint with `--resume_file latest`:
# from `output_dir` or, with `hf_repo`, from the Hub. Give a checkpoint name such as
# `opt_1.3B_0-5000-epoch-1.pt` instead to pick one. In a real chain you run this cell in the next session,
# with the same settings; here it runs right after the first launch if time is left.

# %%
next_start, next_end = nb.next_slice(start_idx, end_idx)
limit = nb.time_limit(session_hours, reserve_minutes)
args = nb.flags(
    model=model, dataset=dataset, start_idx=next_start, end_idx=next_end, num_epochs=num_epochs, batch_size=batch_size,
    accum_steps=accum_steps, max_length=max_length, hf_repo=hf_repo, output_dir=output_dir, time_limit=limit,
    disk_budget=disk_budget, resume_file="latest",
) + shlex.split(extra_flags)  # fmt: skip
resume_cmd = nb.torchrun(nproc, "fsdp_opt", args, module=True)
print(resume_cmd if run_next_slice and limit else "not launched (run_next_slice is off, or too little session time is left)")

# %%
if run_next_slice and limit:
    # !{resume_cmd}
    assert _exit_code == 0, "the resumed run stopped with an error: see the lines above"  # noqa: F821

# %% [markdown]
# ## 5. A look back
#
# The loss of every optimizer step in `metrics.jsonl`, with a moving average; dashed lines mark where each
# range (session) starts. The figure is saved next to the metrics as `loss_curve.png`.

# %%
fig = nb.plot_loss_curve(output_dir, Path(output_dir) / "loss_curve.png")
