"""A weighted mixture's definition (data/mixture.py): counts, row i, the ranges a slice reads, the length, the file."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from conftest import assert_clean_failure, read_jsonl, run_cli

from fsdp_opt.base import DataError
from fsdp_opt.data.mixture import (
    MixtureTable,
    counts,
    integer_weights,
    is_mixture_file,
    mixture_length,
    order,
    read_mixture,
    source_of,
    source_ranges,
)
from fsdp_opt.data.table import RowsTable

WEIGHT_LISTS = [(5, 3, 2), (1, 1), (7, 1), (1, 2, 3, 4, 5, 6, 7), (13, 1, 1), (1,), (97, 89)]


def test_the_worked_table_of_five_three_two():
    """Rows 0-9 of a 5:3:2 mixture of A, B, C, worked by hand from the definition (docs/data.md has this table)."""
    got = [source_of(i, (5, 3, 2)) for i in range(10)]
    assert got == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (2, 0), (0, 3), (1, 2), (0, 4), (2, 1)]
    assert counts(10, (5, 3, 2)) == [5, 3, 2]


def reference_source(i: int, weights) -> tuple[int, int]:  # noqa: ANN001
    """Row i by the recursive reading of the definition (not the code's walk): the first source takes row i when the
    ceiling of its share grows there; otherwise row i is row i - (the first source's rows so far) of the rest."""
    total, p = sum(weights), weights[0]
    before, after = -(-i * p // total), -(-(i + 1) * p // total)
    if after > before or len(weights) == 1:
        return 0, before
    j, row = reference_source(i - before, weights[1:])
    return j + 1, row


@pytest.mark.parametrize("weights", WEIGHT_LISTS)
def test_counts_are_the_row_by_row_assignment_and_keep_each_share(weights):
    n, total = len(weights), sum(weights)
    tally = [0] * n
    worst = 0.0
    for k in range(10_000):
        c = counts(k, weights)
        assert c == tally, k  # counts(k) is what rows 0..k-1, assigned one at a time, gave each source
        assert sum(c) == k
        worst = max(worst, max(abs(c[j] - k * weights[j] / total) for j in range(n)))
        # the first source's count in closed form: the ceiling of its share
        assert c[0] == -(-k * weights[0] // total)
        j, row = source_of(k, weights)
        assert row == tally[j] and (j, row) == reference_source(k, weights)
        tally[j] += 1
    assert worst <= n - 1 if n > 1 else worst == 0
    # one period of R rows gives each source exactly its weight
    for k in (0, 17, 9_999):
        assert counts(k + total, weights) == [c + p for c, p in zip(counts(k, weights), weights)]
    assert order(4_000, 4_100, weights) == [source_of(i, weights)[0] for i in range(4_000, 4_100)]


def test_integer_weights_scale_decimals_exactly():
    assert integer_weights([0.5, 0.3, 0.2]) == (5, 3, 2)
    assert integer_weights(["50", "30", "20"]) == (5, 3, 2)
    assert integer_weights([0.25, 1]) == (1, 4)
    assert integer_weights([Fraction(1, 3), Fraction(2, 3)]) == (1, 2)
    assert integer_weights([0.1, 0.7]) == (1, 7)  # not 0.1's binary value: the decimal as written
    assert integer_weights([3]) == (1,)
    with pytest.raises(ValueError):
        integer_weights([1, 0])


@pytest.mark.parametrize("weights", [(5, 3, 2), (1, 2, 3, 4, 5, 6, 7), (2, 1)])
def test_the_length_stops_at_the_first_source_used_up(weights):
    for sizes in (
        [50, 30, 20, 5, 5, 5, 5][: len(weights)],
        [1000, 3, 900, 7, 7, 7, 7][: len(weights)],
        [0] + [10] * (len(weights) - 1),
    ):
        brute = 0
        while all(c <= s for c, s in zip(counts(brute + 1, weights), sizes)) and brute < sum(sizes):
            brute += 1
        assert mixture_length(sizes, weights) == brute


class CountingTable(RowsTable):
    def __init__(self, name: str, n: int) -> None:
        super().__init__([{"text": f"{name}{i}", "id": i} for i in range(n)])
        self.read: list[tuple[int, int]] = []

    def rows(self, start, end, columns):  # noqa: ANN001, ANN201
        self.read.append((start, end))
        return super().rows(start, end, columns)


def test_a_range_reads_a_range_of_each_source_and_appended_rows_change_nothing_below():
    weights = integer_weights([0.5, 0.3, 0.2])
    tables = [CountingTable("a", 400), CountingTable("b", 500), CountingTable("c", 100)]
    mix = MixtureTable(tables, weights)
    assert len(mix) == 505  # c runs out first: its 100th row is row 504, its 101st would be row 505
    got = mix.rows(300, 364, ["text"])
    want = [{"text": f"{'abc'[j]}{row}"} for j, row in (source_of(i, weights) for i in range(300, 364))]
    assert got == want
    spans = [t.read for t in tables]
    assert spans == [[r] for r in source_ranges(300, 364, weights)]
    assert sum(b - a for ((a, b),) in spans) == 64
    assert mix.given(300, 364) == [b - a for a, b in source_ranges(300, 364, weights)]
    # a source that grows by appended rows: the same rows below the old length, and more of them
    longer = MixtureTable([CountingTable("a", 400), CountingTable("b", 500), CountingTable("c", 160)], weights)
    assert len(longer) == 800 and longer.rows(0, 505, ["text", "id"]) == mix.rows(0, 505, ["text", "id"])
    assert mix.rows(490, 600, ["text"]) == mix.rows(490, 505, ["text"])  # ends at the mixture's end


def write(tmp_path, name, text):  # noqa: ANN001, ANN201
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_file_in_trls_layout_with_weights(tmp_path):
    (tmp_path / "mine.jsonl").write_text('{"text": "x"}\n')
    file = write(
        tmp_path,
        "mix.yaml",
        """
datasets:
  - path: HuggingFaceTB/smoltalk
    name: all
    split: train
    data_files: null
    columns: [messages]
    weight: 5
  - path: openai/gsm8k
    name: main
    weight: 3
  - path: mine.jsonl
    weight: 2
streaming: false
""",
    )
    mix = read_mixture(file)
    assert mix.weights == (5, 3, 2)
    first, second, third = mix.sources
    assert (first.source.dataset, first.source.config, first.source.split, first.columns) == (
        "HuggingFaceTB/smoltalk",
        "all",
        "train",
        ("messages",),
    )
    assert second.source.config == "main" and second.weight == 3
    assert third.source.dataset == str(tmp_path / "mine.jsonl")
    assert third.record() == {"dataset": str(tmp_path / "mine.jsonl"), "weight": "2"}
    assert first.record() == {
        "dataset": "HuggingFaceTB/smoltalk",
        "config": "all",
        "weight": "5",
        "columns": ["messages"],
    }
    # TRL's file without weights: weight 1 each; JSON alike
    plain = write(tmp_path, "trl.json", json.dumps({"datasets": [{"path": "a/b"}, {"path": "c/d", "split": "x"}]}))
    assert is_mixture_file(plain) and read_mixture(plain).weights == (1, 1)
    rows = write(tmp_path, "rows.json", json.dumps([{"text": "a row"}]))
    assert not is_mixture_file(rows) and is_mixture_file(file)
    big = tmp_path / "big.json"  # a large .json file is a dataset: not read whole to find out
    big.write_text(json.dumps({"datasets": [{"path": "a/b"}], "pad": "x" * (1 << 20)}))
    assert not is_mixture_file(str(big))


@pytest.mark.parametrize(
    "text, needle",
    [
        ("datasets:\n  - path: a/b\nshuffle: true\n", "unknown key 'shuffle'"),
        ("datasets:\n  - path: a/b\n    fraction: 0.5\n", "source 1: unknown key 'fraction'"),
        ("datasets:\n  - path: a/b\n    weight: 0\n", "source 1 (a/b): weight 0 must be greater than 0"),
        ("datasets:\n  - path: a/b\n    weight: -2\n", "weight -2 must be greater than 0"),
        ("datasets:\n  - path: a/b\n    weight: lots\n", "weight 'lots' is not a number"),
        ("datasets:\n  - path: a/b\n    weight: true\n", "weight True is not a number"),
        ("datasets: []\n", "lists no source"),
        ("streaming: false\n", "lists no source"),
        ("datasets:\n  - name: main\n", "source 1 has no `path`"),
        ("datasets: [\n", "not a readable mixture file"),
        (
            "datasets:\n  - path: a/b\n    data_format: poem\n",
            "source 1 (a/b): data_format 'poem' is not one of auto, text",
        ),
        (
            "datasets:\n  - path: a/b\n    eval_split: train\n",
            "source 1 (a/b): eval_split train is the split it trains on",
        ),
        ("datasets:\n  - path: a/b\n    eval_split: [x]\n", "source 1 (a/b): eval_split must be a split's name"),
    ],
)
def test_a_bad_mixture_file_is_one_line_naming_it(tmp_path, text, needle):
    file = write(tmp_path, "mix.yaml", text)
    with pytest.raises(DataError) as err:
        read_mixture(file)
    line = str(err.value)
    assert line.startswith(f"--dataset {file}: ") and needle in line and "\n" not in line, line


TEXT = [
    "--model",
    "tiny-opt",
    "--max_length",
    "64",
    "--batch_size",
    "4",
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
    "--activation_checkpointing",
    "false",
]


def text_file(path, name: str, n: int, first: int = 0):  # noqa: ANN001, ANN201
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    path.write_text(
        "".join(
            json.dumps({"text": f"{name} row {i}: " + " ".join(words[(i * k) % 8] for k in range(1, 12)), "id": i})
            + "\n"
            for i in range(first, first + n)
        )
    )
    return path


def test_a_range_far_into_a_mixture_trains_as_a_file_of_its_rows_and_the_chain_keeps_the_definition(tmp_path):
    """5:3:2 written as decimals over three local files: rows [1,200, 1,264) train, step for step, as a file holding
    those 64 rows in the defined order (made here by the recursive reading). Then a chain of three --start_idx auto
    sessions, with rows appended to one source after the first, equals one straight run over the three ranges; a
    changed weight is then refused in one line."""
    data = tmp_path / "data"
    data.mkdir()
    sizes = {"a": 700, "b": 500, "c": 300}
    for name, n in sizes.items():
        text_file(data / f"{name}.jsonl", name, n)
    mix = data / "mix.yaml"
    mix.write_text(
        "datasets:\n" + "".join(f"  - path: {n}.jsonl\n    weight: {w}\n" for n, w in zip(sizes, ("0.5", "0.3", "0.2")))
    )
    start, end = 1_200, 1_264
    run = run_cli(
        TEXT
        + [
            "--dataset",
            str(mix),
            "--start_idx",
            str(start),
            "--end_idx",
            str(end),
            "--output_dir",
            str(tmp_path / "mix"),
        ],
        tmp_path,
        nproc=2,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    a, b = -(-start * 5 // 10), -(-end * 5 // 10)  # source a's rows in closed form: the ceiling of half
    assert f"data: mixture rows [1,200, 1,264), weights 5:3:2: 32 of {data / 'a.jsonl'} (rows [{a}, {b}))" in run.stdout
    rows = []
    for i in range(start, end):
        j, row = reference_source(i, (5, 3, 2))
        rows.append(json.loads((data / f"{'abc'[j]}.jsonl").read_text().splitlines()[row]))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ref = run_cli(
        TEXT + ["--dataset", str(tmp_path / "rows.jsonl"), "--output_dir", str(tmp_path / "ref")], tmp_path, nproc=2
    )
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-3000:]
    ours = [(r["step"], r["loss"], r["tokens"]) for r in read_jsonl(tmp_path / "mix" / "metrics.jsonl")]
    theirs = [(r["step"], r["loss"], r["tokens"]) for r in read_jsonl(tmp_path / "ref" / "metrics.jsonl")]
    assert ours == theirs and len(ours) >= 5

    # The chain: rows [0, 200) in a session, rows appended to c (the source that ended the mixture at 1,500 rows), the
    # next range; then the weights changed: refused, nothing written.
    chain = tmp_path / "chain"
    first = run_cli(
        TEXT + ["--dataset", str(mix), "--start_idx", "auto", "--range_size", "200", "--output_dir", str(chain)],
        tmp_path,
        nproc=2,
    )
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    with open(data / "c.jsonl", "a") as f:
        f.write(text_file(tmp_path / "more.jsonl", "c", 50, first=300).read_text())
    second = run_cli(
        TEXT + ["--dataset", str(mix), "--start_idx", "auto", "--range_size", "200", "--output_dir", str(chain)],
        tmp_path,
        nproc=2,
    )
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "the 1 range(s) it trained have the same rows: going on" in second.stdout
    assert "data: mixture rows [200, 400)" in second.stdout
    third = run_cli(
        TEXT + ["--dataset", str(mix), "--start_idx", "auto", "--range_size", "200", "--output_dir", str(chain)],
        tmp_path,
        nproc=2,
    )
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-3000:]
    # the three sessions are one straight run over the three ranges, bit for bit
    straight = run_cli(
        TEXT
        + [
            "--dataset",
            str(mix),
            "--start_idx",
            "auto",
            "--range_size",
            "200",
            "--session_ranges",
            "3",
            "--output_dir",
            str(tmp_path / "straight"),
        ],
        tmp_path,
        nproc=2,
    )
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-3000:]
    got = [(r["step"], r["loss"], r["slice"]) for r in read_jsonl(chain / "metrics.jsonl")]
    want = [(r["step"], r["loss"], r["slice"]) for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl")]
    assert got == want and {r[2] for r in got} == {"0-200", "200-400", "400-600"}, (got[:3], want[:3])
    mix.write_text(mix.read_text().replace("0.3", "0.4"))
    before = sorted(p.name for p in chain.iterdir())
    third = run_cli(
        TEXT + ["--dataset", str(mix), "--start_idx", "auto", "--range_size", "200", "--output_dir", str(chain)],
        tmp_path,
        nproc=2,
    )
    assert_clean_failure(
        third,
        f"--dataset {mix}: the mixture is not the one this chain trained on: its weights changed (5:3:2 -> 5:4:2)",
    )
    assert sorted(p.name for p in chain.iterdir()) == before
    # refused before the chain's lease is taken and before the data is described under the new weights
    assert not [l for l in third.stdout.splitlines() if l.startswith(("chain:", "data:"))], third.stdout


@pytest.mark.parametrize(
    "flags, text, needle",
    [
        (
            ["--dataset_config", "main"],
            "datasets:\n  - path: a.jsonl\n",
            "--dataset_config main: not beside a mixture file",
        ),
        (
            ["--dataset_split", "test"],
            "datasets:\n  - path: a.jsonl\n",
            "--dataset_split test: not beside a mixture file",
        ),
        (
            [],
            "datasets:\n  - path: a.jsonl\n  - path: nowhere.jsonl\n",
            "source 2 (nowhere.jsonl): no such file or folder",
        ),
        ([], "datasets:\n  - path: a.jsonl\n    weight: 0\n", "source 1 (a.jsonl): weight 0 must be greater than 0"),
        ([], "datasets:\n  - path: a.jsonl\n    columns: [body]\n", "source 1 ("),
        ([], "datasets: []\n", "lists no source"),
        (
            ["--eval_rows", "4", "--eval_split", "test"],
            "datasets:\n  - path: a.jsonl\n",
            "--eval_split test: not with a mixture",
        ),
    ],
)
def test_bad_mixtures_stop_in_one_line_before_anything_is_written(tmp_path, flags, text, needle):
    text_file(tmp_path / "a.jsonl", "a", 20)
    (tmp_path / "mix.yaml").write_text(text)
    proc = run_cli(
        TEXT + ["--dataset", str(tmp_path / "mix.yaml"), *flags, "--output_dir", str(tmp_path / "out")], tmp_path
    )
    assert_clean_failure(proc, needle)
    assert not (tmp_path / "out").exists()
