"""The data a chain trained on, pinned: an auto chain over a local jsonl file goes on when rows are appended after its
trained ranges, and refuses in one line, writing nothing, when a row inside them is edited or when the tokenizer
makes other token ids of them. The fingerprints are in the checkpoint and in the Hub index."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from conftest import assert_clean_failure, make_local_model, run_cli, sandbox_env, saved_names

from fsdp_opt.base import VERSION
from fsdp_opt.data.builtins import python_docs_texts
from fsdp_opt.data.pin import PIN_KEY


def _rows(path: Path, n: int = 150) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in python_docs_texts()[:n]))
    return path


def chain(model: str, data: Path, out: Path) -> list[str]:
    return [
        "--model",
        model,
        "--dataset",
        str(data),
        "--max_length",
        "64",
        "--batch_size",
        "4",
        "--num_epochs",
        "1",
        "--lr",
        "3e-3",
        "--start_idx",
        "auto",
        "--range_size",
        "60",
        "--output_dir",
        str(out),
    ]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_rows_appended_go_on_rows_edited_inside_a_trained_range_are_refused(tmp_path):
    data, out = _rows(tmp_path / "rows.jsonl"), tmp_path / "out"
    first = run_cli(chain("tiny-opt", data, out), tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    saved = torch.load(out / "tiny_opt_0-60-epoch-1.pt", weights_only=True)
    assert saved["fsdp_opt_version"] == VERSION
    pin = saved[PIN_KEY]
    assert pin["source"]["kind"] == "file" and pin["source"]["bytes"] == data.stat().st_size
    assert [(r["start"], r["end"]) for r in pin["ranges"]] == [(0, 60)] and len(pin["ranges"][0]["rows"]) == 32
    assert (pin["ranges"][0]["max_length"], pin["ranges"][0]["packing"]) == (64, "docs")

    with data.open("a") as f:  # a growing dataset: rows after the trained ranges
        f.write(json.dumps({"text": "A row added later, after every row the chain has trained on so far."}) + "\n")
    second = run_cli(chain("tiny-opt", data, out), tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "but the 1 range(s) it trained have the same rows: going on" in second.stdout
    assert saved_names(second.stdout) == ["tiny_opt_60-120-epoch-1.pt"]
    pin = torch.load(out / "tiny_opt_60-120-epoch-1.pt", weights_only=True)[PIN_KEY]
    assert [(r["start"], r["end"]) for r in pin["ranges"]] == [(0, 60), (60, 120)]
    assert pin["source"]["bytes"] == data.stat().st_size  # the source as the last session read it

    lines = data.read_text().splitlines()
    lines[70] = json.dumps({"text": "This row was edited after the chain trained on it, inside the range [60, 120)."})
    data.write_text("\n".join(lines) + "\n")
    before = _snapshot(out)
    third = run_cli(chain("tiny-opt", data, out), tmp_path)
    assert_clean_failure(
        third, f"--dataset {data}: rows [60, 120), trained by this chain, changed since", "Restore the data"
    )
    assert _snapshot(out) == before  # nothing written, the lease given back


def test_a_tokenizer_that_makes_other_ids_of_the_trained_rows_is_refused(tmp_path):
    model = make_local_model(tmp_path / "model")
    data, out = _rows(tmp_path / "rows.jsonl"), tmp_path / "out"
    first = run_cli(chain(str(model), data, out), tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    # the same model with a tokenizer that now puts a BOS first
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    raw = json.loads((model / "tokenizer.json").read_text())
    raw["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [tok.convert_tokens_to_ids("<s>")], "tokens": ["<s>"]}},
    }
    (model / "tokenizer.json").write_text(json.dumps(raw))
    assert AutoTokenizer.from_pretrained(model)("a")["input_ids"] != tok("a")["input_ids"]
    before = _snapshot(out)
    second = run_cli(chain(str(model), data, out), tmp_path)
    assert_clean_failure(second, f"--model {model}: its tokenizer makes other token ids of rows [0, 60)")
    assert _snapshot(out) == before
    shutil.rmtree(model)


def second_session_on_a_new_revision(server, args: list[str], tmp_path: Path) -> tuple[str, dict]:  # noqa: ANN001
    """me/rows gains a revision that rewrites row 5 (trained by the first session) and adds 20 rows; the chain's
    next session, on a fresh cache, trains rows [40, 80) without noticing. Returns the revision and that pin."""
    texts = python_docs_texts()
    edited = texts[:100]
    edited[5] = "This row of the dataset was rewritten in its second revision, after the chain trained on it."
    second_rev = server.commit_dataset("me/rows", {"data/train.jsonl": text_rows(edited + texts[100:120])})
    second = run_cli(args, tmp_path, env=sandbox_env(tmp_path, HF_ENDPOINT=server.url, HF_HOME=str(tmp_path / "h2")))
    assert second.returncode == 0, second.stderr[-2000:]
    assert (
        saved_names(second.stdout) == ["tiny_opt_40-80-epoch-1.pt"]
        and "is not what the chain recorded" not in second.stdout
    )
    return second_rev, torch.load(tmp_path / "out" / "tiny_opt_40-80-epoch-1.pt", weights_only=True)[PIN_KEY]


def text_rows(items: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in items).encode()


def test_a_hub_dataset_that_gains_a_revision_does_not_move_under_the_chain(tmp_path):
    """The loopback Hub serves a dataset's revisions. The chain records the revision its first session read; a new
    revision (a trained row edited, rows added) is not read by the next session, unless --dataset_revision asks for
    it, and then the edited trained range is refused."""
    from hubserver import HubServer

    texts = python_docs_texts()
    with HubServer() as server:
        first_rev = server.commit_dataset("me/rows", {"data/train.jsonl": text_rows(texts[:100])})
        env = sandbox_env(tmp_path, HF_ENDPOINT=server.url, HF_HUB_OFFLINE="0")
        args = chain("tiny-opt", Path("me/rows"), tmp_path / "out")
        args[args.index("--range_size") + 1] = "40"
        first = run_cli(args, tmp_path, env=env)
        assert first.returncode == 0, first.stderr[-2000:]
        pin = torch.load(tmp_path / "out" / "tiny_opt_0-40-epoch-1.pt", weights_only=True)[PIN_KEY]
        assert pin["source"] == {"kind": "hub", "id": "me/rows", "revision": first_rev}

        second_rev, pin = second_session_on_a_new_revision(server, args, tmp_path)
        assert pin["source"]["revision"] == first_rev != second_rev
        resolved = [r.path for r in server.requests if r.route == "dataset-resolve" and r.path.endswith(".jsonl")]
        assert resolved and all(first_rev in p for p in resolved[-2:])  # the second session read the first revision

        moved = run_cli(
            args + ["--dataset_revision", "main"],
            tmp_path,
            env=sandbox_env(tmp_path, HF_ENDPOINT=server.url, HF_HOME=str(tmp_path / "h3")),
        )
        assert_clean_failure(
            moved,
            "--dataset me/rows: rows [0, 40), trained by this chain, changed since",
            f"revision {first_rev}",
            f"now revision {second_rev}",
        )


def test_a_mixtures_hub_source_is_read_at_the_revision_the_chain_recorded(tmp_path):
    """A mixture of a loopback-Hub dataset and a local file: the pin records the Hub source's revision inside the
    mixture's; a new revision that rewrites a trained row is not read by the next session, which trains on."""
    from hubserver import HubServer

    texts = python_docs_texts()
    (tmp_path / "local.jsonl").write_bytes(text_rows(texts[200:300]))
    mix = tmp_path / "mix.yaml"
    mix.write_text("datasets:\n  - path: me/rows\n    weight: 3\n  - path: local.jsonl\n")
    with HubServer() as server:
        first_rev = server.commit_dataset("me/rows", {"data/train.jsonl": text_rows(texts[:100])})
        args = chain("tiny-opt", mix, tmp_path / "out")
        args[args.index("--range_size") + 1] = "40"
        first = run_cli(args, tmp_path, env=sandbox_env(tmp_path, HF_ENDPOINT=server.url, HF_HOME=str(tmp_path / "h1")))
        assert first.returncode == 0, first.stderr[-2000:]
        pin = torch.load(tmp_path / "out" / "tiny_opt_0-40-epoch-1.pt", weights_only=True)[PIN_KEY]
        assert pin["source"]["kind"] == "mixture" and pin["source"]["weights"] == [3, 1]
        assert pin["source"]["sources"][0]["identity"] == {"kind": "hub", "id": "me/rows", "revision": first_rev}

        second_rev, pin = second_session_on_a_new_revision(server, args, tmp_path)
        assert pin["source"]["sources"][0]["identity"]["revision"] == first_rev != second_rev
        resolved = [r.path for r in server.requests if r.route == "dataset-resolve" and r.path.endswith(".jsonl")]
        assert resolved and all(first_rev in p for p in resolved[-1:])  # the second session read the first revision
