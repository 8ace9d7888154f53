"""--start_idx auto's arithmetic: the next range from the newest checkpoint's name, where the chain stands, and when a
further range fits in a session. Expected values are written out by hand from the rules in docs/kaggle.md."""

from __future__ import annotations

import pytest

from fsdp_opt.base import CheckpointError
from fsdp_opt.checkpoint.chain import ChainStatus, NextRange, last_epoch, next_range
from fsdp_opt.runtime.stopping import resume_command
from fsdp_opt.train.chain import range_fits

ROWS, N = 12_000, 5000


@pytest.mark.parametrize(
    "newest,passes,want",
    [
        # a fresh chain
        (None, 1, NextRange(0, 5000, 0, None, False)),
        # a finished range: the next one, the last cut at the end of the data
        ("opt_1.3B_0-5000-epoch-1.pt", 1, NextRange(5000, 10000, 0, "opt_1.3B_0-5000-epoch-1.pt", False)),
        ("opt_1.3B_5000-10000-epoch-1.pt", 1, NextRange(10000, 12000, 0, "opt_1.3B_5000-10000-epoch-1.pt", False)),
        # the data used up: the next pass from row 0 while --num_epochs allows it, else done
        ("opt_1.3B_10000-12000-epoch-1.pt", 2, NextRange(0, 5000, 1, "opt_1.3B_10000-12000-epoch-1.pt", False)),
        ("opt_1.3B_10000-12000-epoch-1.pt", 1, None),
        ("opt_1.3B_10000-12000-epoch-2.pt", 2, None),
        ("opt_1.3B_5000-10000-epoch-2.pt", 2, NextRange(10000, 12000, 1, "opt_1.3B_5000-10000-epoch-2.pt", False)),
        # interrupted inside a range (a -step- name, epoch in progress): finish that same range, whatever the pass
        (
            "opt_1.3B_5000-10000-epoch-1-step-61.pt",
            1,
            NextRange(5000, 10000, 0, "opt_1.3B_5000-10000-epoch-1-step-61.pt", True),
        ),
        (
            "opt_1.3B_10000-12000-epoch-2-step-300",
            2,
            NextRange(10000, 12000, 1, "opt_1.3B_10000-12000-epoch-2-step-300", True),
        ),
        # a range of another size typed by hand earlier: the chain goes on from its end
        ("tiny_opt_0-777-epoch-1.pt", 1, NextRange(777, 5777, 0, "tiny_opt_0-777-epoch-1.pt", False)),
    ],
)
def test_next_range(newest, passes, want):
    assert next_range(newest, ROWS, N, passes) == want


def test_next_range_data_shorter_than_a_range_and_bad_names():
    assert next_range(None, 30, 100, 1) == NextRange(0, 30, 0, None, False)
    assert next_range("m_0-30-epoch-1.pt", 30, 100, 3) == NextRange(0, 30, 1, "m_0-30-epoch-1.pt", False)
    with pytest.raises(CheckpointError, match="no range in its name"):
        next_range("final.pt", 30, 100, 1)


@pytest.mark.parametrize(
    "resume,end,initial,epochs,want",
    [
        (None, 16, 0, 1, 1),  # a fresh range: its first epoch
        (None, 16, 1, 2, 3),  # --initial_epoch 1 --num_epochs 2: epochs 2 and 3
        ("m_0-8-epoch-1.pt", 16, 0, 1, 1),  # resumed from another range: that range's epochs count nothing here
        ("m_0-16-epoch-1.pt", 16, 0, 1, 2),  # resumed from this range's finished epoch 1: epoch 2 next
        ("m_0-16-epoch-2-step-7.pt", 16, 0, 1, 2),  # resumed inside epoch 2: it finishes epoch 2
        ("m_0-16-epoch-2-step-7.pt", None, 0, 2, 3),  # --end_idx left to the data: the start decides
    ],
)
def test_the_last_epoch_a_session_saves(resume, end, initial, epochs, want):
    assert last_epoch(resume, 0, end, initial, epochs) == want


def test_status_counts_rows_left_and_sessions():
    # Pass 1 of 2 over 12,000 rows, inside [5000, 10000) at 40% (row 7000); 3,000 rows/h measured over 10 h of
    # training; sessions of 11h30m. Left: 5,000 rows of this pass and 12,000 of the next = 17,000 rows,
    # 17,000 / 3,000 = 5.67 h: one session.
    s = ChainStatus(
        rows=ROWS,
        start=5000,
        end=10000,
        epoch=0,
        position=7000.0,
        ranges_done=1,
        rows_trained=30_000.0,
        train_seconds=36_000.0,
        range_size=N,
        passes=2,
        session_seconds=11.5 * 3600,
    )
    assert s.rows_left() == 17_000 and s.rows_per_hour() == pytest.approx(3000.0)
    items = dict(s.items())
    assert items["ranges done"] == "1"
    assert items["range now"] == "[5000, 10000) of 12,000 rows, pass 1 of 2, 40% trained"
    assert items["rows left"] == "17,000"
    assert items["sessions left"] == "1 of 11h30m (5.7 h at the 3,000 rows/h measured)"
    # At 1,000 rows/h the same 17,000 rows take 17 h: two sessions.
    slow = ChainStatus(**{**s.to_dict(), "rows_trained": 10_000.0})
    assert dict(slow.items())["sessions left"].startswith("2 of 11h30m (17.0 h")
    # A finished range names the next; the last range of the last pass says the chain is done.
    done_range = ChainStatus(**{**s.to_dict(), "position": 10000.0, "ranges_done": 2})
    assert dict(done_range.items())["range now"] == "[10000, 12000) next, pass 1 of 2"
    assert dict(done_range.items())["ranges done"] == "2, the last [5000, 10000) in pass 1 of 2"
    end = ChainStatus(**{**s.to_dict(), "start": 10000, "end": 12000, "epoch": 1, "position": 12000.0})
    assert end.rows_left() == 0 and dict(end.items())["range now"] == "none: the chain is done"
    assert dict(end.items())["sessions left"] == "none"
    # An explicit chain (no --range_size): rows to the end of the data, hours without a session length.
    explicit = ChainStatus(
        rows=ROWS, start=0, end=5000, epoch=0, position=2500.0, rows_trained=2500.0, train_seconds=1800.0
    )
    assert dict(explicit.items())["rows left"] == "9,500 (to the end of the data)"
    assert dict(explicit.items())["sessions left"] == "1.9 h at the 5,000 rows/h measured"
    fresh = ChainStatus(rows=ROWS, start=0, end=5000, epoch=0, position=0.0)
    assert dict(fresh.items())["sessions left"] == "not measured yet"
    assert ChainStatus.from_dict(s.to_dict()) == s and ChainStatus.from_dict(None) is None
    assert ChainStatus.from_dict({"rows": 3}) is None  # not a whole record


def test_a_further_range_starts_only_when_all_of_it_fits():
    # 100 steps of 2 s and a 60 s save need 200 + 60 + 10 s of margin = 270 s.
    assert range_fits(100, 2.0, 60.0, 270.0) and not range_fits(100, 2.0, 60.0, 269.0)
    assert range_fits(10_000, 9.0, 600.0, None)  # no --time_limit


def test_resume_command_of_an_auto_chain_is_the_same_command():
    argv = ["--start_idx", "auto", "--range_size", "5000", "--hf_repo", "u/r"]
    assert resume_command("x_0-5000-epoch-1-step-9.pt", argv, "fsdp_finetune.py", same=True) == (
        "python fsdp_finetune.py --start_idx auto --range_size 5000 --hf_repo u/r"
    )
