"""A chain of sessions as one run over a dataset: which range comes next, and where the chain stands.

`next_range` (--start_idx auto) reads only the newest checkpoint's name, `{tag}_{start}-{end}-epoch-{k}[-step-{g}]`:
no checkpoint: [0, N); range [s, e) finished in pass k: [e, e+N) cut at the end of the data, or once the data is used
up, [0, N) of pass k+1 while --num_epochs allows it; an interrupted range (a `-step-` name): the rest of that range.

`ChainStatus` says where the chain stands: ranges done, the range now, rows left, and the rate measured so far. Every
checkpoint carries one (and so does its entry in the Hub index): the start of a session prints it, the card shows it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from fsdp_opt.base import CheckpointError
from fsdp_opt.checkpoint.names import parse_name

CHAIN_KEY = "chain"  # of a checkpoint's payload and of its Hub index entry


@dataclass(frozen=True)
class NextRange:
    start: int
    end: int
    epoch: int  # 0-based pass over the dataset that this range belongs to
    resume: str | None  # the checkpoint to resume from; None: the chain starts here
    finishing: bool  # `resume` stopped inside this range: the session finishes it


def range_after(end: int, epoch: int, rows: int, range_size: int, passes: int) -> tuple[int, int, int] | None:
    """(start, end, epoch) of the range after one that ended at row `end` in pass `epoch` (0-based); None: all done."""
    if end < rows:
        return end, min(end + range_size, rows), epoch
    if epoch + 1 < passes:
        return 0, min(range_size, rows), epoch + 1
    return None


def next_range(
    newest: str | None, rows: int, range_size: int, passes: int, flag: str = "--start_idx auto"
) -> NextRange | None:
    """The range a session of an auto chain trains, from the name of the newest checkpoint; None: every pass is done."""
    if newest is None:
        return NextRange(0, min(range_size, rows), 0, None, False)
    parsed = parse_name(newest)
    if parsed is None:
        raise CheckpointError(f"{flag}: the newest checkpoint, {newest}, has no range in its name")
    start, end, epoch = parsed["start"], parsed["end"], parsed["epoch"]  # epoch: 1-based, finished or (-step-) running
    if parsed["step"] is not None:
        return NextRange(start, end, epoch - 1, newest, True)
    after = range_after(end, epoch - 1, rows, range_size, passes)
    return None if after is None else NextRange(*after, newest, False)


def last_epoch(resume: str | None, start: int, end: int | None, initial_epoch: int, epochs: int) -> int:
    """The 1-based epoch in the name of the last checkpoint a session of [start, end) saves: --num_epochs after the
    epoch it starts in, which is the resumed checkpoint's own when that checkpoint is of this range (a `-step-` one:
    the epoch it stopped in; a finished one: the epoch after it), else --initial_epoch."""
    parsed = parse_name(resume) if resume else None
    if parsed and parsed["start"] == start and end in (None, parsed["end"]):
        return parsed["epoch"] - (1 if parsed["step"] is not None else 0) + epochs
    return initial_epoch + epochs


@dataclass
class ChainStatus:
    """Where a chain stands at one checkpoint. Positions are rows of the dataset: inside a range, the share of its
    samples trained so far counts as the same share of its rows."""

    rows: int  # of the whole dataset
    start: int  # the range now
    end: int
    epoch: int  # 0-based pass over the data of the range now
    position: float  # the row the chain has reached in this pass: `end` once the range is done
    ranges_done: int = 0
    rows_trained: float = 0.0  # in the whole chain, each pass counted again
    train_seconds: float = 0.0  # of training in the whole chain (each session's setup not counted)
    range_size: int | None = None  # --range_size of an auto chain
    passes: int | None = None  # --num_epochs of an auto chain
    session_seconds: float | None = None  # --time_limit of the latest session

    def move_to(self, epoch: int, offset: int, num_samples: int) -> None:
        """The position after `offset` of the range's `num_samples` samples in pass `epoch`."""
        self.epoch = epoch
        self.position = self.start + (self.end - self.start) * offset / max(1, num_samples)

    @property
    def range_done(self) -> bool:
        return self.position >= self.end

    def rows_left(self) -> int:
        """Rows still to train: to the end of the data, and with an auto chain, the passes after this one."""
        later = (self.passes - self.epoch - 1) * self.rows if self.passes else 0
        return max(0, math.ceil(self.rows - self.position) + max(0, later))

    def rows_per_hour(self) -> float | None:
        if self.train_seconds <= 0 or self.rows_trained <= 0:
            return None
        return self.rows_trained / self.train_seconds * 3600

    def following(self) -> tuple[int, int, int] | None:
        """The range after this one in an auto chain (None: done, or not an auto chain)."""
        if not (self.range_size and self.passes):
            return None
        return range_after(self.end, self.epoch, self.rows, self.range_size, self.passes)

    def items(self) -> list[tuple[str, str]]:
        """(what, where it stands): the lines of the start-of-session report and of the model card."""
        passes = f" of {self.passes}" if self.passes else ""
        done = f"{self.ranges_done}" + (
            f", the last [{self.start}, {self.end}) in pass {self.epoch + 1}{passes}" if self.range_done else ""
        )
        if not self.range_done:
            share = (self.position - self.start) / max(1, self.end - self.start)
            now = (
                f"[{self.start}, {self.end}) of {self.rows:,} rows, pass {self.epoch + 1}{passes}, {share:.0%} trained"
            )
        elif self.following() is not None:
            s, e, k = self.following()
            now = f"[{s}, {e}) next, pass {k + 1}{passes}"
        elif self.range_size and self.passes:
            now = "none: the chain is done"
        else:
            now = (
                f"the next starts at row {self.end} of {self.rows:,}" if self.end < self.rows else "the data is used up"
            )
        left = self.rows_left()
        items = [
            ("ranges done", done),
            ("range now", now),
            ("rows left", f"{left:,}" + (" (to the end of the data)" if not self.passes else "")),
        ]
        rate = self.rows_per_hour()
        if not left:
            pace = "none"
        elif rate is None:
            pace = "not measured yet"
        else:
            hours = left / rate
            pace = f"{hours:,.1f} h at the {rate:,.0f} rows/h measured"
            if self.session_seconds:
                pace = (
                    f"{math.ceil(hours * 3600 / self.session_seconds):,} of {_duration(self.session_seconds)} ({pace})"
                )
        items.append(("sessions left", pace))
        return items

    def describe(self) -> str:
        return "; ".join(f"{what} {where}" for what, where in self.items())

    def line(self) -> str:
        return "chain: " + self.describe()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> ChainStatus | None:
        if not isinstance(values, dict):
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in values.items() if k in names})
        except TypeError:  # a record missing a field: not this version's
            return None


def _duration(seconds: float) -> str:
    minutes = int(round(seconds / 60))
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m"
