"""The tokenizer inside a GGUF, whole, as llama.cpp reads it: the model kind (byte-level BPE: `gpt2`; SentencePiece-
style BPE with byte fallback: `llama`), every token with its type, the merges (BPE) or scores (SentencePiece), the
pre-tokenizer by the name llama.cpp knows it by, the special ids, whether a BOS (or EOS) is added, and the chat
template.

The pre-tokenizer's name is read off the tokenizer's own definition (its split regex), not guessed from a hash: a
tokenizer whose split llama.cpp has no name for is refused in one line. Facts from llama.cpp's vocabulary loader:
`gpt-2` is the GPT-2 byte-level split, `llama-bpe` Llama 3's (digits in threes), `qwen2` Qwen2's (digits one by
one), `smollm` GPT-2's with every digit apart; token types 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
6 byte.
"""

from __future__ import annotations

import json
import re
from typing import Any

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from fsdp_opt.base import ConfigError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The split regexes as tokenizer.json writes them, and llama.cpp's names for them.
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}


def backend(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The tokenizer.json of a fast tokenizer, as a dict."""
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            "--gguf: the tokenizer has no tokenizer.json (a fast tokenizer): GGUF needs its full definition"
        )
    return json.loads(tokenizer.backend_tokenizer.to_str())


def kind(spec: dict[str, Any]) -> str:
    """`gpt2` (byte-level BPE) or `llama` (SentencePiece-style BPE over characters, with byte fallback)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ConfigError(f"--gguf: a {model.get('type')} tokenizer is not written here (only BPE tokenizers)")
    return "llama" if model.get("byte_fallback") else "gpt2"


def pre_tokenizer_name(spec: dict[str, Any]) -> str:
    """llama.cpp's name for this tokenizer's split (byte-level BPE); ConfigError when it has none."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    types = [s.get("type") for s in steps]
    if types == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if types == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if types == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        if pattern in SPLITS:
            return SPLITS[pattern]
    raise ConfigError(
        f"--gguf: this tokenizer's pre-tokenizer ({' + '.join(map(str, types)) or 'none'}) is not one llama.cpp has a "
        "name for here (gpt-2, llama-bpe, qwen2, smollm): use the Hugging Face folder"
    )


def _merge_text(merge: Any) -> str:
    return merge if isinstance(merge, str) else " ".join(merge)


def token_table(
    tokenizer: PreTrainedTokenizerBase, spec: dict[str, Any], n_vocab: int
) -> tuple[list[str], list[int], list[float] | None]:
    """(tokens, types, scores or None) for every row of the embedding: ids the tokenizer lacks are `[PAD{i}]`, unused.
    SentencePiece-style scores rank a token by the merge that makes it (earlier merges first), as SentencePiece's own
    BPE pieces are ordered."""
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    spm = kind(spec) == "llama"
    rank: dict[str, int] = {}
    if spm:
        for i, merge in enumerate(spec["model"].get("merges", [])):
            rank.setdefault(_merge_text(merge).replace(" ", ""), i)
    tokens, types, scores = [], [], []
    unk = spec["model"].get("unk_token")
    for i in range(n_vocab):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            scores.append(-1e9)
            continue
        tokens.append(text)
        if i in added:
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        elif spm and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
            types.append(BYTE)
        elif text == unk:
            types.append(UNKNOWN)
        else:
            types.append(NORMAL)
        scores.append(-float(rank[text]) if text in rank else 0.0)
    return tokens, types, (scores if spm else None)


def adds(tokenizer: PreTrainedTokenizerBase) -> tuple[bool, bool]:
    """Whether the tokenizer puts a BOS first and an EOS last on a plain text."""
    ids = tokenizer("a")["input_ids"]
    bos = tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id
    eos = tokenizer.eos_token_id is not None and bool(ids) and ids[-1] == tokenizer.eos_token_id
    return bos, eos


def space_prefix(spec: dict[str, Any]) -> bool:
    """A SentencePiece-style tokenizer that puts ▁ before a text (Llama 2, Mistral; not Gemma)."""
    text = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")])
    return '"Prepend"' in text or ('"Metaspace"' in text and '"prepend_scheme": "never"' not in text)


def space_prefix_note(spec: dict[str, Any]) -> str | None:
    """The line that says where llama.cpp tokenizes this tokenizer's text differently (None: nowhere known). llama.cpp
    puts ▁ before every stretch of text, at the start and after each special token, whether or not it begins with a
    space (as SentencePiece and a Prepend normalizer do); a Metaspace pre-tokenizer puts none before a text that
    begins with a space, and with prepend_scheme `first` none after a special token either. No GGUF key changes it."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    meta = next((s for s in steps if s.get("type") == "Metaspace"), None)
    if meta is None:
        return None
    scheme = meta.get("prepend_scheme") or ("always" if meta.get("add_prefix_space", True) else "never")
    where = {
        "first": "after a special token or before a text that begins with a space",
        "always": "before a text that begins with a space",
    }.get(scheme)
    if where is None:
        return None
    return (
        f"gguf: note: llama.cpp puts \u2581 before every stretch of text; this tokenizer (Metaspace, prepend_scheme "
        f"{scheme}) puts none {where}, so such text tokenizes differently in llama.cpp than in transformers"
    )


# llama.cpp makes its special tokens strip whitespace by the model's name alone (general.name): with "phi3" or
# "phi-3" in it, every special token strips the whitespace after it, but these three, as Phi-3's tokenizer.json has
# it; it fails to load such a file without these tokens and </s>. No other name strips anything.
PHI3_NAMES = ("phi3", "phi-3")
PHI3_UNSTRIPPED = ("<unk>", "<s>", "<|endoftext|>")


def stripping(spec: dict[str, Any], tokens: list[str]) -> tuple[bool, str | None]:
    """(whether llama.cpp strips as this tokenizer does only under a Phi-3 name, the note for tokens whose stripping
    llama.cpp cannot give: None when it can)."""
    added = {a["content"]: a for a in spec.get("added_tokens", [])}
    stripped = {t for t, a in added.items() if a.get("rstrip") or a.get("lstrip")}
    if not stripped:
        return False, None
    phi3 = (
        set(PHI3_UNSTRIPPED + ("</s>",)) <= set(tokens)
        and not any(a.get("lstrip") for a in added.values())
        and all(bool(a.get("rstrip")) == (t not in PHI3_UNSTRIPPED) for t, a in added.items())
    )
    if phi3:
        return True, None
    return False, (
        f"gguf: note: {', '.join(sorted(stripped))} take the whitespace beside them in transformers (lstrip/rstrip); "
        "llama.cpp does not (it strips only as Phi-3's tokenizer does), so text there tokenizes differently"
    )


def write_vocab(writer: Any, tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig) -> dict[str, Any]:
    """The tokenizer's keys; returns what the Modelfile needs (add_bos), whether the file's name must say Phi-3 for
    llama.cpp to strip whitespace as the tokenizer does (`phi3_stripping`), and notes for the log."""
    spec = backend(tokenizer)
    model = kind(spec)
    tokens, types, scores = token_table(tokenizer, spec, config.vocab_size)
    writer.add_tokenizer_model(model)
    if model == "gpt2":
        writer.add_tokenizer_pre(pre_tokenizer_name(spec))
        writer.add_token_merges([_merge_text(m) for m in spec["model"].get("merges", [])])
    else:
        writer.add_tokenizer_pre("default")
        writer.add_token_scores(scores)
        writer.add_add_space_prefix(space_prefix(spec))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for name, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("unk", writer.add_unk_token_id),
        ("pad", writer.add_pad_token_id),
    ):
        value = getattr(tokenizer, f"{name}_token_id", None)
        if value is not None:
            add(int(value))
    bos, eos = adds(tokenizer)
    writer.add_add_bos_token(bos)
    writer.add_add_eos_token(eos)
    if isinstance(tokenizer.chat_template, str):
        writer.add_chat_template(tokenizer.chat_template)
    phi3, strip_note = stripping(spec, tokens)
    notes = [n for n in (space_prefix_note(spec) if model == "llama" else None, strip_note) if n]
    return {"add_bos": bos, "phi3_stripping": phi3, "notes": notes}
