#!/usr/bin/env bash
# Train under Slurm on one or more nodes: one torchrun per node, c10d rendezvous on the first node.
#
#   sbatch --nodes=2 --gpus-per-node=8 scripts/slurm_submit.sh --total_batch_size 512 --batch_size 4 \
#       --model facebook/opt-1.3b --start_idx 0 --end_idx 50000 --hf_repo user/repo
#
# --total_batch_size (sequences per optimizer step) and --batch_size (per GPU) set --accum_steps:
#   accum_steps = total_batch_size / (batch_size x nodes x GPUs per node), which must divide exactly.
# Every other flag goes to fsdp_finetune.py unchanged.
# Environment: GPUS_PER_NODE (default: SLURM_GPUS_ON_NODE, else the GPUs nvidia-smi lists),
# MASTER_PORT (29500), FSDP_OPT_DRY_RUN=1 prints the command and the arithmetic instead of running.
#
#SBATCH --job-name=fsdp-opt
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=slurm-%j.out
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }

total="" per_gpu=""
pass=()
while [ $# -gt 0 ]; do
  case "$1" in
    --total_batch_size) [ $# -ge 2 ] || die "--total_batch_size needs a value"; total="$2"; shift 2 ;;
    --total_batch_size=*) total="${1#*=}"; shift ;;
    --batch_size) [ $# -ge 2 ] || die "--batch_size needs a value"; per_gpu="$2"; shift 2 ;;
    --batch_size=*) per_gpu="${1#*=}"; shift ;;
    --accum_steps|--accum_steps=*) die "--accum_steps: this script computes it from --total_batch_size" ;;
    *) pass+=("$1"); shift ;;
  esac
done
[ -n "$total" ] || die "--total_batch_size is required (sequences per optimizer step)"
per_gpu="${per_gpu:-4}"
is_int() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
is_int "$total" || die "--total_batch_size $total: expected a positive integer"
is_int "$per_gpu" || die "--batch_size $per_gpu: expected a positive integer"

nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
gpus="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
if [ -z "$gpus" ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
is_int "$gpus" || die "no GPUs found on this node; set GPUS_PER_NODE"
is_int "$nodes" || die "SLURM_JOB_NUM_NODES=$nodes: expected a positive integer"

world=$((nodes * gpus))
per_step=$((per_gpu * world))
if [ $((total % per_step)) -ne 0 ]; then
  lower=$(( (total / per_step) * per_step ))
  upper=$(( lower + per_step ))
  hint="$upper"; [ "$lower" -gt 0 ] && hint="$lower or $upper"
  die "--total_batch_size $total is not a multiple of --batch_size $per_gpu x $world GPUs ($nodes nodes x $gpus) = $per_step; use $hint"
fi
accum=$((total / per_step))

if [ -n "${MASTER_ADDR:-}" ]; then
  master="$MASTER_ADDR"
elif command -v scontrol >/dev/null 2>&1 && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
else
  master=$(hostname)
fi
port="${MASTER_PORT:-29500}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

cmd=(torchrun --nnodes "$nodes" --nproc_per_node "$gpus" --rdzv_id "${SLURM_JOB_ID:-fsdp-opt}"
     --rdzv_backend c10d --rdzv_endpoint "$master:$port"
     "$here/fsdp_finetune.py" --batch_size "$per_gpu" --accum_steps "$accum" "${pass[@]}")
echo "fsdp-opt: $nodes node(s) x $gpus GPU(s) = $world ranks; batch $per_gpu x $world x accum $accum = $total sequences per step"
if [ "${FSDP_OPT_DRY_RUN:-0}" = "1" ]; then
  printf '%q ' srun --ntasks-per-node=1 "${cmd[@]}"; echo
  exit 0
fi
exec srun --ntasks-per-node=1 "${cmd[@]}"
