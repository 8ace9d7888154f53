"""What the Hub repo keeps (`--hub_keep_full N`): the newest N full checkpoints, and of every range the weights file
of its newest checkpoint. Everything else that fsdp-opt pushed goes.

A chain of ten opt-1.3b slices then holds one 15.8 GB resumable checkpoint and ten 2.63 GB weights files (42 GB)
instead of ten resumable checkpoints (158 GB). The decision is a pure function of what the repo holds, so the
uploader can apply it after every confirmed push and a later session can repeat it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_opt.checkpoint.names import parse_name
from fsdp_opt.checkpoint.weightsfile import checkpoint_of, weights_name


@dataclass
class Decision:
    keep_full: list[str] = field(default_factory=list)  # checkpoint names
    delete_full: list[str] = field(default_factory=list)
    keep_weights: list[str] = field(default_factory=list)  # weights file names
    delete_weights: list[str] = field(default_factory=list)
    # Older full checkpoints kept because their range has no weights file to stand for them (pushed before
    # retention was on): deleting them would leave the range with nothing.
    kept_without_weights: list[str] = field(default_factory=list)

    @property
    def changes(self) -> bool:
        return bool(self.delete_full or self.delete_weights)


def _range(name: str) -> tuple:
    parsed = parse_name(name)
    return (parsed["tag"], parsed["start"], parsed["end"]) if parsed else (name,)


def decide(steps: dict[str, int], full: set[str], weights: set[str], keep_full: int) -> Decision:
    """`steps`: global step of every checkpoint the run pushed (by checkpoint name); `full`: those whose full state
    is in the repo; `weights`: weights file names in the repo. Only names in `steps` are ever deleted."""
    if keep_full <= 0:
        return Decision(keep_full=sorted(full), keep_weights=sorted(weights))
    ours = {n for n in full if n in steps}
    ranked = sorted(ours, key=lambda n: (steps[n], n), reverse=True)
    newest = set(ranked[:keep_full])
    # The newest checkpoint of each range, whether its full state or only its weights are left.
    known = ours | {checkpoint_of(w) for w in weights if checkpoint_of(w) in steps}
    keeper: dict[tuple, str] = {}
    for name in sorted(known, key=lambda n: (steps[n], n)):
        keeper[_range(name)] = name
    keep_w = {weights_name(k) for k in keeper.values()} & weights
    decision = Decision(keep_weights=sorted(keep_w))
    decision.delete_weights = sorted(w for w in weights - keep_w if checkpoint_of(w) in steps)
    for name in sorted(full):
        if name in newest or name not in ours:
            decision.keep_full.append(name)
        elif keeper[_range(name)] == name and weights_name(name) not in weights:
            decision.kept_without_weights.append(name)
            decision.keep_full.append(name)
        else:
            decision.delete_full.append(name)
    return decision
