"""lm-evaluation-harness's model interface over the project's model: `ModelLM`, a subclass of lm-eval's `TemplateLM`
(its `LM` with lm-eval's own tokenization of a context and its continuation), on any number of ranks.

- **Every rank its share.** lm-eval's evaluator gives each rank its documents (`rank`, `world_size`), pads the
  request counts so every rank runs as many, and gathers the samples and metrics on rank 0 (`gather_object`). The
  methods here only ever see this rank's requests.
- **The model gathered once** (engine/generation.py `gathered`: LoRA adapters merged into the gathered copies of a
  16-bit base, an NF4 base as trained) around the whole evaluation (engine/benchmarks.py): then no forward is a
  collective, and a rank with fewer requests than another waits for nothing. Where the gathered model does not fit
  (`gather=False`), each forward gathers the blocks as it runs: every rank then runs the same number of forwards (the
  most any rank needs; the others run one-token fillers), counted before the first one, so no rank waits alone in a
  collective.
- **Batched by length**, longest first (lm-eval's `Collator`, as HFLM batches: a multiple-choice task's one-token
  continuations share one forward of their context). A batch is right-padded; the output layer runs at the
  continuation's positions only (engine/loss.py HeadLoss), its log-softmax in fp32.
- **generate_until** on the decoding GRPO samples with (engine/decoding.py: one left-padded batch, a static KV cache,
  a CUDA graph per step with --decoding graphs on a GPU): greedy unless the request's gen_kwargs sample (then the
  counter's draws, keyed by the seed and the request), at most `max_gen_toks` tokens, a row done at the end-of-text
  token or once its text holds one of lm-eval's `until` strings; the text is cut at the first of them, as lm-eval's
  HFLM cuts it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_opt.base import ConfigError
from fsdp_opt.engine.decoding import Decoder
from fsdp_opt.engine.generation import Sampling, completion_keys, processors
from fsdp_opt.engine.loss import HeadLoss, head_forward
from fsdp_opt.runtime.distributed import DistEnv

try:  # the [eval] extra; without it engine/benchmarks.py refuses --tasks in one line before this class is used
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import (
        Collator,
        handle_stop_sequences,
        has_bos_prefix,
        normalize_gen_kwargs,
        postprocess_generated_text,
        resolve_max_length,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:  # pragma: no cover - the trainer runs without lm-eval
    TemplateLM = object

MAX_GEN_TOKS = 256  # lm-eval's default for a task that names none (HFLM's)

# A request as _loglikelihood_tokens takes it: (its strings, or None for a rolling window; context; continuation)
TokenRequest = tuple[tuple[str, str] | None, list[int], list[int]]


class ModelLM(TemplateLM):
    """lm-eval's model over a (sharded) model every rank holds: `loglikelihood`, `loglikelihood_rolling`,
    `generate_until`, and the collectives lm-eval's evaluator calls."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        env: DistEnv,
        *,
        batch_size: int,
        gather: bool = True,
        decoder: Decoder | None = None,
        seed: int = 0,
        max_length: int | None = None,
    ) -> None:  # noqa: ANN001
        super().__init__()
        self.model, self.tokenizer, self.env = model, tokenizer, env
        self._rank, self._world_size, self._device = env.rank, env.world_size, env.device
        self.batch_size = batch_size
        self.gather = gather
        self.decoder = decoder or Decoder()
        self.seed = seed
        self._max_length = max_length or resolve_max_length(model.config, tokenizer)
        self.head = HeadLoss.for_run(model, 0)  # the output layer at the continuation only, where it is a projection
        self.forwards = 0  # this call's forwards so far (the shards' lockstep counts them)
        self._target = 0  # the forwards every rank runs in this call (on the shards)

    # ------------------------------------------------------------ lm-eval's collectives

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # ------------------------------------------------------------ tokenization, as lm-eval's HFLM does it

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return MAX_GEN_TOKS

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:  # noqa: ANN003
        """The tokenizer's own special tokens (a BOS where it adds one), none where the text starts with the BOS."""
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        tokens = self.tokenizer.encode(string, **special)
        left = kwargs.get("left_truncate_len")
        return tokens[-left:] if left else tokens

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------ scoring

    def _loglikelihood_tokens(self, requests: list[TokenRequest], **kwargs) -> list[tuple[float, bool]]:  # noqa: ANN003
        """(log-probability of the continuation, whether it is the greedy one) of each request, in their order."""
        order = Collator(
            requests,
            sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])),
            group_by="contexts",
            group_fn=lambda r: r[-2] + r[-1][:-1],
        )
        batches = list(order.get_batched(n=self.batch_size))
        self._lockstep(len(batches))
        out = []
        for batch in batches:
            for (strings, context, _), scores, continuation in zip(batch, self._score(batch), [r[2] for r in batch]):
                for _, tokens, logps in order.get_cache(
                    req_str=strings, cxt_toks=context, cont_toks=continuation, logits=scores
                ):
                    tokens = torch.tensor(tokens, dtype=torch.long, device=logps.device)
                    picked = logps[0, -len(tokens) :]
                    greedy = bool((picked.argmax(dim=-1) == tokens).all())
                    out.append((float(picked.gather(1, tokens.unsqueeze(1)).sum()), greedy))
        self._fill()
        return order.get_original(out)

    @torch.no_grad()
    def _score(self, batch: list[TokenRequest]) -> list[torch.Tensor]:
        """One right-padded forward of the batch: each request's [1, continuation, vocabulary] fp32 log-probabilities
        of the positions that predict its continuation (the input cut to max_length from the left, as HFLM cuts it)."""
        inputs = [(context + continuation)[-(self.max_length + 1) :][:-1] for _, context, continuation in batch]
        width = max(len(i) for i in inputs)
        ids = torch.full((len(inputs), width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        # right padding after each row's tokens changes none of theirs (causal): no mask, as HFLM runs it
        out = self._forward({"input_ids": ids.to(self.env.device)})
        rows = torch.cat(
            [
                torch.arange(len(tokens) - len(continuation), len(tokens)) + row * width
                for row, ((_, _, continuation), tokens) in enumerate(zip(batch, inputs))
            ]
        ).to(out.device)
        picked = out.reshape(-1, out.shape[-1]).index_select(0, rows)  # the positions that predict a continuation
        logits = F.linear(picked, self.head.head.weight) if self.head is not None else picked
        logps = F.log_softmax(logits.float(), dim=-1)
        return [part.unsqueeze(0) for part in logps.split([len(r[2]) for r in batch])]

    def _forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's final hidden states (with `head`) or logits."""
        self.forwards += 1
        return head_forward(self.model, self.head, batch)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:  # noqa: ANN001
        """Each string's log-likelihood over windows of max_length tokens, each token predicted once (lm-eval's
        rolling windows, from the prefix token)."""
        windows: list[TokenRequest] = []
        owners: list[int] = []
        for index, (string,) in enumerate(r.args for r in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logp, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logp
        return totals

    # ------------------------------------------------------------ generation

    @torch.no_grad()
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:  # noqa: ANN001
        """Each request's continuation, up to its first stop string (cut there) or max_gen_toks tokens."""
        indexed = [(i, *r.args) for i, r in enumerate(requests)]
        order = Collator(
            indexed,
            sort_fn=lambda r: (-len(self.tok_encode(r[1])), r[1]),
            group_by="gen_kwargs",
            group_fn=lambda r: r[2],
        )
        batches = []
        for batch in order.get_batched(n=self.batch_size):
            settings = normalize_gen_kwargs(copy.deepcopy(batch[0][2]), self.max_gen_toks)
            until = handle_stop_sequences(settings.pop("until", None), eos=self.tok_decode([self.eot_token_id], False))
            batches.append((batch, settings, until))
        # on the shards, every batch decodes all its max_gen_toks steps (its prefill, then one forward a token)
        self._lockstep(sum(int(settings["max_gen_toks"]) for _, settings, _ in batches))
        out = []
        for batch, settings, until in batches:
            out += self._generate(batch, settings, until)
        self._fill()
        return order.get_original(out)

    def _generate(self, batch: list[tuple], settings: dict[str, Any], until: list[str]) -> list[str]:
        new_tokens = int(settings["max_gen_toks"])
        if new_tokens >= self.max_length:
            raise ConfigError(
                f"max_gen_toks {new_tokens} (a task's generation_kwargs, or --gen_kwargs): must be below the model's "
                f"{self.max_length} tokens of context"
            )
        prompts = [self.tok_encode(context, left_truncate_len=self.max_length - new_tokens) for _, context, _ in batch]
        eos = [self.eot_token_id]
        if settings.get("do_sample") and settings.get("temperature", 0.0) > 0:
            keys = completion_keys(self.seed, 0, [index for index, _, _ in batch], [0] * len(batch))
            sampling = Sampling(
                new_tokens, settings["temperature"], settings.get("top_p", 1.0), settings.get("top_k") or 0
            )
            warp = processors(sampling, keys, max(len(p) for p in prompts))
            choose: Callable = lambda ids, logits: warp(ids, logits).argmax(dim=-1)
        else:
            choose = lambda ids, logits: logits.argmax(dim=-1)
        rows = self.decoder.decode(
            self.model,
            prompts,
            choose,
            max_new_tokens=new_tokens,
            eos_ids=eos if self.gather else [],  # on the shards every rank runs every step
            pad_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos[0],
            device=self.env.device,
            done_when=self._stopped(until) if self.gather else None,
            on_forward=self._count,
        )
        texts = []
        for tokens in rows:
            ended = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
            texts.append(postprocess_generated_text(self.tok_decode(tokens[:ended]), until, None))
        return texts

    def _count(self) -> None:
        self.forwards += 1

    def _stopped(self, until: list[str]) -> Callable[[torch.Tensor], torch.Tensor]:
        """A decoding row's test for its end: its text so far holds one of the stop strings."""
        stops = [s for s in until if s]

        def done(generated: torch.Tensor) -> torch.Tensor:
            texts = self.tokenizer.batch_decode(generated.tolist(), skip_special_tokens=False)
            return torch.tensor([any(s in t for s in stops) for t in texts], device=generated.device)

        return done

    # ------------------------------------------------------------ the shards' lockstep

    def _lockstep(self, forwards: int) -> None:
        """On the shards (each forward a collective): the most forwards any rank runs in this call, agreed before the
        first; `_fill` runs the rest as one-token fillers."""
        self.forwards, self._target = 0, forwards
        if not self.gather and self.world_size > 1:
            most = torch.tensor([forwards], dtype=torch.long, device=self.env.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            self._target = int(most.item())

    @torch.no_grad()
    def _fill(self) -> None:
        if self.gather or self.world_size == 1:
            return
        filler = torch.full((1, 1), self.prefix_token_id, dtype=torch.long, device=self.env.device)
        while self.forwards < self._target:
            self._forward({"input_ids": filler})
