"""benchmarks/throughput.py runs and reports what it promises. Speed itself is judged from its output, not here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, sandbox_env


def test_memory_only_report(tmp_path):
    """--memory-only: a row per sharding strategy (here in one launch: --one_launch), HYBRID_SHARD not launched."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "throughput.py"),
        "--memory-only",
        "--configs",
        "FULL_SHARD",
        "NO_SHARD",
        "HYBRID_SHARD",
        "--nproc",
        "2",
        "--warmup",
        "0",
        "--steps",
        "1",
        "--max_length",
        "64",
        "--json",
        str(tmp_path / "bench.json"),
        "--one_launch",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert set(report) >= {"configs", "machine", "ratios"} and report["machine"]["cpu_count"]
    full, no = report["configs"]["FULL_SHARD"], report["configs"]["NO_SHARD"]
    for r in (full, no):
        assert r["useful_tokens_per_s"] > 0 and r["step_time_s"] > 0 and 0 < r["mfu"] < 1
        assert r["peak_memory_bytes_per_rank"] > 0 and r["global_batch"] == 8
        assert abs(r["predicted_state_bytes_per_rank"] / r["peak_state_bytes_per_rank"] - 1) <= 0.10
    assert full["peak_state_bytes_per_rank"] <= 0.55 * no["peak_state_bytes_per_rank"]
    for r in (full, no):
        assert r["gc_seconds"] >= 0
    assert "needs 2 or more nodes" in report["configs"]["HYBRID_SHARD"]["error"]
    assert "| FULL_SHARD |" in proc.stdout and "full_shard_over_no_shard_state: 0.5" in proc.stdout


def test_throughput_report_runs_the_trainer_under_fsdp2(tmp_path):
    """hf_trainer really is transformers' Trainer with FSDP2 shards (the worker refuses a DDP-wrapped model); the
    engine's configurations one after another in one launch (--one_launch), hf_trainer in its own."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "throughput.py"),
        "--configs",
        "packed",
        "hf_trainer",
        "packed_lora",
        "chat_docs",
        "chat_all",
        "--nproc",
        "2",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--max_length",
        "128",
        "--json",
        str(tmp_path / "bench.json"),
        "--one_launch",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    configs = json.loads((tmp_path / "bench.json").read_text())["configs"]
    ours, trainer = configs["packed"], configs["hf_trainer"]
    assert "error" not in trainer, trainer
    assert (
        trainer["global_batch"] == ours["global_batch"] == 8 and trainer["flops_per_token"] == ours["flops_per_token"]
    )
    # Sharded: each rank holds half of the parameters, gradients and Adam state, as the planner says.
    assert trainer["peak_state_bytes_per_rank"] == trainer["predicted_state_bytes_per_rank"]
    assert trainer["peak_state_bytes_per_rank"] == ours["peak_state_bytes_per_rank"]
    assert "packed_over_hf_trainer_tokens_per_s" in proc.stdout
    # LoRA: the frozen base and the adapters' state, as the planner counts them; a fraction of full fine-tuning's.
    lora = configs["packed_lora"]
    assert "error" not in lora, lora
    assert abs(lora["predicted_state_bytes_per_rank"] / lora["peak_state_bytes_per_rank"] - 1) <= 0.02
    assert lora["peak_state_bytes_per_rank"] < 0.5 * ours["peak_state_bytes_per_rank"]
    assert "packed_lora_over_packed_state" in proc.stdout
    # Chat rows: answer tokens are useful, every real token is seen; --train_on all on the same rows trains them all.
    chat, every = configs["chat_docs"], configs["chat_all"]
    assert 0 < chat["useful_tokens_per_s"] < 0.5 * chat["seen_tokens_per_s"]
    assert every["useful_tokens_per_s"] > 0.9 * every["seen_tokens_per_s"]
    assert "chat_docs_over_chat_all_step_time" in proc.stdout


def _throughput_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("throughput", ROOT / "benchmarks" / "throughput.py")
    throughput = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(throughput)
    return throughput


def test_repeat_runs_round_robin_and_keeps_each_configurations_median_run(capsys):
    """--repeat: the configurations in turn, round after round; each keeps its median run (the lower middle of an even
    count), every run's rate beside it; an error run is left out; HYBRID_SHARD on one node is not launched."""
    rates = {"A": [5.0, 1.0, 3.0], "B": [2.0, 8.0, 4.0], "C": [7.0, None, 1.0]}  # None: that run failed
    launched = []

    def run(name):
        rate = rates[name][sum(1 for n in launched if n == name)]
        launched.append(name)
        return {"error": "exit 1: boom"} if rate is None else {"useful_tokens_per_s": rate, "round": len(launched)}

    picked = _throughput_module().rounds(["A", "B", "C", "HYBRID_SHARD"], 3, run)
    assert launched == ["A", "B", "C"] * 3
    assert picked["A"]["useful_tokens_per_s"] == 3.0 and picked["A"]["runs_useful_tokens_per_s"] == [5.0, 1.0, 3.0]
    assert picked["B"]["useful_tokens_per_s"] == 4.0 and picked["B"]["round"] == 8
    assert picked["C"]["useful_tokens_per_s"] == 1.0 and picked["C"]["runs_useful_tokens_per_s"] == [7.0, None, 1.0]
    assert "needs 2 or more nodes" in picked["HYBRID_SHARD"]["error"]
    assert "running B ... (round 2 of 3)" in capsys.readouterr().out
    launched.clear()
    rates = {"A": [4.0, 2.0]}
    two = _throughput_module().rounds(["A"], 2, run)["A"]
    assert two["useful_tokens_per_s"] == 2.0 and two["runs_useful_tokens_per_s"] == [4.0, 2.0]
    launched.clear()
    rates = {"A": [None]}
    assert _throughput_module().rounds(["A"], 1, run) == {"A": {"error": "exit 1: boom"}}


def test_one_launch_runs_a_rounds_configurations_together_and_hf_trainer_alone(monkeypatch):
    """--one_launch: the first configuration a round asks for launches all of that round's but hf_trainer; each is
    answered from that launch; the next round launches again. Without it, a launch per configuration."""
    throughput = _throughput_module()
    launched = []

    def launch(args, names, argv):
        launched.append(list(names))
        return {name: {"useful_tokens_per_s": float(len(launched)), "name": name} for name in names}

    monkeypatch.setattr(throughput, "launch", launch)
    names = ["packed", "hf_trainer", "chat_docs", "HYBRID_SHARD"]
    picked = throughput.rounds(names, 2, throughput.launcher(throughput.parse(["--one_launch"]), names, []))
    assert launched == [["packed", "chat_docs"], ["hf_trainer"], ["packed", "chat_docs"], ["hf_trainer"]]
    assert picked["packed"]["runs_useful_tokens_per_s"] == [1.0, 3.0] and picked["packed"]["name"] == "packed"
    assert picked["chat_docs"]["runs_useful_tokens_per_s"] == [1.0, 3.0]
    assert picked["hf_trainer"]["runs_useful_tokens_per_s"] == [2.0, 4.0]
    launched.clear()
    throughput.rounds(names, 1, throughput.launcher(throughput.parse([]), names, []))
    assert launched == [["packed"], ["hf_trainer"], ["chat_docs"]]


def test_gc_clock_counts_collections_only_while_started():
    import gc

    throughput = _throughput_module()

    def cycles():
        for _ in range(20000):
            a: list = []
            a.append(a)

    clock = throughput.GcClock()
    gc.collect()
    clock.start()
    cycles()
    gc.collect()
    during = clock.stop()
    assert during > 0
    cycles()
    gc.collect()
    assert clock.total == during and clock._callback not in gc.callbacks


def test_session_benchmark_reports_every_stage_against_its_floor(tmp_path):
    """benchmarks/session.py at tiny size: two real sessions through the loopback Hub, each stage next to a floor
    measured in the same run, host peaks beside the plan, and the Kaggle prediction's arithmetic."""
    out = tmp_path / "session.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "session.py"),
        "--shape",
        "tiny-opt",
        "--rows",
        "40",
        "--max_length",
        "64",
        "--batch_size",
        "2",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    fresh, resumed, floors = r["fresh"], r["resumed"], r["floors"]
    # The resumed session ran on an empty machine: it downloaded the fresh session's checkpoint from the Hub.
    assert resumed["download_bytes"] == pytest.approx(fresh["save_bytes"], rel=0.01)
    assert fresh["push_bytes"] > fresh["save_bytes"]  # the checkpoint and its weights file
    # In the background the save took longer than training waited; in place training waited for all of it.
    assert resumed["save_training_waited_s"] <= resumed["save_s"] and fresh["save_training_waited_s"] == fresh["save_s"]
    for name, stage in r["stages"].items():
        assert stage["measured_s"] > 0 and stage["floor_s"] > 0, name
        assert r["ratios"][name] == pytest.approx(stage["measured_s"] / stage["floor_s"])
    write_rate = floors["bytes"] / floors["write_s"]
    assert r["stages"]["save, in place (fresh)"]["floor_s"] == pytest.approx(fresh["save_bytes"] / write_rate)
    assert len(fresh["peak_rss_gib"]) == 2 and len(r["plan"]["fresh"]) == 2
    # Kaggle: opt-1.3b's bytes at the stated rates, scaled by the measured ratio of the same stage here.
    k = r["kaggle"]
    assert k["checkpoint_bytes"] == 12 * 1_315_758_080 and k["weights_bytes"] == 2 * 1_315_758_080
    want = k["checkpoint_bytes"] / (k["assumed_mbps"]["download"] * 1e6) * r["ratios"]["download on a fresh machine"]
    assert k["stages_s"]["download on a fresh machine"] == pytest.approx(want)
    # The resume: opt-1.3b's file read once at the stated disk rate, plus the copying beyond the read seen here.
    res = r["stages"]["resume: read and load the checkpoint"]
    beyond = max(0.0, res["measured_s"] - res["floor_s"]) * k["checkpoint_bytes"] / res["bytes"]
    want = k["checkpoint_bytes"] / (k["assumed_mbps"]["disk"] * 1e6) + beyond
    assert k["stages_s"]["resume: read and load the checkpoint"] == pytest.approx(want)
    assert 0 <= resumed["resume_read_s"] <= resumed["resume_load_s"]
    assert (
        "| push to the Hub stand-in (checkpoint + weights file) |" in proc.stdout
        and "Kaggle 2xT4, opt-1.3b (prediction)" in proc.stdout
    )


def test_data_benchmark_reports_a_range_against_the_whole_split(tmp_path):
    """benchmarks/data.py: three sessions (start, middle, end) and load_dataset of the whole split, each on an empty
    cache; a range fetches a small part of what the whole split costs, and keeps none of it on disk."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "data.py"),
        "--rows",
        "20000",
        "--shards",
        "2",
        "--row_group",
        "500",
        "--range",
        "16",
        "--nproc",
        "0",
        "--json",
        str(tmp_path / "data.json"),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "data.json").read_text())
    assert [r["where"] for r in report["ranges"]] == ["start", "middle", "end"]
    whole = report["whole"]
    assert whole["fetched_bytes"] >= report["dataset_bytes"] and whole["disk_bytes"] >= report["dataset_bytes"]
    for r in report["ranges"]:
        assert 0 < r["fetched_bytes"] < 0.2 * whole["fetched_bytes"], r
        assert r["disk_bytes"] < 0.05 * whole["disk_bytes"] and r["to_first_step_s"] > 0, r
    assert "| `load_dataset` of the whole split |" in proc.stdout


def test_generation_benchmark_gathers_once_against_once_per_token(tmp_path):
    """benchmarks/generation.py on 2 ranks: both ways make the same completions; gathered once, FSDP2 all-gathers
    each unit once (the blocks and the root); layer by layer, every block in every decoding step (the root, which
    FSDP2 keeps unsharded after its forward, once)."""
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(ROOT / "fsdp_opt" / "assets" / "tiny-opt").num_hidden_layers
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "generation.py"),
        "--model",
        "tiny-opt",
        "--repeat",
        "1",
        "--new_tokens",
        "8",
        "--prompts",
        "4",
        "--json",
        str(tmp_path / "gen.json"),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gen.json").read_text())
    assert report["same_completions"] and report["tokens_per_rank"] == 4 * 8
    assert report["gathered"]["all_gathers_per_round"] == layers + 1
    assert report["layer_by_layer"]["all_gathers_per_round"] == 1 + 8 * layers
    assert report["gathered_over_layer_by_layer_tokens_per_s"] > 0 and "| gathered |" in proc.stdout


def test_allocator_benchmark_runs_both_thresholds_to_the_same_losses(tmp_path):
    """benchmarks/allocator.py at a few steps, each arm launched alone (the default adds two launches at once, the same
    code with two processes): each reports its step, wall, CPU and RAM, and both train to the same loss (the
    allocator's threshold moves no number); no time is asserted."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "allocator.py"),
        "--rounds",
        "1",
        "--end_idx",
        "24",
        "--num_epochs",
        "1",
        "--ways",
        "1",
        "--json",
        str(tmp_path / "alloc.json"),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "alloc.json").read_text())
    assert list(report["arms"]) == ["32 MiB (CPU device)", "1 MiB (GPU runs)"] and report["same_losses"]
    for arm in report["arms"].values():
        (launch,) = arm["alone"]["launches"]
        assert list(arm) == ["alone"] and len(launch["losses"]) == 1 and len(launch["peak_rss_gib"]) == 2
        assert launch["step_s"] > 0 and launch["sys_s"] > 0
    assert "| 1 MiB (GPU runs) | alone |" in proc.stdout


def test_head_loss_benchmark_runs_both_arms_to_the_same_loss(tmp_path):
    """benchmarks/head_loss.py at one round and tiny-opt's vocabulary: each case's two arms (whole logits, the output
    layer at the targets) report a time and a peak, on the targets the case names, at the same loss to rounding; no
    time is asserted."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "head_loss.py"),
        "--rounds",
        "1",
        "--vocabs",
        "4096",
        "--json",
        str(tmp_path / "head.json"),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    cases = json.loads((tmp_path / "head.json").read_text())["cases"]
    # 4 rows of 128 tokens: every token but the first of each row has a target; the last 42 of each row; the last 16
    targets = {"text": 4 * 127, "chat": 4 * 42, "grpo": 4 * 16}
    assert {name: c["targets"] for name, c in cases.items()} == {f"vocab 4096, {k}": v for k, v in targets.items()}
    for c in cases.values():
        whole, at = c["whole logits"], c["output layer at the targets"]
        assert whole["loss"] == pytest.approx(at["loss"], rel=1e-5) and whole["seconds"] > 0 and at["seconds"] > 0


def test_decode_step_benchmark_takes_a_decoding_step_apart(tmp_path):
    """benchmarks/decode_step.py on CPU at a few tokens: the ways (the forward alone, generate, the run's sampler, LoRA
    adapters beside the weights, the run's static-cache decoding, transformers' static-cache generate) each report a
    step's milliseconds and tokens/s, and the CUDA graph path says it needs CUDA; no time is asserted."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "decode_step.py"),
        "--model",
        "tiny-opt",
        "--new_tokens",
        "6",
        "--prompts",
        "2",
        "--prompt_length",
        "8",
        "--repeat",
        "1",
        "--json",
        str(tmp_path / "decode.json"),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "decode.json").read_text())
    ways = ["forward", "generate", "sampler", "sampler_lora", "static", "graphs", "hf_static"]
    assert list(report["ways"]) == ways and report["device"] == "cpu"
    assert report["ways"].pop("graphs") == {"skipped": "CUDA graphs need a CUDA device"}
    assert all(w["ms_per_step"] > 0 and w["tokens_per_s"] > 0 for w in report["ways"].values())
    assert (
        report["weights_read_ms_per_step"] is None
        and "| sampler_lora |" in proc.stdout
        and "| hf_static |" in proc.stdout
    )
