"""llama.cpp itself against transformers, on the GGUF files `fsdp-opt export --gguf` writes (docs/export.md).

    pip install "llama-cpp-python==0.3.36"        # a source build: about half an hour on 2 cores
    python scripts/gguf_llama_cpp.py [--types f16 q8_0 q4_0] [--json OUT.json]

For a tiny random-weight model of each family llama.cpp runs (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3),
with a tokenizer that puts a BOS first and one that does not, and each GGUF type: llama.cpp (through llama-cpp-python)
loads the file; tokenizes three texts (special tokens, non-ASCII text) as the Hugging Face tokenizer does; gives logits
at every position within the bound of the type of transformers' fp32 logits (1e-2 at f16; the bounds measured for q8_0
and q4_0 are printed); greedily decodes the same 16 tokens wherever fp32's top-two gap is over 1e-2; and renders the
GGUF's own chat template to the text `apply_chat_template` gives. Too slow to build for CI: the docs hold its figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import LLAMA_STYLE_TEMPLATE, make_family_model  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from fsdp_opt.checkpoint.gguf import SafetensorsFolder, plan_exports, write_ggufs  # noqa: E402

FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16},
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16},
    "phi3": {},
}
TEXTS = [
    "The quick brown fox jumps over the lazy dog. 12345 + 678 = 13023",
    "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🙂 and tabs\tend",
    "</s> a special token inside, <pad> another, then <unk> and plain text",
]
BOUNDS = {"f16": 1e-2}  # the bound at f16; q8_0's and q4_0's are measured and printed
GAP = 1e-2  # greedy tokens are compared where fp32's top-two gap is wider than this
CHAT = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Ünïcode?"},
]


def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    out, gaps = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([out])).logits[0, -1]
            top = torch.topk(logits, 2).values
            gaps.append(float(top[0] - top[1]))
            out.append(int(logits.argmax()))
    return out[len(ids) :], gaps


def llama_greedy(llm, ids: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        llm.eval([token])
    return out


def check(model_type: str, bos: bool, types: list[str], root: Path) -> list[dict]:
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = LLAMA_STYLE_TEMPLATE if bos else None
    folder = make_family_model(
        root / f"{model_type}-{bos}", model_type, bos=bos, template=template, **FAMILIES[model_type]
    )
    config, tokenizer = AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    plans = plan_exports(config, SafetensorsFolder(folder).shapes(), types, folder)
    write_ggufs(folder, config, tokenizer, plans, log=lambda line: None)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = []
    for plan in plans:
        llm = Llama(str(folder / plan.path.name), n_ctx=256, logits_all=True, verbose=False, n_threads=2, seed=0)
        tokens_equal = all(
            llm.tokenize(text.encode(), add_bos=True, special=True) == tokenizer(text)["input_ids"] for text in TEXTS
        )
        worst, std = 0.0, 0.0
        for text in TEXTS:
            ids = tokenizer(text)["input_ids"]
            with torch.no_grad():
                want = model(input_ids=torch.tensor([ids])).logits[0].numpy()
            llm.reset()
            llm.eval(ids)
            got = np.asarray(llm.scores[: len(ids)])
            worst, std = max(worst, float(np.abs(got - want).max())), max(std, float(want.std()))
        prompt = tokenizer(TEXTS[0])["input_ids"][:8]
        want_tokens, gaps = hf_greedy(model, prompt, 16)
        got_tokens = llama_greedy(llm, prompt, 16)
        compared = 0
        for w, g, gap in zip(want_tokens, got_tokens, gaps):
            if gap <= GAP:
                break  # a near tie: from here the two may part without either being wrong
            if w != g:
                compared = -1
                break
            compared += 1
        chat = None
        if template:
            meta = llm.metadata.get("tokenizer.chat_template")
            formatter = Jinja2ChatFormatter(meta, eos_token=tokenizer.eos_token, bos_token=tokenizer.bos_token)
            rendered = formatter(messages=CHAT).prompt
            chat = rendered == tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        rows.append(
            {
                "family": model_type,
                "bos": bos,
                "type": plan.qtype,
                "tokens_equal": tokens_equal,
                "max_logit_gap": worst,
                "logits_std": std,
                "greedy_equal_where_gap_wide": compared,
                "chat_template_equal": chat,
            }
        )
        del llm
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["f16", "q8_0", "q4_0"])
    parser.add_argument("--families", nargs="+", default=sorted(FAMILIES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            for bos in (True, False):
                rows += check(family, bos, args.types, Path(tmp))
    print("| family | BOS | type | tokens equal | max logit gap (logits' std) | greedy tokens equal | chat template |")
    print("|---|---|---|---|---|---|---|")
    failed = False
    for r in rows:
        bound = BOUNDS.get(r["type"])
        ok = r["tokens_equal"] and r["greedy_equal_where_gap_wide"] >= 0 and r["chat_template_equal"] is not False
        ok = ok and (bound is None or r["max_logit_gap"] <= bound)
        failed |= not ok
        print(
            f"| {r['family']} | {'yes' if r['bos'] else 'no'} | {r['type']} | {r['tokens_equal']} | "
            f"{r['max_logit_gap']:.2e} ({r['logits_std']:.2f}) | {r['greedy_equal_where_gap_wide']} of 16 | "
            f"{'-' if r['chat_template_equal'] is None else r['chat_template_equal']} |"
        )
    for qtype in args.types:
        gaps = [r["max_logit_gap"] for r in rows if r["type"] == qtype]
        print(f"{qtype}: the largest logit gap over every family {max(gaps):.3e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
