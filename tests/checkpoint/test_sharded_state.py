"""FULL_SHARD must hold about half the parameter and optimizer bytes per rank of NO_SHARD on 2 ranks, and the
planner's state figures must match what the ranks hold."""

from __future__ import annotations

import json

from conftest import ROOT, launch

from fsdp_opt.model.loader import meta_model as build_meta_model
from fsdp_opt.model.sources import load_model_config, resolve_model


def test_full_shard_halves_per_rank_state(tmp_path):
    out = tmp_path / "state.json"
    proc = launch(
        [str(ROOT / "tests" / "workers" / "state_bytes.py")], [str(out), "FULL_SHARD", "NO_SHARD"], tmp_path, nproc=2
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"state.json.rank{r}").read_text()) for r in range(2)]
    # Independent size: the model's unique fp32 parameters, counted on an unsharded skeleton.
    model = build_meta_model(load_model_config(resolve_model("tiny-opt")))
    full_bytes = 4 * sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    for rep in ranks:
        assert rep["NO_SHARD"]["params"] == full_bytes
        assert rep["NO_SHARD"]["optimizer"] == 2 * full_bytes  # Adam m and v
    for kind in ("params", "optimizer"):
        total_sharded = sum(rep["FULL_SHARD"][kind] for rep in ranks)
        # Shards add up to one full copy (dim-0 padding aside), split about evenly.
        assert abs(total_sharded - ranks[0]["NO_SHARD"][kind]) <= 0.01 * ranks[0]["NO_SHARD"][kind]
        for rep in ranks:
            assert rep["FULL_SHARD"][kind] <= 0.55 * rep["NO_SHARD"][kind]
    # The planner, from the config alone, against the measured parameters + gradients + Adam state per rank.
    from fsdp_opt.model.shapes import Shape, model_config
    from fsdp_opt.planner.inputs import Inputs, state_bytes

    shape = Shape.of(model_config("tiny-opt"))
    assert 4 * shape.params == full_bytes
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        predicted = sum(state_bytes(shape, strategy, Inputs(gpus=2, precision="fp32", cuda=False)).values())
        for rep in ranks:
            assert rep[strategy]["grads"] == rep[strategy]["params"]
            assert abs(rep[strategy]["total"] - predicted) <= 0.10 * predicted, (strategy, rep[strategy], predicted)


def test_a_full_checkpoint_gathers_torchs_full_state_in_buckets_and_the_clip_norm_is_the_whole_gradients(tmp_path):
    """3 ranks (uneven shards; one rank holds no row of a 2-row weight), FULL_SHARD's and NO_SHARD's meshes: the
    bucketed gather equals torch's own full state dicts (model and AdamW) key for key and tensor for tensor, in one
    all-gather per state dict (and with a bucket per tensor); the other ranks keep nothing; the optimizer's state stays
    DTensors. The clipping norm takes one all-reduce and equals the norm of the whole gradients (float64)."""
    proc = launch([str(ROOT / "tests" / "workers" / "full_state.py")], [], tmp_path, nproc=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["world"] for r in ranks] == [3, 3, 3]
    assert [r["FULL_SHARD_rows_on_this_rank"] for r in ranks] == [1, 1, 0]  # 2 rows over 3 ranks
    assert [r["kept_here"] for r in ranks] == [8, 0, 0]
    for kind in ("FULL_SHARD", "NO_SHARD"):
        assert ranks[0][f"{kind}_entries"] == [8, 8]  # 4 layers' weights and biases; their AdamW states
        for r in ranks:
            assert r[f"{kind}_equal"] and r[f"{kind}_state_kept"] and r[f"{kind}_gathers"] == 2, r
            assert r[f"{kind}_norm_reduces"] == 1 and r[f"{kind}_norm_plain"], r
            assert r[f"{kind}_norm_rel_error"] < 1e-6 and r[f"{kind}_norm_vs_dtensor"] < 1e-6, r
    assert all(r["other_layouts_equal"] for r in ranks)
