"""GRPO's decoding in one process (engine/decoding.py, engine/generation.py): the static-cache path against
transformers' generate, greedy and sampled, over the model families, with prompts of different lengths; the counter
sampler's draws against the distribution transformers' warpers give; the loop's end once every completion has
ended."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from fsdp_opt.engine.decoding import Decoder
from fsdp_opt.engine.generation import CounterSample, Sampling, completion_keys, generate

FAMILIES = ("opt", "gpt2", "llama", "qwen2", "mistral", "gemma2")
PROMPTS = [[5, 17, 99, 300, 41], [7, 8], [100, 200, 300, 400, 500, 600, 700], [9], list(range(20, 34))]
CPU = torch.device("cpu")


def tiny(kind: str) -> torch.nn.Module:
    """A small random model of one family (weights large enough that greedy completions depend on the prompt; a
    sliding window shorter than the longest prompt where the family has one)."""
    extra = {"sliding_window": 6} if kind in ("mistral", "gemma2") else {}
    if kind == "gemma2":
        extra["head_dim"] = 16
    if kind == "opt":
        config = AutoConfig.for_model(
            "opt",
            vocab_size=1024,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            max_position_embeddings=128,
            eos_token_id=2,
            pad_token_id=1,
            init_std=0.1,
        )
    else:
        config = AutoConfig.for_model(
            kind,
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            eos_token_id=2,
            pad_token_id=1,
            bos_token_id=0,
            initializer_range=0.1,
            **extra,
        )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_static_path_decodes_what_transformers_generate_does(kind):
    """fp32, one left-padded batch of prompts of different lengths: greedy completions equal transformers' greedy
    generate of each prompt alone; sampled (temperature, top-k, top-p), the same keys draw the same completions on
    the static path as on transformers' generate with the run's sampler (its dynamic cache)."""
    model = tiny(kind)
    n = 12
    keys = completion_keys(3, 1, list(range(len(PROMPTS))), [0] * len(PROMPTS))
    greedy = generate(model, PROMPTS, keys, Sampling(n, top_k=1), eos_ids=[2], pad_id=1, device=CPU, decoder=Decoder())
    for prompt, made in zip(PROMPTS, greedy.ids):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            alone = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                eos_token_id=2,
                pad_token_id=1,
            )[0, len(prompt) :].tolist()
        assert made == (alone[: alone.index(2) + 1] if 2 in alone else alone), (kind, prompt)
    assert len({tuple(c) for c in greedy.ids}) >= 3  # the completions depend on the prompt
    for sampling in (Sampling(n, temperature=1.3), Sampling(n, temperature=0.8, top_k=40, top_p=0.9)):
        static = generate(model, PROMPTS, keys, sampling, eos_ids=[2], pad_id=1, device=CPU, decoder=Decoder())
        eager = generate(model, PROMPTS, keys, sampling, eos_ids=[2], pad_id=1, device=CPU)
        assert static.ids == eager.ids and static.ended == eager.ended, kind


def test_the_loop_stops_once_every_completion_has_ended():
    """A completion that ends stops the batch's decoding as soon as every other one has ended: the decoder runs
    fewer steps than --max_completion_length (an end-of-text id every prompt's greedy completion reaches early)."""
    model = tiny("llama")
    decoder = Decoder()
    first = generate(
        model,
        PROMPTS,
        torch.zeros(len(PROMPTS), dtype=torch.int64),
        Sampling(3, top_k=1),
        eos_ids=[2],
        pad_id=1,
        device=CPU,
        decoder=decoder,
    ).ids
    ends = sorted({c[0] for c in first})  # each completion's first token: as its end, every completion ends at once
    made = generate(
        model,
        PROMPTS,
        torch.zeros(len(PROMPTS), dtype=torch.int64),
        Sampling(40, top_k=1),
        eos_ids=ends,
        pad_id=1,
        device=CPU,
        decoder=decoder,
    )
    assert all(e for e in made.ended) and all(len(c) == 1 for c in made.ids), made
    assert decoder.last.steps == 1 and decoder.last.path == "static"


def test_the_counter_sampler_draws_from_the_warped_distribution():
    """20,000 counter keys (seed, step, row, place) drawing one token from fixed logits through temperature 0.7,
    top-k 12 and top-p 0.9: the draws fall in exactly the support transformers' warpers leave, and their counts pass a
    chi-square test against the warped softmax (p > 0.001)."""
    torch.manual_seed(5)
    vocab, draws = 64, 20_000
    logits = torch.randn(1, vocab) * 2.0
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(12), TopPLogitsWarper(0.9)])
    expected = torch.softmax(warpers(torch.zeros(1, 1, dtype=torch.long), logits.clone()).double(), dim=-1)[0]
    support = set(torch.nonzero(expected > 0).flatten().tolist())
    assert 3 <= len(support) <= 12
    keys = completion_keys(11, 7, list(range(draws)), [r % 8 for r in range(draws)])
    scores = warpers(torch.zeros(draws, 1, dtype=torch.long), logits.expand(draws, -1).clone())
    picked = CounterSample(keys, prompt_length=1)(torch.zeros(draws, 1, dtype=torch.long), scores).argmax(dim=-1)
    counts = torch.bincount(picked, minlength=vocab).double()
    assert set(torch.nonzero(counts).flatten().tolist()) == support
    index = torch.tensor(sorted(support))
    want = expected[index] * draws
    chi2 = float(((counts[index] - want) ** 2 / want).sum())
    p_value = float(torch.special.gammaincc(torch.tensor((len(index) - 1) / 2.0), torch.tensor(chi2 / 2.0)))
    print(
        f"support {len(index)} tokens; chi-square {chi2:.2f} on {len(index) - 1} degrees of freedom, p = {p_value:.3f}"
    )
    assert p_value > 1e-3 and math.isfinite(chi2)


class Rerun:
    """A stand-in for CUDA graphs on CPU (none exist here): capture runs the step once and keeps its output tensor;
    each replay runs the step again on the static inputs as they are now and writes that same tensor, as a replayed
    graph does. What it checks is the decoder's side of the graph path: the static inputs filled before each replay,
    the cache reset after capture, the graph kept while the shapes and the weights' addresses hold."""

    devices = ("cpu",)

    def __init__(self, fail: bool = False) -> None:
        self.captures, self.fail = 0, fail

    def capture(self, step, device):  # noqa: ANN001, ANN201
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        out = step()
        return lambda: out.copy_(step()), out


@pytest.mark.parametrize("kind", ["opt", "llama", "qwen2"])
def test_the_graph_paths_bookkeeping_decodes_what_the_static_path_does(kind):
    """--decoding graphs with a stand-in capture (Rerun): the completions equal the unreplayed static path's, greedy
    and sampled; a second generation of the same shapes on the same weights replays the kept graph; weights at new
    addresses (as each gathering of the model may put them) are captured again; a capture that fails is said in one
    line, and that decoder decodes unreplayed from then on. A model with sliding-window layers is not captured (one
    line): the cache keeps those layers' place in Python, which a replay would not move."""
    model = tiny(kind)
    keys = completion_keys(5, 2, list(range(len(PROMPTS))), [1] * len(PROMPTS))
    backend = Rerun()
    decoder = Decoder(graphs=True, backend=backend)
    for sampling in (Sampling(10, top_k=1), Sampling(10, temperature=1.2, top_p=0.95)):
        replayed = generate(model, PROMPTS, keys, sampling, eos_ids=[2], pad_id=1, device=CPU, decoder=decoder)
        static = generate(model, PROMPTS, keys, sampling, eos_ids=[2], pad_id=1, device=CPU, decoder=Decoder())
        assert replayed.ids == static.ids and replayed.ended == static.ended, kind
        assert decoder.last.path == "graphs"
    assert backend.captures == 1 and not decoder.last.captured  # the second generation replayed the kept graph
    with torch.no_grad():
        for p in model.parameters():  # new storage for every weight, the same values
            p.data = p.data.clone()
    generate(model, PROMPTS, keys, Sampling(4), eos_ids=[2], pad_id=1, device=CPU, decoder=decoder)
    assert backend.captures == 2 and decoder.last.captured
    said: list[str] = []
    refusing = Decoder(graphs=True, backend=Rerun(fail=True))
    for _ in range(2):
        made = refusing.decode(
            model,
            PROMPTS,
            lambda ids, logits: logits.argmax(-1),
            max_new_tokens=4,
            eos_ids=[2],
            pad_id=1,
            device=CPU,
            say=said.append,
        )
        assert refusing.last.path == "static" and len(made) == len(PROMPTS)
    assert len(said) == 1 and "could not be captured as a CUDA graph (RuntimeError: operation not permitted" in said[0]
    windowed, said = tiny("gemma2"), []
    sliding = Decoder(graphs=True, backend=Rerun())
    made = sliding.decode(
        windowed,
        PROMPTS,
        lambda ids, logits: logits.argmax(-1),
        max_new_tokens=4,
        eos_ids=[2],
        pad_id=1,
        device=CPU,
        say=said.append,
    )
    assert sliding.last.path == "static" and sliding.backend.captures == 0 and len(made) == len(PROMPTS)
    assert len(said) == 1 and "sliding-window layers" in said[0], said
