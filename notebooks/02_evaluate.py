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
# Settings of this evaluation. papermill (or you) may change any of them.
model = "facebook/opt-1.3b"  # the base model the checkpoints were trained from
dataset = "ash001/arxiv-abstract"
range_size = 5000  # unused here, like num_epochs, session_ranges and accum_steps: both notebooks take the same settings
num_epochs = 1
session_ranges = 1
batch_size = 4  # per GPU, for the evaluation forward passes
accum_steps = 16
hf_repo = None  # "user/name": checkpoints not in output_dir are fetched from there
output_dir = "/kaggle/working/outputs"
nproc = "gpu"
repo_dir = None
checkpoints = None  # names or paths; None: the newest ("latest")
eval_rows = 200  # held-out rows: right after the newest checkpoint's range, or the first ones of eval_split
eval_split = None  # a held-out split (e.g. "test_sft"; the built-ins have "test"). None: the training run's, else the
# rows after the range, and a "test" or "validation" split when the range reached the end of the data
prompts = (
    None  # None: from the first held-out rows (a text row's opening words; a chat row's question, in its template)
)
max_new_tokens = 40
do_sample = False  # False: greedy; True: sampled with temperature 0.8, top-p 0.95
extra_flags = ""

# %% [markdown]
# # Judge the fine-tuned model
#
# Compares the base model with one or more checkpoints of the training notebook on rows none of them was
# trained on: by default the `eval_rows` rows right after the newest checkpoint's range (a held-out split such as
# `test` when the chain has trained every row, or the one `eval_split` names). It shows eval loss and
# perplexity side by side, the training loss curve, and text each model writes from the same prompts.
# `python -m fsdp_opt.evaluate` does the work, under torchrun with FSDP, so a model that does not fit on one
# GPU is still evaluated.

# %% [markdown]
# ## 1. Setup

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
if importlib.util.find_spec("fsdp_opt") is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", f"{repo_dir}[eval]"], check=True)  # lm-eval too

from IPython.display import Markdown, display

from fsdp_opt import notebook as nb
from fsdp_opt.train.report import answers_markdown, report_markdown

print(nb.load_secrets())
print(nb.gpu_summary())

# %% [markdown]
# ## 2. Evaluate base and checkpoints

# %%
results_json = str(Path(output_dir) / "eval_results.json")
args = nb.flags(
    model=model,
    dataset=dataset,
    checkpoints=checkpoints or ["latest"],
    eval_rows=eval_rows,
    eval_split=eval_split,
    batch_size=batch_size,
    output_dir=output_dir,
    hf_repo=hf_repo,
    prompts=prompts,
    max_new_tokens=max_new_tokens,
    do_sample=do_sample,
    json=results_json,
) + shlex.split(extra_flags)
eval_cmd = nb.torchrun(nproc, "fsdp_opt.evaluate", args, module=True)
print(eval_cmd)

# %%
# !{eval_cmd}
assert _exit_code == 0, "the evaluation stopped with an error: see the lines above"  # noqa: F821 - set by IPython

# %% [markdown]
# ## 3. Base vs checkpoints
#
# Eval loss is the mean next-token cross-entropy over the held-out target tokens (every token of text rows; the
# answers of instruction and chat rows, as training counts them); perplexity is its exponential.

# %%
display(Markdown(report_markdown(results_json)))

# %% [markdown]
# ## 4. Answers side by side
#
# Each held-out prompt (for chat rows: the conversation up to its first answer, through the chat template the run
# trained with), the row's own answer, and what each model generated. A tuned chat model ends its answer with the
# template's end-of-turn marker.

# %%
display(Markdown(answers_markdown(results_json)))

# %% [markdown]
# ## 5. The training loss curve
#
# Saved as `loss_curve.png` next to `metrics.jsonl`.

# %%
fig = nb.plot_loss_curve(output_dir, Path(output_dir) / "loss_curve.png")

# %% [markdown]
# ## 6. Benchmark scores along the chain
#
# With `--eval_tasks` (lm-eval's tasks, scored at every save: docs/evaluation.md), each metric against the rows
# trained so far: a point a save, read from `eval.jsonl`. Saved as `benchmarks.png`.

# %%
fig = nb.plot_benchmarks(output_dir, Path(output_dir) / "benchmarks.png")
