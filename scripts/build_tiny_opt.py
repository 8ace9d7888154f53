"""Rebuild the built-in `tiny-opt` assets in fsdp_opt/assets/tiny-opt.

The files are committed, so users never run this. It exists so the assets can be
regenerated and reviewed: a byte-level BPE trained on the `python-docs` paragraphs,
with OPT's special-token ids (<s>=0, <pad>=1, </s>=2, <unk>=3), and a small OPT config.

    python scripts/build_tiny_opt.py
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import OPTConfig, PreTrainedTokenizerFast

from fsdp_opt.data.builtins import python_docs_texts

ASSET_DIR = Path(__file__).resolve().parents[1] / "fsdp_opt" / "assets" / "tiny-opt"
VOCAB_SIZE = 4096
SPECIAL = ["<s>", "<pad>", "</s>", "<unk>"]


def build_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="</s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def build_config(vocab_size: int) -> OPTConfig:
    # NOTE: OPT's special ids (pad=1, bos=eos=2) so code paths match facebook/opt-*.
    return OPTConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=4,
        ffn_dim=512,
        num_attention_heads=4,
        max_position_embeddings=512,
        word_embed_proj_dim=128,
        do_layer_norm_before=True,
        dropout=0.1,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
        tie_word_embeddings=True,
    )


def main() -> None:
    ASSET_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(python_docs_texts())
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL] == [0, 1, 2, 3]
    tokenizer.save_pretrained(ASSET_DIR)
    config = build_config(len(tokenizer))
    config.save_pretrained(ASSET_DIR)
    # Keep only what loading needs, in a form transformers 4.x and 5.x both read.
    (ASSET_DIR / "special_tokens_map.json").unlink(missing_ok=True)
    tok_cfg_path = ASSET_DIR / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg.pop("backend", None)
    tok_cfg.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=config.max_position_embeddings)
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    print(json.dumps({"dir": str(ASSET_DIR), "vocab_size": len(tokenizer)}))


if __name__ == "__main__":
    main()
