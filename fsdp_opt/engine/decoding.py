"""Decoding a rank's completions with a static KV cache (--decoding static, the default), and each decoding step
replayed as one CUDA graph (--decoding graphs).

- **One batch, fixed shapes.** All of a rank's completions decode together: the prompts left-padded to the longest,
  a KV cache sized once for that batch and the prompts plus --max_completion_length tokens (transformers'
  StaticCache), explicit positions, and one attention mask for the whole loop: 0 at each row's left padding, 1
  everywhere else (causality hides what is not written yet). A decoding step then has the same shapes and reads and
  writes the same addresses every time: what a CUDA graph needs.
- **Graphs.** On a CUDA device, --decoding graphs captures the step (the model's forward on one new token per row:
  hundreds of kernels launched from Python; FSDP's hooks are off while the model is gathered, model/gathering.py)
  once and replays it per token, so the host launches one graph instead of every kernel. A graph holds the addresses
  it was captured with: it is captured again when the batch's shape or the gathered weights' addresses change (a new
  generation usually gathers into new memory). Where capture fails (a model whose step cannot be captured), one line
  says why, and the step runs unreplayed. A model with sliding-window layers is not captured: transformers' static
  cache keeps a sliding layer's place in Python, which a replay would not move. `torch.cuda.CUDAGraph` around the
  eager step needs nothing a T4 lacks (no Triton).
- **The sampler after the step**, as transformers' generate runs it: the step's last logits in fp32 through the run's
  processors (temperature, top-k, top-p, the counter's draw: engine/generation.py), a finished row's next token the
  pad. A completion stays a function of (seed, step, row, place in its group), whatever path decoded it.
- **The end.** A row is finished at its first end-of-text token, or once its last tokens are the stop text's; the
  loop stops once every row is (checked every step on CPU, every CHECK_EVERY_CUDA steps on a GPU, where a check waits
  for the device).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

CHECK_EVERY_CUDA = 4  # decoding steps between the GPU's "has every row ended?" checks (each one waits for the device)
PATHS = ("static", "graphs", "generate")  # --decoding


@dataclass
class DecodeStats:
    """What the last call did: the path that ran, the steps it decoded, and a graph's capture (graphs)."""

    path: str = "static"
    steps: int = 0
    captured: bool = False  # a graph was captured in this call (not replayed from an earlier one)
    capture_seconds: float = 0.0


class CudaGraphs:
    """How a step is captured and replayed on a CUDA device: warm-up steps on a side stream (as capture requires: the
    libraries' lazy setup runs there), then `torch.cuda.CUDAGraph` around one step."""

    devices = ("cuda",)

    def capture(
        self, step: Callable[[], torch.Tensor], device: torch.device
    ) -> tuple[Callable[[], None], torch.Tensor]:
        """(replay, the step's output tensor, which each replay writes again)."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        return graph.replay, out  # the bound method keeps the graph (and its memory pool) alive


@dataclass
class _Graph:
    """A captured decoding step: its static inputs and output, the cache it writes, and what it was captured for."""

    replay: Callable[[], None]
    cache: object  # transformers' StaticCache
    tokens: torch.Tensor  # [B, 1] the step's input tokens
    positions: torch.Tensor  # [B, 1]
    cache_position: torch.Tensor | None  # [1] where the step writes (transformers whose forward takes it)
    logits: torch.Tensor  # [B, V] the step's output
    key: tuple  # (batch, prompt length, new tokens, the weights' addresses)


@dataclass
class Decoder:
    """One rank's decoding across a run's generations: --decoding's path, and a captured graph kept while it fits."""

    graphs: bool = False
    backend: CudaGraphs = field(default_factory=CudaGraphs)  # how a step is captured (a test's stand-in on CPU)
    last: DecodeStats = field(default_factory=DecodeStats)
    _graph: _Graph | None = None
    _refused: str | None = None  # why capture failed, once said: the rest of the run decodes unreplayed

    @torch.no_grad()
    def decode(
        self,
        model: nn.Module,
        prompts: Sequence[Sequence[int]],
        choose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        max_new_tokens: int,
        eos_ids: Sequence[int],
        pad_id: int,
        device: torch.device,
        stop_ids: Sequence[int] = (),
        say: Callable[[str], None] = print,
        done_when: Callable[[torch.Tensor], torch.Tensor] | None = None,
        on_forward: Callable[[], None] | None = None,
    ) -> list[list[int]]:
        """Each prompt's generated tokens (max_new_tokens of them, the pad after a row's end). `choose(input_ids,
        logits)` picks each row's next token from the step's fp32 logits, given the tokens so far. `done_when(tokens)`
        (lm-eval's stop strings): which rows have ended, given each row's generated tokens so far, asked where the
        loop checks for its end. `on_forward` is called at each of the model's forwards (the prefill, each step)."""
        batch, prompt_len = len(prompts), max(len(p) for p in prompts)
        length = prompt_len + max_new_tokens
        seq = torch.full((batch, length), pad_id, dtype=torch.long, device=device)
        mask = torch.ones((batch, length), dtype=torch.long, device=device)
        pads = torch.tensor([prompt_len - len(p) for p in prompts], dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            seq[i, prompt_len - len(p) : prompt_len] = torch.tensor(list(p), dtype=torch.long, device=device)
            mask[i, : prompt_len - len(p)] = 0
        takes = _forward_takes(model)
        replayable = self.graphs and device.type in self.backend.devices and not self._refused
        stats = DecodeStats(path="graphs" if replayable else "static")
        graph = self._graph_for(model, takes, batch, prompt_len, max_new_tokens, mask, device, stats, say)
        if graph is None:
            stats.path = "static"
            cache = new_cache(model, length)
        else:
            cache = graph.cache
            cache.reset()
        ends = torch.tensor(sorted(set(eos_ids)) or [-1], dtype=torch.long, device=device)
        stop = torch.tensor(list(stop_ids), dtype=torch.long, device=device) if stop_ids else None
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        every = CHECK_EVERY_CUDA if device.type == "cuda" else 1
        # the prefill: every prompt position at once, the last one's logits kept
        positions = (torch.arange(prompt_len, device=device).unsqueeze(0) - pads.unsqueeze(1)).clamp(min=0)
        logits = _step(
            model, takes, cache, seq[:, :prompt_len], positions, mask, torch.arange(prompt_len, device=device)
        )
        counted = on_forward or (lambda: None)
        counted()
        for t in range(max_new_tokens):
            here = prompt_len + t
            nxt = choose(seq[:, :here], logits.float())
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            seq[:, here] = nxt
            done |= torch.isin(nxt, ends)
            if stop is not None and t + 1 >= len(stop):
                done |= (seq[:, here + 1 - len(stop) : here + 1] == stop).all(dim=1)
            stats.steps = t + 1
            if t + 1 == max_new_tokens:
                break
            if (t + 1) % every == 0:
                if done_when is not None:
                    done |= done_when(seq[:, prompt_len : here + 1])
                if bool(done.all()):
                    break
            step_positions = (here - pads).unsqueeze(1)
            if graph is not None:
                graph.tokens.copy_(nxt.unsqueeze(1))
                graph.positions.copy_(step_positions)
                if graph.cache_position is not None:
                    graph.cache_position.fill_(here)
                graph.replay()
                logits = graph.logits
            else:
                logits = _step(
                    model, takes, cache, nxt.unsqueeze(1), step_positions, mask, torch.tensor([here], device=device)
                )
            counted()
        self.last = stats
        return seq[:, prompt_len:].tolist()

    def _graph_for(
        self,
        model: nn.Module,
        takes: set[str],
        batch: int,
        prompt_len: int,
        new_tokens: int,
        mask: torch.Tensor,
        device: torch.device,
        stats: DecodeStats,
        say: Callable[[str], None],
    ) -> _Graph | None:
        """The captured step for this batch and these weights: the kept one, or captured now (None: unreplayed)."""
        if stats.path != "graphs":
            return None
        key = (batch, prompt_len, new_tokens, tuple(p.data_ptr() for p in model.parameters()))
        if self._graph is not None and self._graph.key == key:  # same shapes, same addresses: replayed as it is
            return self._graph
        self._graph = None  # its memory pool goes before another is captured
        started = time.perf_counter()
        try:
            self._graph = capture(
                self.backend, model, takes, batch, prompt_len + new_tokens, prompt_len, mask, device, key
            )
        except Exception as e:  # noqa: BLE001 - any failure to capture leaves the eager step, which is correct
            self._refused = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            say(
                f"decoding: the step could not be captured as a CUDA graph ({self._refused}); decoding unreplayed "
                "with the static cache from here on"
            )
            return None
        stats.captured, stats.capture_seconds = True, time.perf_counter() - started
        return self._graph


def new_cache(model: nn.Module, length: int):
    """transformers' StaticCache for `length` tokens of the model's layers (its layers' kinds: full or sliding)."""
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=length)


def supports_static(model: nn.Module) -> bool:
    """Whether the model decodes with a static cache: its forward takes positions and a cache object (transformers'
    causal LMs do; a remote-code model may not)."""
    takes = _forward_takes(model)
    return "position_ids" in takes and bool({"cache", "past_key_values"} & takes)


def _forward_takes(model: nn.Module) -> set[str]:
    return set(inspect.signature(type(model).forward).parameters)


def _step(
    model: nn.Module,
    takes: set[str],
    cache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    cache_position: torch.Tensor,
) -> torch.Tensor:
    """The model's forward on `input_ids` at `positions`, writing the cache; the last position's logits [B, V]."""
    kwargs = {"cache" if "cache" in takes else "past_key_values": cache}
    if "cache_position" in takes:  # transformers before the cache kept its own position
        kwargs["cache_position"] = cache_position
    if "logits_to_keep" in takes:
        kwargs["logits_to_keep"] = 1
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)
    return out.logits[:, -1]


def capture(
    backend: CudaGraphs,
    model: nn.Module,
    takes: set[str],
    batch: int,
    length: int,
    prompt_len: int,
    mask: torch.Tensor,
    device: torch.device,
    key: tuple,
) -> _Graph:
    """The decoding step captured on a cache of its own, its inputs static tensors the loop fills before each replay.
    The cache is reset after, so what the warm-up wrote is gone before the prefill."""
    cache = new_cache(model, length)
    if any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ())):
        raise NotImplementedError(
            "its sliding-window layers keep where they are in Python, and a replayed graph would keep the place it "
            "was captured at"
        )
    tokens = torch.zeros((batch, 1), dtype=torch.long, device=device)
    positions = torch.full((batch, 1), prompt_len, dtype=torch.long, device=device)
    cache_position = torch.tensor([prompt_len], dtype=torch.long, device=device) if "cache_position" in takes else None
    where = cache_position if cache_position is not None else torch.tensor([prompt_len], device=device)
    # the first forward allocates the cache (transformers does at its first write); emptied again before the warm-up
    _step(model, takes, cache, tokens, positions, mask, where)
    cache.reset()
    replay, logits = backend.capture(lambda: _step(model, takes, cache, tokens, positions, mask, where), device)
    cache.reset()
    return _Graph(replay, cache, tokens, positions, cache_position, logits, key)
