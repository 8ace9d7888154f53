"""Datasets named as the Hub names them, read a range at a time, against the loopback Hub serving repos laid out as
the Hub lays them (tests/hubdata.py: a card's `configs:` YAML, parquet shards of many row groups, LFS objects, HTTP
Range answered with 206), with the real huggingface_hub and datasets clients.

The large repo is UltraChat-like: splits train_sft (300,000 rows in 6 shards of 50 row groups) and test_sft, no
train split."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import (
    ROOT,
    assert_clean_failure,
    built_once,
    hub_env,
    launch,
    read_jsonl,
    run_cli,
    run_cli_concurrently,
    saved_names,
)
from hubdata import chat_row, jsonl_bytes, make_chat_repo, make_two_config_repo, repo_files, text_row
from hubserver import HubServer

TRAIN_ROWS, SHARDS, ROW_GROUP = 300_000, 6, 1_000
PER_SHARD = TRAIN_ROWS // SHARDS
WORKER = str(ROOT / "tests" / "workers" / "hub_rows.py")
TRAIN = [
    "--chat_template",
    "chatml",
    "--max_length",
    "128",
    "--batch_size",
    "2",
    "--lr",
    "3e-3",
    "--precision",
    "fp32",
    "--num_epochs",
    "1",
    "--wandb_mode",
    "disabled",
    "--seed",
    "3",
]


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> Path:
    """The repos' folders, made once for both test workers."""

    def build(root: Path) -> None:
        make_chat_repo(root / "chat", TRAIN_ROWS, 400, SHARDS, ROW_GROUP)
        make_two_config_repo(root / "configs", 120)
        rows = [text_row(i) for i in range(300)]
        (root / "json").mkdir()
        (root / "json" / "train.jsonl").write_bytes(jsonl_bytes(rows))
        # the Hub's export of it: the same rows in order, in two files of the export's layout
        (root / "export" / "default" / "train").mkdir(parents=True)
        for k, part in enumerate((rows[:180], rows[180:])):
            pq.write_table(
                pa.Table.from_pylist(part),
                root / "export" / "default" / "train" / f"{k:04d}.parquet",
                row_group_size=50,
            )
        (root / "partial" / "default" / "partial-train").mkdir(parents=True)
        pq.write_table(
            pa.Table.from_pylist(rows[:100]), root / "partial" / "default" / "partial-train" / "0000.parquet"
        )

    return built_once(tmp_path_factory, "hub_ranges_repos", build)


@pytest.fixture(scope="module")
def hub(repos):
    with HubServer() as server:
        server.commit_dataset("me/chat", repo_files(repos / "chat"))
        server.commit_dataset("me/configs", repo_files(repos / "configs"))
        for name, export in (("me/json", "export"), ("me/json-partial", "partial")):
            server.commit_dataset(name, {"data/train.jsonl": (repos / "json" / "train.jsonl").read_bytes()})
            server.commit_dataset(name, repo_files(repos / export), branch="refs/convert/parquet")
        yield server


def env_for(tmp: Path, hub: HubServer, name: str) -> dict[str, str]:
    env = hub_env(tmp, hub, name)  # an empty Hugging Face cache for each
    env["WANDB_MODE"] = "disabled"
    return env


def rows_of(
    tmp: Path, hub: HubServer, name: str, dataset: str, config: str, split: str, *ranges: str, reference: bool = True
) -> dict:
    env = env_for(tmp, hub, name)
    if not reference:
        env["FSDP_OPT_NO_REFERENCE"] = "1"
    out = tmp / f"{name}.json"
    proc = launch([WORKER], [str(out), dataset, config, split, *ranges], tmp, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()) | {"stdout": proc.stdout, "stderr": proc.stderr}


def test_rows_read_by_range_are_load_datasets_rows(tmp_path, hub):
    """Inside a file, across a file boundary, and at the end of the split: row for row what datasets.load_dataset
    gives for the whole split. The index has every file's row groups, and each file's LFS sha256 from the listing."""
    got = rows_of(
        tmp_path,
        hub,
        "rows",
        "me/chat",
        "-",
        "train_sft",
        "10000:10040",
        f"{PER_SHARD - 20}:{PER_SHARD + 20}",
        f"{TRAIN_ROWS - 30}:{TRAIN_ROWS}",
    )
    assert got["rows"] == TRAIN_ROWS and got["columns"] == ["prompt_id", "messages"]
    for spec, entry in got["ranges"].items():
        a, b = (int(x) for x in spec.split(":"))
        assert entry["ours"] == entry["theirs"], spec
        assert [r["prompt_id"] for r in entry["ours"]] == [f"train_sft-{i}" for i in range(a, b)]  # the rows made
    identity = got["identity"]
    files = identity["index"]["files"]
    assert [f["name"] for f in files] == [f"data/train_sft-{k:05d}-of-{SHARDS:05d}.parquet" for k in range(SHARDS)]
    assert all(f["row_groups"] == [ROW_GROUP] * (PER_SHARD // ROW_GROUP) for f in files)
    lfs = hub.datasets["me/chat"].lfs_paths()
    assert {f["name"]: f["key"] for f in files} == {f["name"]: lfs[f["name"]] for f in files}
    assert (
        identity["kind"] == "hub"
        and identity["revision"] == hub.datasets["me/chat"].sha
        and identity["split"] == "train_sft"
    )


def test_a_short_range_far_into_the_split_trains_fetching_a_tenth_and_equals_the_same_rows_from_a_file(
    tmp_path, hub, det_model
):
    """An empty cache, rows [250,000, 250,040) of train_sft: the session fetches a small share of the dataset's
    bytes (all of them before this), and trains exactly as the same rows written to a local file do."""
    start, end = 250_000, 250_040
    before = dict(hub.sent)
    args = [
        "--model",
        str(det_model),
        "--dataset",
        "me/chat",
        "--dataset_split",
        "train_sft",
        "--start_idx",
        str(start),
        "--end_idx",
        str(end),
        "--eval_rows",
        "16",
        "--eval_split",
        "test_sft",
        *TRAIN,
    ]
    far = tmp_path / "far"
    far.mkdir()
    proc = run_cli(args + ["--output_dir", str(far / "out")], far, nproc=2, env=env_for(tmp_path, hub, "far"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    fetched = sum(hub.sent.get(k, 0) - before.get(k, 0) for k in hub.sent if k.startswith("dataset"))
    total = hub.dataset_bytes("me/chat")
    print(f"fetched {fetched:,} of {total:,} bytes ({fetched / total:.1%})")
    assert fetched <= 0.10 * total, (fetched, total)
    assert f"data: rows [{start:,}, {end:,}) of me/chat (split train_sft): 40 rows in " in proc.stdout
    assert "eval at step" in proc.stdout and "on rows [0, 16) of split test_sft" in proc.stdout

    # The same rows, made again here and written to a file: the same losses, step for step.
    local = tmp_path / "local"
    local.mkdir()
    (local / "rows.jsonl").write_bytes(jsonl_bytes([chat_row(i) for i in range(start, end)]))
    ref = run_cli(
        [
            "--model",
            str(det_model),
            "--dataset",
            str(local / "rows.jsonl"),
            "--start_idx",
            "0",
            "--end_idx",
            str(end - start),
            *TRAIN,
            "--output_dir",
            str(local / "out"),
        ],
        local,
        nproc=2,
    )
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-3000:]
    ours = [(r["step"], r["loss"], r["tokens"]) for r in read_jsonl(far / "out" / "metrics.jsonl")]
    theirs = [(r["step"], r["loss"], r["tokens"]) for r in read_jsonl(local / "out" / "metrics.jsonl")]
    assert ours == theirs and len(ours) >= 3


def test_a_dataset_with_two_configs_and_no_default_names_them_and_trains_with_one(tmp_path, hub):
    """The config named is the one trained: its steps are those of a run on its own rows written to a file (beta's
    rows are not alpha's: a run that read another config would not match)."""
    common = [
        "--model",
        "tiny-opt",
        "--max_length",
        "64",
        "--end_idx",
        "24",
        "--precision",
        "fp32",
        "--batch_size",
        "2",
        "--wandb_mode",
        "disabled",
    ]
    base = ["--dataset", "me/configs", *common]
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    (tmp_path / "c" / "beta.jsonl").write_bytes(jsonl_bytes([text_row(i + 100_000) for i in range(24)]))
    missing, chosen, alone = run_cli_concurrently(
        [
            (base + ["--output_dir", str(tmp_path / "a" / "out")], tmp_path / "a", env_for(tmp_path, hub, "a")),
            (
                base + ["--dataset_config", "beta", "--output_dir", str(tmp_path / "b" / "out")],
                tmp_path / "b",
                env_for(tmp_path, hub, "b"),
            ),
            (
                ["--dataset", str(tmp_path / "c" / "beta.jsonl"), *common, "--output_dir", str(tmp_path / "c" / "out")],
                tmp_path / "c",
                None,
            ),
        ]
    )
    assert_clean_failure(missing, "--dataset me/configs", "2 configs and no default", "--dataset_config (alpha, beta)")
    assert not (tmp_path / "a" / "out").exists()
    assert chosen.returncode == 0, chosen.stdout[-2000:] + chosen.stderr[-3000:]
    assert alone.returncode == 0, alone.stdout[-2000:] + alone.stderr[-3000:]
    assert saved_names(chosen.stdout) == ["tiny_opt_0-24-epoch-1.pt"]
    steps = [
        [(r["step"], r["loss"], r["tokens"]) for r in read_jsonl(tmp_path / d / "out" / "metrics.jsonl")] for d in "bc"
    ]
    assert steps[0] == steps[1] and len(steps[0]) >= 3


BAD = [
    (
        ["--dataset", "me/configs", "--dataset_config", "gamma"],
        ["--dataset_config gamma", "no such config", "alpha, beta"],
    ),
    (["--dataset", "me/chat"], ["--dataset_split train", "no such split", "test_sft, train_sft"]),
    (
        [
            "--dataset",
            "me/chat",
            "--dataset_split",
            "train_sft",
            "--start_idx",
            str(TRAIN_ROWS),
            "--end_idx",
            str(TRAIN_ROWS + 10),
        ],
        [f"--start_idx {TRAIN_ROWS}", "past the end", f"{TRAIN_ROWS} rows"],
    ),
    (["--dataset", "me/nope"], ["--dataset me/nope", "no such dataset"]),
    (
        ["--dataset", "me/chat", "--dataset_split", "train_sft", "--eval_rows", "4", "--eval_split", "valid"],
        ["--dataset_split valid", "no such split"],
    ),
]


def test_bad_names_and_ranges_are_one_line_and_write_nothing(tmp_path, hub):
    """Each bad name or range is one line naming the flag and what there is. Nothing is written. (A Hub that cannot
    be reached, from an empty cache: tests/commands/test_cli.py::test_unreachable_hub_ids_say_so_and_point_to_builtins.)"""
    runs = []
    for i, (extra, _) in enumerate(BAD):
        folder = tmp_path / f"case{i}"
        folder.mkdir()
        runs.append(
            (
                ["--model", "tiny-opt", "--output_dir", str(folder / "out"), "--chat_template", "chatml", *extra],
                folder,
                env_for(tmp_path, hub, f"case{i}"),
            )
        )
    for (extra, needles), proc, (_, folder, _) in zip(BAD, run_cli_concurrently(runs, timeout=180), runs):
        line = assert_clean_failure(proc, *needles)
        assert proc.returncode == 2, line
        assert not (folder / "out").exists(), extra


def test_a_json_dataset_is_read_from_its_parquet_export_and_a_partial_export_downloads_it_whole(tmp_path, hub):
    exported = rows_of(tmp_path, hub, "export", "me/json", "-", "train", "170:190", "290:300")
    assert exported["identity"]["export"] is True
    assert "reading its split train from the Hub's parquet export" in exported["stdout"]
    for spec, entry in exported["ranges"].items():
        assert entry["ours"] == entry["theirs"], spec  # the JSON file's rows, as load_dataset reads it
    whole = rows_of(tmp_path, hub, "partial", "me/json-partial", "-", "train", "170:190", reference=False)
    size = len(hub.datasets["me/json-partial"].tree["data/train.jsonl"].content)
    assert (
        f"data: me/json-partial is stored as json, with no complete parquet export on the Hub to read ranges from: "
        f"its split train is downloaded whole (1 file(s), {size / 2**20:.1f} MiB)"
    ) in whole["stdout"]
    assert whole["ranges"]["170:190"]["ours"] == [text_row(i) for i in range(170, 190)]


def test_three_fresh_sessions_of_an_auto_chain_equal_one_straight_run_and_read_the_chains_index(tmp_path, hub):
    """--start_idx auto over train_sft, three sessions on empty caches through a Hub repo: the names and the losses
    of one session that trains the three ranges, bit for bit. Sessions 2 and 3 take the split's index from the chain
    and read neither the card nor the footers of files their rows are not in."""
    auto = [
        "--model",
        "tiny-opt",
        "--dataset",
        "me/chat",
        "--dataset_split",
        "train_sft",
        "--start_idx",
        "auto",
        "--range_size",
        "12",
        *TRAIN,
    ]
    saved, requests = [], []
    for i in range(3):
        machine = tmp_path / f"m{i}"
        machine.mkdir()
        mark = len(hub.requests)
        proc = run_cli(
            auto + ["--hf_repo", "me/chain", "--output_dir", str(machine / "out")],
            machine,
            nproc=2,
            env=env_for(tmp_path, hub, f"m{i}"),
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        saved += saved_names(proc.stdout)
        requests.append([r for r in hub.requests[mark:] if r.route.startswith("dataset")])
    one = tmp_path / "one"
    one.mkdir()
    straight = run_cli(
        auto + ["--session_ranges", "3", "--output_dir", str(one / "out")],
        one,
        nproc=2,
        env=env_for(tmp_path, hub, "one"),
    )
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-3000:]
    assert saved == saved_names(straight.stdout) == [f"tiny_opt_{a}-{a + 12}-epoch-1.pt" for a in (0, 12, 24)]
    got = [(r["step"], r["loss"], r["slice"]) for r in read_jsonl(tmp_path / "m2" / "out" / "metrics.jsonl")]
    want = [(r["step"], r["loss"], r["slice"]) for r in read_jsonl(one / "out" / "metrics.jsonl")]
    assert got == want
    first = f"data/train_sft-00000-of-{SHARDS:05d}.parquet"
    assert any(r.path.endswith("/README.md") for r in requests[0])  # the first session resolved the split
    for later in requests[1:]:
        files = {r.path.split("/resolve/", 1)[1].split("/", 1)[1] for r in later if "/resolve/" in r.path}
        assert files == {first}, files


# datasets' fingerprint of an in-memory table hashes its Python objects; on one platform's package set (Python 3.12.3,
# pandas 3.0.6, datasets 5.2.0) that raised for every table built with Dataset.from_dict. A shim on PYTHONPATH makes
# it raise here the same way, in every process of a run.
UNHASHABLE = """
import pickle

import datasets.arrow_dataset
import datasets.fingerprint


def _cannot(*args, **kwargs):
    raise pickle.PicklingError("Can't pickle <class 'MonthDayNano'>: it's not found as pyarrow.lib.MonthDayNano")


datasets.fingerprint.generate_fingerprint = _cannot
datasets.arrow_dataset.generate_fingerprint = _cannot
"""


def test_runs_train_where_datasets_cannot_fingerprint_a_table(tmp_path, hub):
    """The built-in rows (built here, never a datasets table), a local JSON file (datasets' loader, fingerprinted from
    its files) and a Hub split read by range (parquet, no datasets table) all train with the fingerprint raising."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(UNHASHABLE)
    local = tmp_path / "rows.jsonl"
    local.write_bytes(jsonl_bytes([text_row(i) for i in range(24)]))
    common = [
        "--model",
        "tiny-opt",
        "--max_length",
        "64",
        "--end_idx",
        "16",
        "--batch_size",
        "2",
        "--wandb_mode",
        "disabled",
    ]
    cases = {
        "builtin": ["--dataset", "python-docs-chat", "--chat_template", "chatml"],
        "prefs": ["--dataset", "python-docs-prefs", "--method", "dpo", "--chat_template", "chatml"],
        "file": ["--dataset", str(local)],
        "hub": ["--dataset", "me/configs", "--dataset_config", "beta"],
    }
    runs = []
    for name, extra in cases.items():
        (tmp_path / name).mkdir()
        env = env_for(tmp_path, hub, name)
        env["PYTHONPATH"] = f"{shim}{os.pathsep}{env['PYTHONPATH']}"
        runs.append(([*extra, *common, "--output_dir", str(tmp_path / name / "out")], tmp_path / name, env))
    probe = subprocess.run(
        [sys.executable, "-c", "import datasets; datasets.Dataset.from_dict({'a': [1]})"],
        env=runs[0][2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode != 0 and "MonthDayNano" in probe.stderr  # the shim is in force
    for name, proc in zip(cases, run_cli_concurrently(runs, timeout=300)):
        assert proc.returncode == 0, (name, proc.stdout[-2000:] + proc.stderr[-3000:])
        assert (tmp_path / name / "out" / "metrics.jsonl").is_file(), name


def test_a_mixture_of_hub_splits_and_a_local_file_trains_a_range_far_into_it_fetching_a_range(tmp_path, hub):
    """Weights 500:1:1 over two Hub parquet splits (300,000 and 400 rows) and a local file: rows [150,000, 150,064)
    of the mixture need about 64 rows of train_sft near row 149,400, which its row groups hold; the session fetches
    a small share of the dataset's bytes and says what each source gave."""
    local = tmp_path / "local.jsonl"
    local.write_bytes(jsonl_bytes([chat_row(i, "local") for i in range(500)]))
    mix = tmp_path / "mix.json"
    mix.write_text(
        json.dumps(
            {
                "datasets": [
                    {"path": "me/chat", "split": "train_sft", "columns": ["messages"], "weight": 500},
                    {"path": "me/chat", "split": "test_sft", "columns": ["messages"], "weight": 1},
                    {"path": str(local), "columns": ["messages"], "weight": 1},
                ]
            }
        )
    )
    before = dict(hub.sent)
    args = [
        "--model",
        "tiny-opt",
        "--dataset",
        str(mix),
        "--start_idx",
        "150000",
        "--end_idx",
        "150064",
        *TRAIN,
        "--output_dir",
        str(tmp_path / "out"),
    ]
    proc = run_cli(args, tmp_path, nproc=2, env=env_for(tmp_path, hub, "mix"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    fetched = sum(hub.sent.get(k, 0) - before.get(k, 0) for k in hub.sent if k.startswith("dataset"))
    total = hub.dataset_bytes("me/chat")
    assert fetched <= 0.10 * total, (fetched, total)
    # 500:1:1 in closed form: train_sft gives the ceiling of 500/502 of the rows before a row
    a, b = -(-150_000 * 500 // 502), -(-150_064 * 500 // 502)
    assert (
        f"data: mixture rows [150,000, 150,064), weights 500:1:1: {b - a} of me/chat (split train_sft) (rows [{a:,}, {b:,}))"
        in proc.stdout
    )
    assert len(read_jsonl(tmp_path / "out" / "metrics.jsonl")) >= 3
