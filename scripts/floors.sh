#!/usr/bin/env bash
# The requirement floors, tested: the lowest versions requirements.txt allows (torch aside: Kaggle brings its own)
# go into .floors, ahead of the test environment on PYTHONPATH, and a subset of the tests runs on them: the engine
# on 2 ranks, data loading (local, and Hub datasets by range: datasets' resolution of configs and splits, parquet
# row groups over HfFileSystem), checkpoints through the Hub stand-in with retention, W&B, LoRA (peft) on GPT-2 and
# Llama blocks with the adapter folder peft loads, DPO (full and LoRA, peft's adapters switched off), GRPO's
# static-cache decoding (transformers before its cache kept its own position takes cache_position).
#   bash scripts/floors.sh             install the floors into .floors, then run the subset on them
#   bash scripts/floors.sh --install   the install alone (.ci/run starts it beside the suite: mostly downloads)
#   bash scripts/floors.sh --test      the subset alone, on the .floors an earlier --install finished
set -euo pipefail
cd "$(dirname "$0")/.."
phase="${1:-all}"
case "$phase" in
  all | --install | --test) ;;
  *)
    echo "floors.sh: unknown argument $phase (none, --install or --test)" >&2
    exit 2
    ;;
esac
if [ "$phase" = "--test" ]; then
  FSDP_OPT_INSTALLED=1 source scripts/env.sh
  if [ ! -e .floors/.installed ]; then
    echo "floors: .floors is not installed (bash scripts/floors.sh --install)" >&2
    exit 1
  fi
else
  source scripts/env.sh "[test]"
  rm -rf .floors
  install --no-deps --target .floors -r requirements-floors.txt
  touch .floors/.installed
  if [ "$phase" = "--install" ]; then
    exit 0
  fi
fi
export PYTHONPATH="$PWD/.floors"
python - <<'PY'
import datasets, huggingface_hub, matplotlib, peft, transformers, wandb
for m in (transformers, datasets, huggingface_hub, wandb, matplotlib, peft):
    assert m.__file__.startswith(__import__("os").path.abspath(".floors")), m.__file__
print("floors:", ", ".join(f"{m.__name__} {m.__version__}" for m in (transformers, datasets, huggingface_hub, wandb, matplotlib, peft)))
PY
# (test_units' fused-AdamW check is torch's and the package's alone: torch is not floored, the suite makes it.)
# The order splits the work in two even halves: pytest-xdist hands each worker half of the list as given, the two
# longest tests (the HYBRID_SHARD launch, the W&B fallback) open the first half and the Hub's sharded chain the second.
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist worksteal -p no:cacheprovider \
    "tests/engine/test_training_math.py::test_hybrid_shard_across_two_nodes_matches_reference" \
    "tests/hub/test_hub.py::test_wandb_without_network_falls_back" tests/test_units.py \
    --deselect "tests/test_units.py::test_fused_adamw_of_cuda_runs_steps_dtensor_parameters_like_foreach" \
    "tests/hub/test_hub.py::test_sharded_checkpoints_through_the_hub" \
    "tests/model/test_lora.py::test_lora_on_gpt2_and_llama_blocks" "tests/model/test_lora.py::test_bad_lora_flags_get_one_line" \
    "tests/model/test_lora.py::test_generation_merges_the_adapters_into_the_gathered_copies_only" \
    "tests/data/test_hub_ranges.py::test_rows_read_by_range_are_load_datasets_rows" \
    "tests/data/test_hub_ranges.py::test_a_json_dataset_is_read_from_its_parquet_export_and_a_partial_export_downloads_it_whole" \
    "tests/data/test_hub_ranges.py::test_a_dataset_with_two_configs_and_no_default_names_them_and_trains_with_one" \
    "tests/train/test_dpo.py::test_the_first_step_is_the_dpo_loss_of_the_pairs_alone_full_and_lora[strings]" \
    "tests/hub/test_retention.py::test_a_purge_the_hub_refused_is_finished_by_the_next_session" \
    "tests/data/test_packing.py::test_each_row_in_a_packed_block_has_the_losses_it_has_alone" \
    "tests/engine/test_decoding.py::test_the_static_path_decodes_what_transformers_generate_does[opt]" \
    "tests/engine/test_decoding.py::test_the_static_path_decodes_what_transformers_generate_does[mistral]" \
    "tests/engine/test_decoding.py::test_the_graph_paths_bookkeeping_decodes_what_the_static_path_does[llama]" \
    tests/data/test_data.py tests/data/test_sources.py
