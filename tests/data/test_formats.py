"""Row formats: which format the columns say, the rows checked one by one, and the tokens that carry loss.

The expected targets are made here from the rules as the issue states them, with the tokenizer's own calls
(`tokenizer(...)`, `apply_chat_template(..., tokenize=True)`), never through fsdp_opt.data.tokens. TRL's SFTTrainer
is the peer: the tokens it trains on must be the ones trained here.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from conftest import ASSETS, make_chat_llama
from transformers import AutoTokenizer

from fsdp_opt.base import DataError
from fsdp_opt.data.blocks import IGNORE_INDEX, blocks_from, rows_to_blocks
from fsdp_opt.data.formats import RowSpec, resolve_spec, select_rows
from fsdp_opt.data.sources import load_rows
from fsdp_opt.data.tokens import CHATML, encode_rows, end_of_turn, generation_prompt, read_template

CHAT = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": "A mutable sequence."},
        {"role": "user", "content": "And a tuple?"},
        {"role": "assistant", "content": "An immutable one."},
    ],
    [{"role": "user", "content": "Name a loop."}, {"role": "assistant", "content": "for"}],
]
PAIRS = [("Question: what does len() return?\nAnswer:", " The number of items."), ("Say hi.", " hi")]


@pytest.fixture(scope="module")
def llama_tok(tmp_path_factory):
    """A tokenizer that adds a BOS, with a Llama-3-style chat template."""
    return AutoTokenizer.from_pretrained(make_chat_llama(tmp_path_factory.mktemp("chat") / "llama"))


@pytest.fixture(scope="module")
def opt_tok():
    tok = AutoTokenizer.from_pretrained(ASSETS)
    tok.chat_template = CHATML
    return tok


def _ids(tok, messages, generation_prompt=False):
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)["input_ids"])


def expected(tok, row, fmt):
    """(ids, target positions) by the stated rules."""
    if fmt == "text":
        ids = tok(row["text"])["input_ids"] + [tok.eos_token_id]
        return ids, set(range(1, len(ids)))
    if fmt == "prompt_completion" and isinstance(row["prompt"], str):
        ids = tok(row["prompt"] + row["completion"])["input_ids"] + [tok.eos_token_id]
        return ids, set(range(len(tok(row["prompt"])["input_ids"]), len(ids)))
    if fmt == "prompt_completion":
        ids = _ids(tok, row["prompt"] + row["completion"])
        return ids, set(range(len(_ids(tok, row["prompt"], True)), len(ids)))
    messages, targets = row["messages"], set()
    ids = _ids(tok, messages)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            targets |= set(range(len(_ids(tok, messages[:i], True)), len(_ids(tok, messages[: i + 1]))))
    return ids, targets


def rows_of(fmt):
    if fmt == "text":
        return [{"text": "A list is a mutable sequence."}, {"text": "Tuples are not."}]
    if fmt == "messages":
        return [{"messages": c} for c in CHAT]
    if fmt == "conversational":
        return [{"prompt": c[:-1], "completion": c[-1:]} for c in CHAT]
    return [{"prompt": p, "completion": c} for p, c in PAIRS]


@pytest.mark.parametrize("fmt", ["text", "prompt_completion", "messages", "conversational"])
@pytest.mark.parametrize("which", ["llama_tok", "opt_tok"])
def test_targets_follow_the_rules(fmt, which, request):
    tok = request.getfixturevalue(which)
    rows = rows_of(fmt)
    spec = RowSpec("prompt_completion" if fmt == "conversational" else fmt)
    enc = encode_rows(
        rows, spec, tok, train_on="completion" if fmt != "text" else "all", conversational=fmt == "conversational"
    )
    for k, row in enumerate(rows):
        ids, targets = expected(tok, row, spec.format)
        assert enc.ids[k] == ids
        got = set(range(1, len(ids))) if enc.targets is None else {t for t, f in enumerate(enc.targets[k]) if f}
        assert got == targets
    if which == "llama_tok":  # the BOS: the tokenizer's for text, the template's for conversations
        assert all(row[0] == tok.bos_token_id for row in enc.ids)
    if fmt in ("messages", "conversational"):  # every answer and its end-of-turn marker, nothing else
        answers = [m["content"] for c in CHAT for m in (c if fmt == "messages" else c[-1:]) if m["role"] == "assistant"]
        trained = "".join(tok.decode([t for t, f in zip(i, m) if f]) for i, m in zip(enc.ids, enc.targets))
        assert all(a in trained for a in answers) and "user" not in trained and "Be brief" not in trained


def test_train_on_all_keeps_the_ids_and_trains_every_token(llama_tok):
    rows = rows_of("messages")
    answers = encode_rows(rows, RowSpec("messages"), llama_tok, train_on="completion")
    every = encode_rows(rows, RowSpec("messages"), llama_tok, train_on="all")
    assert every.ids == answers.ids and every.targets is None and every.whole_rows


def test_formats_from_the_columns():
    assert resolve_spec(["text", "id"], "auto").format == "text"
    assert resolve_spec(["prompt", "completion"], "auto").format == "prompt_completion"
    assert resolve_spec(["messages"], "auto").format == "messages"
    assert resolve_spec(["q", "a"], "auto", prompt_column="q", completion_column="a").columns == ("q", "a")
    with pytest.raises(DataError, match="--data_format: the columns fit more than one format"):
        resolve_spec(["text", "messages"], "auto")
    assert resolve_spec(["text", "messages"], "messages").format == "messages"
    with pytest.raises(DataError, match="--messages_column messages: no such column"):
        resolve_spec(["text"], "messages")
    with pytest.raises(DataError, match="--text_column body: no such column"):
        resolve_spec(["a", "b"], "auto", text_column="body")


def _ds(rows):
    return datasets.Dataset.from_list(rows)


@pytest.mark.parametrize(
    "rows,column,needle",
    [
        (
            [
                {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
                {"messages": [{"role": "bot", "content": "q"}]},
            ],
            "messages",
            "row 1, column messages: message 0 has the unknown role 'bot'",
        ),
        (
            [{"messages": [{"role": "user", "content": "q"}]}],
            "messages",
            "row 0, column messages: the conversation has no assistant turn",
        ),
        (
            [
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "text", "text": "q"}],
                        },  # content parts, as vision sets have
                        {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
                    ]
                }
            ],
            "messages",
            "row 0, column messages: message 0's content is list, not a string",
        ),
        (
            [{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": None}],
            "prompt_completion",
            "row 1, column completion: expected a string",
        ),
        (
            [{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "x"}]}],
            "prompt_completion",
            "row 0, column completion: the completion has no assistant turn",
        ),
    ],
)
def test_bad_rows_name_the_row_and_the_column(rows, column, needle):
    ds = _ds(rows)
    with pytest.raises(DataError) as err:
        select_rows(ds, resolve_spec(ds.column_names, "auto"), 0, None)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_empty_completions_are_dropped_and_counted():
    ds = _ds(
        [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": ""}, {"prompt": "d", "completion": "e"}]
    )
    got = select_rows(ds, RowSpec("prompt_completion"), 0, None)
    assert [r["prompt"] for r in got.rows] == ["a", "d"] and got.indices == [0, 2] and got.empty == 1


def test_messages_need_a_template(tmp_path):
    tok = AutoTokenizer.from_pretrained(ASSETS)  # tiny-opt's tokenizer has none
    with pytest.raises(
        DataError, match="row 4, column messages: the tokenizer has no chat template.*--chat_template chatml"
    ):
        encode_rows(rows_of("messages"), RowSpec("messages"), tok, train_on="completion", indices=[4, 5])
    assert read_template("chatml", tok) == CHATML
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert read_template(str(tmp_path / "t.jinja"), tok) == "{{ messages[0]['content'] }}"
    with pytest.raises(DataError, match="--chat_template nope.jinja: no such file"):
        read_template("nope.jinja", tok)


def test_renderings_that_are_not_prefixes_are_refused(opt_tok):
    # A template that writes the turn count first renders each prefix differently from the whole.
    tok = AutoTokenizer.from_pretrained(ASSETS)
    tok.chat_template = "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(DataError, match="row 0, column messages: the chat template's renderings .* not prefixes"):
        encode_rows(rows_of("messages"), RowSpec("messages"), tok, train_on="completion")


def test_whole_rows_are_cut_not_split_and_the_cut_is_counted(opt_tok):
    rows = rows_of("messages")
    enc = encode_rows(rows, RowSpec("messages"), opt_tok, train_on="completion")
    long_len = len(enc.ids[0])
    limit = long_len - 5  # the first conversation loses its last 5 tokens, all answer tokens
    blocks = blocks_from(enc, limit, opt_tok.pad_token_id, "docs")
    assert blocks.fit.rows == 2 and blocks.fit.cut == 1 and blocks.fit.dropped == 0
    assert blocks.fit.targets == sum(map(sum, enc.targets)) and blocks.fit.targets_lost == 5
    # no piece starts mid-row: every document starts with the template's first token
    starts = blocks.input_ids[blocks.positions == 0]
    assert set(starts.tolist()) <= {enc.ids[0][0], opt_tok.pad_token_id}
    # a row whose question alone is longer than the limit keeps no answer token: dropped, and counted
    talk = [{"messages": CHAT[1]}, {"messages": [{"role": "user", "content": "word " * 80}, CHAT[1][1]]}]
    enc = encode_rows(talk, RowSpec("messages"), opt_tok, train_on="completion")
    blocks = blocks_from(enc, len(enc.ids[0]), opt_tok.pad_token_id, "pad")
    assert (blocks.fit.cut, blocks.fit.dropped, len(blocks)) == (1, 1, 1)
    assert blocks.input_ids[0].tolist() == enc.ids[0]


@pytest.mark.parametrize("packing", ["docs", "concat", "pad"])
def test_the_targets_travel_with_their_tokens(opt_tok, packing):
    ds = load_rows("python-docs-chat")
    spec = resolve_spec(ds.column_names, "auto")
    rows = select_rows(ds, spec, 0, 24)
    enc = encode_rows(rows.rows, spec, opt_tok, train_on="completion")
    blocks = rows_to_blocks(rows, spec, opt_tok, train_on="completion", max_length=512, packing=packing)
    batch = blocks.batch(torch.arange(len(blocks)), torch.device("cpu"))
    labels = batch["labels"][:, 1:]  # a block's first label is never predicted
    trained = labels[labels != IGNORE_INDEX]
    want = [t for ids, m in zip(enc.ids, enc.targets) for t, f in zip(ids, m) if f]
    if packing == "concat":  # a block's first token has no earlier token to be predicted from
        firsts = [int(blocks.input_ids[k, 0]) for k in range(len(blocks)) if bool(blocks.targets[k, 0])]
        assert sorted(trained.tolist() + firsts) == sorted(want)
    else:
        assert sorted(trained.tolist()) == sorted(want)  # the same answer tokens, each once
    # and the count the loss is normalised by
    predicted = (labels != IGNORE_INDEX).sum()
    assert int(blocks.target_counts().sum()) == int(predicted)


def test_generation_prompts_and_the_end_of_turn(opt_tok, llama_tok):
    row = {"messages": CHAT[0]}
    prompt, rendered, answer = generation_prompt(row, RowSpec("messages"), opt_tok)
    assert rendered and answer == "A mutable sequence." and prompt.endswith("<|im_start|>assistant\n")
    assert "What is a list?" in prompt and "tuple" not in prompt
    assert end_of_turn(opt_tok) == "<|im_end|>" and end_of_turn(llama_tok) == "<|eot_id|>"
    assert generation_prompt({"prompt": "p", "completion": "c"}, RowSpec("prompt_completion"), opt_tok) == (
        "p",
        False,
        "c",
    )


@pytest.mark.parametrize("fmt", ["prompt_completion", "messages"])
def test_trl_trains_the_same_tokens(fmt, opt_tok, tmp_path):
    """TRL's SFTTrainer on the same rows: completion_only_loss for prompt-completion, assistant_only_loss with the
    built-in chatml template, whose {% generation %} markers cover what this project trains."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    rows = (
        rows_of(fmt)
        + [{"messages": m} for m in [r["messages"] for r in load_rows("python-docs-chat").rows(0, 6, ["messages"])]]
        if fmt == "messages"
        else rows_of(fmt)
    )
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=4096,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    flags = {"completion_only_loss": True} if fmt == "prompt_completion" else {"assistant_only_loss": True}
    args = SFTConfig(output_dir=str(tmp_path), report_to=[], max_length=None, use_cpu=True, bf16=False, **flags)
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=opt_tok
    )
    enc = encode_rows(rows, RowSpec(fmt), opt_tok, train_on="completion")
    for k, theirs in enumerate(trainer.train_dataset):
        assert theirs["input_ids"] == enc.ids[k]
        assert [lab != IGNORE_INDEX for lab in theirs["labels"]] == enc.targets[k]


@pytest.mark.parametrize("suffix", ["jsonl", "json", "parquet"])
def test_local_files_of_every_kind_hold_conversations(tmp_path, suffix):
    ds = _ds([{"messages": c} for c in CHAT])
    path = tmp_path / f"rows.{suffix}"
    if suffix == "parquet":
        ds.to_parquet(str(path))
    else:
        ds.to_json(str(path), lines=suffix == "jsonl")
    loaded = load_rows(str(path))
    spec = resolve_spec(loaded.column_names, "auto")
    assert spec.format == "messages"
    assert [r["messages"] for r in select_rows(loaded, spec, 0, None).rows] == CHAT
