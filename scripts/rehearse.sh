#!/usr/bin/env bash
# A rehearsal of a platform's package set, on CPU:  bash scripts/rehearse.sh kaggle|floor [WORKDIR]
#
#   kaggle  Kaggle's GPU image (2026-05): Python 3.12, torch 2.10.0 (the registry's CUDA build, which runs on CPU),
#           transformers 5.0.0, peft 0.19.1, torchao 0.10.0 and the rest of its set, preinstalled as Kaggle has them.
#   floor   the lowest versions requirements.txt admits (requirements-floors.txt) with torch 2.8.0, on Python 3.10.
#
# It builds a virtualenv from exactly that set, installs fsdp-opt from its wheel as docs/kaggle.md says,
# checks that the platform's torch is kept, then runs on CPU with 2 processes: a training run and its resume into the
# next range; LoRA; LoRA on a 4-bit base after the torchao install line the run names; a Gemma 3 model with a sliding window
# on chat data (chain and LoRA); each --packing; evaluate; plan; and both notebooks. Each step prints "ok: ..." or stops the script with "FAILED: ...". The first run downloads several
# GB (torch's CUDA packages); later runs reuse pip's cache. Not part of CI (about 15 minutes): run it before a release.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
SET="${1:-}"
WORK="${2:-$REPO/.rehearse/$SET}"

case "$SET" in
  kaggle)
    PYTHON_VERSION="${REHEARSE_PYTHON:-3.12}"
    TORCH="torch==2.10.0"
    PACKAGES=(torchvision==0.25.0 transformers==5.0.0 datasets==4.0.0 huggingface_hub==1.11.0 wandb==0.26.1
              peft==0.19.1 accelerate==1.13.0 torchao==0.10.0 matplotlib==3.10.0 jupytext==1.19.1 safetensors==0.7.0
              tqdm==4.67.3 papermill ipykernel)
    ;;
  floor)
    PYTHON_VERSION="${REHEARSE_PYTHON:-3.10}"
    TORCH="torch==2.8.0"
    PACKAGES=(-r "$REPO/requirements-floors.txt" papermill ipykernel)
    ;;
  *)
    echo "usage: bash scripts/rehearse.sh kaggle|floor [WORKDIR]" >&2
    exit 2
    ;;
esac

step() { echo; echo "== $*"; }
ok() { echo "ok: $*"; }
fail() { echo "FAILED: $*" >&2; exit 1; }

python_for() {  # a working python3.X: pyenv's, or one on PATH
  local v="$1" exe
  for exe in $(command -v pyenv >/dev/null && pyenv versions --bare 2>/dev/null | grep -E "^$v(\.|$)" | sort -V -r \
               | sed "s#^#$(pyenv root 2>/dev/null)/versions/#; s#\$#/bin/python$v#") "$(command -v "python$v" || true)"; do
    if [ -n "$exe" ] && "$exe" -c "import sys" >/dev/null 2>&1; then echo "$exe"; return; fi
  done
  fail "Python $v is needed for the $SET rehearsal (not found)"
}

step "the $SET package set on Python $PYTHON_VERSION"
rm -rf "$WORK"
mkdir -p "$WORK"
"$(python_for "$PYTHON_VERSION")" -m venv "$WORK/venv"
# shellcheck disable=SC1091
. "$WORK/venv/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "$TORCH" "${PACKAGES[@]}"
TORCH_BEFORE="$(python -c 'import torch; print(torch.__version__)')"
python -m pip list 2>/dev/null | grep -i -E '^(torch|torchao|transformers|peft|datasets|huggingface.hub|wandb|accelerate|safetensors) ' || true

step "fsdp-opt from its wheel, as docs/kaggle.md installs it"
rm -rf "$WORK/dist"
python -m pip install -q build
python -m build --wheel --outdir "$WORK/dist" "$REPO" >/dev/null
WHEEL="$(ls "$WORK"/dist/fsdp_opt-*.whl)"
python -m pip install -q "$WHEEL"
TORCH_AFTER="$(python -c 'import torch; print(torch.__version__)')"
[ "$TORCH_BEFORE" = "$TORCH_AFTER" ] || fail "the install replaced torch $TORCH_BEFORE with $TORCH_AFTER"
ok "torch $TORCH_AFTER kept"
python -m pip list 2>/dev/null | grep -i -E '^(transformers|peft|huggingface.hub|wandb|torchao) ' || true

# A scratch folder: the runs never see the checkout, only the installed package.
RUN="$WORK/run"
mkdir -p "$RUN"
cd "$RUN"
export HF_HOME="$RUN/hf_home" HF_ENDPOINT="http://127.0.0.1:9" HF_HUB_DISABLE_TELEMETRY=1 WANDB_MODE=offline \
  WANDB_DIR="$RUN" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
TORCHRUN=(python -m torch.distributed.run --standalone --nproc_per_node=2 -m fsdp_opt)
BASE=(--model tiny-opt --dataset python-docs --max_length 64 --batch_size 2 --accum_steps 2 --num_epochs 1)

expect_rc0() {  # NAME, then the command
  local name="$1"; shift
  "$@" > "$RUN/$name.log" 2>&1 || { tail -30 "$RUN/$name.log" >&2; fail "$name (log: $RUN/$name.log)"; }
  grep -q "Traceback" "$RUN/$name.log" && { tail -30 "$RUN/$name.log" >&2; fail "$name printed a traceback"; }
  return 0
}

step "training, 2 processes, rows [0, 64), then --start_idx auto: the resume into [64, 128)"
expect_rc0 train "${TORCHRUN[@]}" "${BASE[@]}" --start_idx 0 --end_idx 64 --output_dir out
[ -f out/tiny_opt_0-64-epoch-1.pt ] || fail "no checkpoint out/tiny_opt_0-64-epoch-1.pt"
expect_rc0 resume "${TORCHRUN[@]}" "${BASE[@]}" --start_idx auto --range_size 64 --output_dir out
grep -q "ends its range: going on with rows \[64, 128)" "$RUN/resume.log" || fail "--start_idx auto did not pick [64, 128)"
python - <<'PY' || fail "metrics.jsonl does not continue the global step across the resume"
import json
rows = [json.loads(l) for l in open("out/metrics.jsonl")]
assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), [r["step"] for r in rows]
assert {r["slice"] for r in rows} == {"0-64", "64-128"}
print("  steps 1 ..", len(rows), "over slices 0-64 and 64-128; last loss", round(rows[-1]["loss"], 3))
PY
ls out/wandb/offline-run-* >/dev/null 2>&1 || fail "no W&B offline run was written"
ok "train, resume, W&B offline"

step "LoRA (peft), 2 processes"
expect_rc0 lora "${TORCHRUN[@]}" "${BASE[@]}" --end_idx 64 --lora_rank 8 --output_dir out_lora
grep -h "^note: torchao" "$RUN/lora.log" || true
ok "LoRA"

step "LoRA on a 4-bit base: the torchao install line the run names, then the run"
AO_LINE="$(python -c 'import torch; from fsdp_opt.runtime.torchao_gate import install_line; print(install_line(torch.__version__))')"
AO_VERSION="$(python -c 'import importlib.metadata as m; print(m.version("torchao"))' 2>/dev/null || echo none)"
FOUR=("${TORCHRUN[@]}" --model wide-opt --dataset python-docs --max_length 64 --batch_size 2 --num_epochs 1 --end_idx 32
      --lora_rank 8 --base_bits 4 --output_dir out_4bit)
python - <<'PY'
# tiny-opt's linears are 128 x 128: one NF4 shard unit (64 x 256 weights); 2 ranks need twice that, so hidden 256.
import shutil
from pathlib import Path
import fsdp_opt
from transformers import AutoConfig, AutoModelForCausalLM
assets = Path(fsdp_opt.__file__).parent / "assets" / "tiny-opt"
config = AutoConfig.from_pretrained(assets)
config.update(dict(hidden_size=256, ffn_dim=1024, word_embed_proj_dim=256))
AutoModelForCausalLM.from_config(config).save_pretrained("wide-opt")
for f in assets.iterdir():
    if "token" in f.name or f.name in ("vocab.json", "merges.txt"):
        shutil.copy(f, "wide-opt")
PY
if "${FOUR[@]}" > "$RUN/four_before.log" 2>&1; then
  echo "  torchao $AO_VERSION already suits torch $TORCH_AFTER"
else
  grep -q "^error: --base_bits 4: .*$AO_LINE" "$RUN/four_before.log" || { tail -20 "$RUN/four_before.log" >&2; fail "--base_bits 4 did not name '$AO_LINE'"; }
  grep "^error:" "$RUN/four_before.log"
  echo "  running: $AO_LINE"
  eval "python -m $AO_LINE -q"
  [ "$(python -c 'import torch; print(torch.__version__)')" = "$TORCH_AFTER" ] || fail "$AO_LINE replaced torch"
  expect_rc0 four "${FOUR[@]}"
fi
ok "4-bit base with $(python -c 'import importlib.metadata as m; print("torchao", m.version("torchao"))')"

step "a Gemma 3 (text) model with a sliding window on chat data: 2 processes, --start_idx auto into the next range, LoRA"
python - <<'PY'
# A small random-weight Gemma 3 text model (local and global layers, a 32-token window under 256-token blocks) that
# reads the built-in tokenizer's vocabulary: the model family path beyond OPT, on this platform's transformers.
import shutil
from pathlib import Path
import fsdp_opt
from transformers import AutoModelForCausalLM, Gemma3TextConfig
assets = Path(fsdp_opt.__file__).parent / "assets" / "tiny-opt"
config = Gemma3TextConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
                          layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
                          bos_token_id=0, eos_token_id=2, pad_token_id=1)
AutoModelForCausalLM.from_config(config).save_pretrained("gemma3-tiny")
for f in assets.iterdir():
    if "token" in f.name:
        shutil.copy(f, "gemma3-tiny")
PY
CHAT=(--model gemma3-tiny --dataset python-docs-chat --chat_template chatml --max_length 256 --batch_size 2 --num_epochs 1
      --lr 3e-3)
expect_rc0 chat "${TORCHRUN[@]}" "${CHAT[@]}" --start_idx 0 --end_idx 32 --output_dir out_chat
grep -q "loss on the answers only" "$RUN/chat.log" || fail "the chat run did not train on the answers only"
expect_rc0 chat_resume "${TORCHRUN[@]}" "${CHAT[@]}" --start_idx auto --range_size 32 --output_dir out_chat
grep -q "ends its range: going on with rows \[32, 64)" "$RUN/chat_resume.log" || fail "--start_idx auto did not pick [32, 64) for Gemma 3"
expect_rc0 chat_lora "${TORCHRUN[@]}" "${CHAT[@]}" --end_idx 32 --lora_rank 8 --output_dir out_chat_lora
python - <<'PY' || fail "the Gemma 3 chat runs"
import json, math
rows = [json.loads(l) for l in open("out_chat/metrics.jsonl")]
assert {r["slice"] for r in rows} == {"0-32", "32-64"} and all(math.isfinite(r["loss"]) for r in rows)
lora = [json.loads(l) for l in open("out_chat_lora/metrics.jsonl")]
print("  gemma3_text: steps 1 ..", len(rows), "over 0-32 and 32-64, loss", round(rows[0]["loss"], 3), "->",
      round(rows[-1]["loss"], 3), "; LoRA", len(lora), "steps")
PY
ok "Gemma 3 (text), sliding window, chat data, chain, LoRA"

step "--packing concat and pad"
expect_rc0 concat "${TORCHRUN[@]}" "${BASE[@]}" --end_idx 64 --packing concat --output_dir out_concat
expect_rc0 pad "${TORCHRUN[@]}" "${BASE[@]}" --end_idx 64 --packing pad --output_dir out_pad
ok "packing docs (above), concat, pad"

step "evaluate and plan"
expect_rc0 evaluate python -m fsdp_opt.evaluate --model tiny-opt --dataset python-docs --checkpoints out/tiny_opt_64-128-epoch-1.pt \
  --eval_rows 16 --max_length 64 --num_prompts 1 --max_new_tokens 4 --output_dir out --json out/eval_results.json
grep -q "tiny_opt_64-128-epoch-1.pt" out/eval_results.json || fail "evaluate wrote no result for the checkpoint"
expect_rc0 plan python -m fsdp_opt.plan --model facebook/opt-1.3b --gpus 2 --gpu_memory 14.5GiB --batch_size 4 --accum_steps 16
grep -q "total" "$RUN/plan.log" || fail "plan printed no total"
ok "evaluate, plan"

step "both notebooks (papermill)"
NB_DIR="$REPO/notebooks"
python - "$WHEEL" "$NB_DIR" <<'PY' > "$RUN/notebooks.log" 2>&1 || { tail -30 "$RUN/notebooks.log" >&2; fail "notebooks (log: $RUN/notebooks.log)"; }
import json, sys
from pathlib import Path
import papermill
wheel, nb_dir = sys.argv[1], Path(sys.argv[2])
common = {"model": "tiny-opt", "dataset": "python-docs", "range_size": 40, "num_epochs": 1, "batch_size": 2,
          "accum_steps": 1, "hf_repo": None, "output_dir": str(Path("nb_out").resolve()), "nproc": 2, "max_length": 64}
for session in (1, 2):  # the same notebook twice: two sessions, two ranges
    papermill.execute_notebook(str(nb_dir / "01_train.ipynb"), f"01_train.{session}.out.ipynb", progress_bar=False,
                               parameters={**common, "install": wheel, "extra_flags": "--lr 3e-3"}, kernel_name="python3")
papermill.execute_notebook(str(nb_dir / "02_evaluate.ipynb"), "02_evaluate.out.ipynb", progress_bar=False,
                           parameters={**common, "eval_rows": 10, "max_new_tokens": 5, "extra_flags": "--num_prompts 2"},
                           kernel_name="python3")
report = json.loads(Path("nb_out/eval_results.json").read_text())
print("notebooks:", [m["name"] for m in report["models"]], "losses", [round(m["loss"], 3) for m in report["models"]])
PY
tail -1 "$RUN/notebooks.log"
ok "notebooks"

step "the $SET rehearsal passed"
python -m pip list 2>/dev/null | grep -i -E '^(torch|torchao|transformers|peft|datasets|huggingface.hub|wandb|accelerate|safetensors|jupytext|matplotlib) '
