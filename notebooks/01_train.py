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
range_size = 5000  # rows per session: each run of this notebook trains the range after the newest checkpoint
num_epochs = 1  # passes over the whole dataset
session_ranges = 1  # ranges one session may train (0: as many as the time left holds, each one whole)
batch_size = 4  # per GPU
accum_steps = 16  # global batch = batch_size x GPUs x accum_steps
max_length = 512  # tokens per training sequence
hf_repo = None  # "user/name": checkpoints are pushed there and the next session resumes from there
output_dir = "/kaggle/working/outputs"
nproc = "gpu"  # processes: "gpu" = one per GPU; a number on CPU
install = (
    None  # pip install this first: a wheel ("/kaggle/input/fsdp-opt/fsdp_opt-0.3.0-py3-none-any.whl") or a git URL
)
repo_dir = (
    None  # without `install`: the fsdp-opt checkout; None: this folder or a parent, else /kaggle/working/fsdp-opt
)
session_hours = 12.0  # Kaggle ends a session after about 12 hours
reserve_minutes = 30  # stop this long before the end: the last save and push fit in it
disk_budget = "19GB"  # checkpoints in output_dir stay under this (Kaggle keeps 20 GB of /kaggle/working)
extra_flags = ""  # more fsdp_finetune.py flags, e.g. "--save_every_steps 200 --eval_rows 200"
push_model_to = None  # "user/model-name": when the chain is done, the last cell pushes the model repo there
gguf = ""  # e.g. "q8_0": GGUF for llama.cpp/Ollama with the model repo (Llama, Mistral, Qwen, Gemma, Phi-3; not OPT)

# %% [markdown]
# # Fine-tune with FSDP on Kaggle, one range of rows per session
#
# This notebook drives `fsdp_finetune.py` from the **fsdp-opt** package. Each session trains one index range
# of the dataset; checkpoints are named by range, pushed to the Hugging Face Hub (with `hf_repo`), and the next
# session resumes from them, so the chain of sessions is one training run with one global step and one W&B run.
#
# The notebook is the same for every session: `--start_idx auto` finds the newest checkpoint (here or in `hf_repo`)
# and trains the range after it, or finishes the range a stopped session left. Set the first cell once, then run
# each session with **Save Version → Save & Run All**. When every pass over the data is trained, a run says so and
# trains nothing.

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
    repo_dir = next(
        (str(p) for p in [here, *here.parents] if (p / "fsdp_finetune.py").exists()), "/kaggle/working/fsdp-opt"
    )
if install:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", install], check=True)
elif importlib.util.find_spec("fsdp_opt") is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", f"{repo_dir}[eval]"], check=True)  # lm-eval too

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
plan_cmd = nb.python_module(
    "fsdp_opt.plan",
    nb.flags(
        model=model,
        gpus=nb.process_count(nproc),
        batch_size=batch_size,
        max_length=max_length,
        accum_steps=accum_steps,
        cpu=nb.gpu_summary().startswith("no CUDA"),
    ),
)
# !{plan_cmd}

# %% [markdown]
# ## 3. Train this session's range
#
# One process per GPU, started by the training command itself (`python -m fsdp_opt --nproc_per_node gpu`: as
# `torchrun --standalone` would, but a failure ends with the tool's own line). The run prints where the chain stands:
# ranges done, this range, rows left and the sessions left at the measured rate. `--time_limit` is what is left of
# the session less `reserve_minutes`: before it runs out the run saves, pushes and exits cleanly, and the next
# session finishes the range.

# %%
limit = nb.time_limit(session_hours, reserve_minutes)
args = nb.flags(
    model=model,
    dataset=dataset,
    start_idx="auto",
    range_size=range_size,
    session_ranges=session_ranges,
    num_epochs=num_epochs,
    batch_size=batch_size,
    accum_steps=accum_steps,
    max_length=max_length,
    hf_repo=hf_repo,
    output_dir=output_dir,
    time_limit=limit,
    disk_budget=disk_budget,
) + shlex.split(extra_flags)
train_cmd = nb.launch(nproc, args)  # the training command of the package, starting its workers
print(train_cmd)

# %%
# !{train_cmd}
assert _exit_code == 0, "training stopped with an error: see the lines above"  # noqa: F821 - set by IPython

# %% [markdown]
# ## 4. A look back
#
# The loss of every optimizer step in `metrics.jsonl`, with a moving average; dashed lines mark where each
# range (session) starts. The figure is saved next to the metrics as `loss_curve.png`.

# %%
fig = nb.plot_loss_curve(output_dir, Path(output_dir) / "loss_curve.png")

# %% [markdown]
# ## 5. The end of the chain: the model repo
#
# Once the last range is trained, the newest checkpoint becomes a model repo that `from_pretrained("user/name")`
# loads: LoRA merged, fp16 safetensors, the tokenizer and its chat template, and a card listing every range with its
# data pin and figures (docs/export.md). Set `push_model_to` to push it; OPT gets its model repo and one line saying
# why it gets no GGUF.

# %%
checkpoints = sorted(Path(output_dir).glob("*-epoch-*"), key=lambda p: p.stat().st_mtime)
if push_model_to and checkpoints:
    export_args = [str(checkpoints[-1]), "--push_to_hub", push_model_to] + (["--gguf", *gguf.split()] if gguf else [])
    export_cmd = nb.python_module("fsdp_opt.export", export_args)
    print(export_cmd)
    get_ipython().system(export_cmd)  # noqa: F821 - IPython's
else:
    print("push_model_to is not set (or no checkpoint yet): the model repo is pushed from the last session")
