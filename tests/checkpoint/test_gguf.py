"""GGUF for llama.cpp and Ollama: transformers' own GGUF loader (an independent reader, which undoes each family's
conventions itself) gives back the weights written; OPT and any family llama.cpp does not run end in one line; the plan
says what a 7B export needs and refuses what does not fit; a sized-down Qwen2.5-7B export stays within the host RAM it
predicted; the Modelfile's template rebuilds the tokenizer's own chat prompts.

llama.cpp itself (llama-cpp-python, a long source build) is checked by scripts/gguf_llama_cpp.py (docs/export.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    CHATML_TEMPLATE,
    GGUF_FAMILIES,
    LLAMA_STYLE_TEMPLATE,
    assert_clean_failure,
    launch,
    make_family_model,
    make_local_model,
    make_spm_tokenizer,
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from fsdp_opt.checkpoint.gguf import SafetensorsFolder, check_room, plan_exports, write_ggufs
from fsdp_opt.checkpoint.modelfile import measure, stop_tokens
from fsdp_opt.model.catalog import catalog_config
from fsdp_opt.model.loader import meta_model as build_meta_model

pytest.importorskip("gguf")


def export(folder: Path, types: list[str], log=lambda line: None) -> list[Path]:  # noqa: ANN001
    config = AutoConfig.from_pretrained(folder)
    plans = plan_exports(config, SafetensorsFolder(folder).shapes(), types, folder)
    return write_ggufs(folder, config, AutoTokenizer.from_pretrained(folder), plans, log=log)


@pytest.mark.parametrize("model_type", sorted(GGUF_FAMILIES))
def test_transformers_reads_back_the_weights_written(tmp_path, model_type):
    """f16: every 2-D weight is the fp16 rounding of the model's, every 1-D one (norms, biases) exact; q8_0: within
    half a quantisation step of each 32-value block (its absolute maximum / 127), plus the fp16 rounding of its scale."""
    bos = model_type != "qwen2"  # Qwen's tokenizer adds no BOS, the others' do
    folder = make_family_model(tmp_path / model_type, model_type, bos=bos, **GGUF_FAMILIES[model_type])
    written = export(folder, ["f16", "q8_0"])
    assert sorted(p.name for p in written) == sorted(
        [f"{model_type}-f16.gguf", f"{model_type}-q8_0.gguf", "Modelfile.f16", "Modelfile.q8_0"]
    )
    want = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for qtype in ("f16", "q8_0"):
        got = AutoModelForCausalLM.from_pretrained(folder, gguf_file=f"{model_type}-{qtype}.gguf").state_dict()
        assert set(got) == set(want), set(got) ^ set(want)
        for name, w in want.items():
            back = got[name].float()
            if w.dim() == 1:
                assert torch.equal(back, w), (qtype, name)
            elif qtype == "f16":
                assert torch.equal(back, w.half().float()), (qtype, name)
            else:
                blocks = w.reshape(-1, 32)
                step = blocks.abs().amax(dim=1, keepdim=True) / 127
                err = (back.reshape(-1, 32) - blocks).abs()
                # half a step, and the scale's own fp16 rounding (2^-11 of it) times the largest code, 127
                bound = step * (0.5 + 127 * 2**-11) + 1e-7
                assert bool((err <= bound).all()), (qtype, name, (err - bound).max().item())


def test_gguf_header_carries_the_whole_tokenizer(tmp_path):
    """Read with gguf's own reader: the pre-tokenizer by llama.cpp's name, every token, the merges, the special ids,
    add-BOS, and the chat template."""
    from gguf import GGUFReader

    folder = make_family_model(tmp_path / "llama", "llama", bos=True, template=LLAMA_STYLE_TEMPLATE)
    export(folder, ["q4_0"])
    reader = GGUFReader(str(folder / "llama-q4_0.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(folder)

    def field(key: str):
        f = reader.fields[key]
        return f.contents()

    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "gpt-2"
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == 4096 and tokens[:4] == ["<s>", "<pad>", "</s>", "<unk>"]
    assert tokens == [tokenizer.convert_ids_to_tokens(i) for i in range(4096)]
    assert field("tokenizer.ggml.token_type")[:5] == [3, 3, 3, 3, 1]
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    assert len(field("tokenizer.ggml.merges")) == len(spec["model"]["merges"])
    assert (field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")) == (0, 2)
    assert field("tokenizer.ggml.add_bos_token") is True
    assert field("tokenizer.chat_template") == LLAMA_STYLE_TEMPLATE
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.ffn_down.weight"] == "Q4_0"
    assert types["blk.0.attn_norm.weight"] == "F32"


SPM_TEXTS = [
    "The quick brown fox jumps over the lazy dog. 12345 + 678 = 13023",
    "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🙂 and tabs\tend",
    "a special token inside, </s> then <unk> and plain text;\nnew lines\n\n  and two spaces",
]


@pytest.mark.parametrize(
    "model_type,style", [("llama", "llama"), ("phi3", "phi3"), ("gemma2", "gemma"), ("gemma3_text", "gemma")]
)
def test_transformers_reads_back_a_sentencepiece_vocabulary(tmp_path, model_type, style):
    """A SentencePiece-style tokenizer (byte fallback, as Llama 2's, Mistral's, Phi-3's and Gemma's are) read back by
    transformers' GGUF loader from the file alone: every token at its id, the special ids, and the same ids for each
    text. For llama's architecture the loader rebuilds the merges from the scores written (a piece made by an earlier
    merge scores higher), so equal ids test the scores; Gemma's are rebuilt from the tokens' order. A GGUF has no field
    for a token that takes the whitespace after it (Phi-3's </s>: llama.cpp reads that off the model's name, which
    scripts/gguf_llama_cpp.py checks), so for Phi-3 the text has none there. The log's note says where llama.cpp
    tokenizes differently (transformers' Llama tokenizer puts no ▁ after a special token) and is silent elsewhere."""
    from gguf import GGUFReader

    extra = {"head_dim": 16, "query_pre_attn_scalar": 16} if style == "gemma" else {}
    folder = make_family_model(
        tmp_path / model_type, model_type, bos=True, tokenizer=make_spm_tokenizer(style), **extra
    )
    log = []
    export(folder, ["q8_0"], log.append)
    assert [line.split(" (")[0] for line in log if "note" in line] == (
        ["gguf: note: llama.cpp puts \u2581 before every stretch of text; this tokenizer"] if style == "llama" else []
    )
    alone = tmp_path / "gguf-alone"  # the file without the folder's tokenizer files beside it
    alone.mkdir()
    (folder / f"{model_type}-q8_0.gguf").rename(alone / f"{model_type}-q8_0.gguf")
    want = AutoTokenizer.from_pretrained(folder)
    got = AutoTokenizer.from_pretrained(alone, gguf_file=f"{model_type}-q8_0.gguf")
    vocab = want.get_vocab()
    assert {t: i for t, i in got.get_vocab().items() if i < len(vocab)} == vocab
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(got, f"{name}_token_id") == getattr(want, f"{name}_token_id"), name
    for text in SPM_TEXTS:
        text = text.replace("</s> ", "</s>") if style == "phi3" else text
        assert got(text)["input_ids"] == want(text)["input_ids"], (text, got.tokenize(text), want.tokenize(text))

    fields = GGUFReader(str(alone / f"{model_type}-q8_0.gguf")).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is (style != "gemma")
    kinds = {3: set(want.all_special_tokens), 6: {f"<0x{b:02X}>" for b in range(256)}}  # control, byte
    by_id = {i: t for t, i in vocab.items()}
    for i, kind in enumerate(fields["tokenizer.ggml.token_type"].contents()):
        token = by_id.get(i)
        assert kind == (5 if token is None else next((k for k, ts in kinds.items() if token in ts), 1)), (i, token)


def test_the_name_says_phi3_exactly_where_the_tokens_strip_as_phi3s(tmp_path):
    """llama.cpp makes special tokens take the whitespace after them by the model's name ("phi3"/"phi-3"), and fails
    to load such a file whose vocabulary lacks <|endoftext|>: a Phi-3 model whose tokenizer strips nothing, in a
    folder named phi3, gets no name; one whose tokenizer strips as Phi-3's does, in a folder named otherwise, gets
    a name that says Phi-3."""
    from gguf import GGUFReader

    plain = make_family_model(tmp_path / "phi3", "phi3", bos=True)
    stripping = make_family_model(tmp_path / "exported", "phi3", bos=True, tokenizer=make_spm_tokenizer("phi3"))
    for folder in (plain, stripping):
        export(folder, ["f16"])
    assert "general.name" not in GGUFReader(str(plain / "phi3-f16.gguf")).fields
    name = GGUFReader(str(stripping / "exported-f16.gguf")).fields["general.name"].contents()
    assert name == "exported (phi-3 tokenizer)"


def test_a_model_llama_cpp_does_not_run_gets_one_line(tmp_path):
    """The demo's model is OPT: `export --gguf` says in one line that llama.cpp does not run it and names the folder
    to use instead; nothing is written."""
    folder = make_local_model(tmp_path / "opt")
    dest = tmp_path / "out"
    proc = launch(["-m", "fsdp_opt.export"], [str(folder), str(dest), "--gguf", "q8_0"], tmp_path)
    line = assert_clean_failure(proc, "llama.cpp does not run opt models", f"use the Hugging Face folder {dest}")
    assert "\n" not in line.strip()
    assert not dest.exists() and not list(tmp_path.glob(".out*"))


def test_without_the_gguf_package_opt_is_still_told_that_llama_cpp_does_not_run_it(monkeypatch):
    """The demo's virtualenv has no gguf extra: installing it would not help an OPT model, so that line comes first;
    a family llama.cpp runs is told to install the package."""
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError, as where it is not installed
    with pytest.raises(Exception, match="llama.cpp does not run opt models"):
        plan_exports(AutoConfig.for_model("opt"), {}, ["q8_0"], Path("out"))
    with pytest.raises(Exception, match=r"pip install 'fsdp-opt\[gguf\]'"):
        plan_exports(catalog_config("Qwen/Qwen2.5-7B"), {}, ["q8_0"], Path("out"))


def test_the_plan_says_what_a_7b_needs_and_refuses_what_does_not_fit():
    """Qwen2.5-7B's shapes: q8_0 alone fits Kaggle's 20 GB disk and 31 GB host, f16 and q8_0 together do not; the RAM
    is one block's, not the model's."""
    config = catalog_config("Qwen/Qwen2.5-7B")
    shapes = {k: tuple(v.shape) for k, v in build_meta_model(config).state_dict().items()}
    kaggle_disk, kaggle_ram = 20 * 10**9, 31 * 10**9
    q8, f16 = plan_exports(config, shapes, ["q8_0", "f16"], Path("/kaggle/working/export"))
    assert 7.5e9 < q8.file_bytes < 8.5e9 and 14.5e9 < f16.file_bytes < 15.5e9, (q8.file_bytes, f16.file_bytes)
    assert q8.ram_bytes < 1e9
    check_room([q8], Path("/"), free_disk=kaggle_disk, host_ram=kaggle_ram)
    with pytest.raises(Exception, match=r"--gguf: .* of GGUF \(q8_0 .*, f16 .*\) does not fit"):
        check_room([q8, f16], Path("/"), free_disk=kaggle_disk, host_ram=kaggle_ram)
    with pytest.raises(Exception, match="host RAM"):
        check_room([q8], Path("/"), free_disk=kaggle_disk, host_ram=q8.ram_bytes // 2)


MEASURE = """
import json, sys
from pathlib import Path
from transformers import AutoConfig, AutoTokenizer
from fsdp_opt.checkpoint.gguf import SafetensorsFolder, plan_exports, write_ggufs
from fsdp_opt.runtime.hostmem import peak_rss_bytes, reset_peak, rss_bytes
folder = Path(sys.argv[1])
config, tokenizer = AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
plans = plan_exports(config, SafetensorsFolder(folder).shapes(), ["q8_0"], folder)
import gguf  # imported before the baseline, as the export has it
before = rss_bytes()["rss"]
reset_peak()
write_ggufs(folder, config, tokenizer, plans, log=lambda line: None)
print(json.dumps({"grew": peak_rss_bytes() - before, "predicted": plans[0].ram_bytes}))
"""


def test_a_7b_shaped_export_stays_within_the_ram_it_predicted(tmp_path):
    """One layer of Qwen2.5-7B at its full widths (hidden 3584, MLP 18944: 68M-value tensors, four blocks each) and a
    cut vocabulary, fake weights: the peak RSS the write adds stays under the plan's figure."""
    from conftest import ASSETS

    config = catalog_config("Qwen/Qwen2.5-7B")
    config.num_hidden_layers, config.vocab_size, config.layer_types = 1, 4096, config.layer_types[:1]
    folder = tmp_path / "qwen-7b-shaped"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    from safetensors.torch import save_file

    state = {k: torch.full(tuple(v.shape), 0.01, dtype=torch.bfloat16) for k, v in model.state_dict().items()}
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    del state
    config.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((ASSETS / name).read_bytes())
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(folder)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"7B-shaped q8_0 write: RSS grew {figures['grew'] / 2**20:.0f} MiB, predicted {figures['predicted'] / 2**20:.0f} MiB"
    )
    assert 0 < figures["grew"] <= figures["predicted"], figures


@pytest.mark.parametrize("template,bos", [(LLAMA_STYLE_TEMPLATE, True), (CHATML_TEMPLATE, False)])
def test_the_modelfile_template_rebuilds_the_chat_prompts(tmp_path, template, bos):
    """The pieces measured from the tokenizer's template, laid out as the Modelfile's Go template lays them, give
    apply_chat_template's text for another conversation (a system turn, three user turns); the stop tokens close the
    assistant's turn."""
    folder = make_family_model(tmp_path / "m", "llama", bos=bos, template=template)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    markers = (
        ["<|im_start|>", "<|im_end|>"]
        if template is CHATML_TEMPLATE
        else ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    )
    tokenizer.add_special_tokens({"additional_special_tokens": markers})  # special, as the real families' are
    turns = measure(tokenizer, add_bos=bos)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Ünïcode ok?"},
    ]
    want = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    if bos:
        want = want.removeprefix(tokenizer.bos_token)  # llama.cpp adds it when it tokenizes
    assert turns.render(chat) == want
    go = turns.go_template()
    assert "{{ .Content }}" in go and "{{-" not in go  # a trim marker would eat the pieces' newlines
    assert stop_tokens(tokenizer, turns)[0] == ("<|eot_id|>" if template is LLAMA_STYLE_TEMPLATE else "<|im_end|>")
