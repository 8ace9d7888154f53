"""--start_idx auto: the chain of sessions finds its own range, and with --session_ranges, one session trains several.

A session of an auto chain resolves its flags into those of the explicit chain it stands for (`--start_idx s
--end_idx e --resume_file <newest> --initial_epoch k`) before anything is read or built, so its names, metrics,
W&B run and Hub files are the ones those flags make. A further range in the same process continues the session the
way a new session resuming from the range's last checkpoint would: same weights, optimizer, loss scale and global
step, the next range's blocks, and dropout seeded as a fresh session seeds it.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from fsdp_opt.base import CheckpointError, ConfigError
from fsdp_opt.checkpoint.chain import ChainStatus, NextRange, last_epoch, next_range
from fsdp_opt.checkpoint.drift import listed, trained_with_other_settings
from fsdp_opt.checkpoint.names import parse_name
from fsdp_opt.config.choices import AUTO
from fsdp_opt.config.parse import Config
from fsdp_opt.data.pin import packed_as, pinned_revision, with_range
from fsdp_opt.data.resolve import DataSource
from fsdp_opt.data.sources import mixture_definition, open_source
from fsdp_opt.engine.step import TrainState
from fsdp_opt.hub.finished import Finished, finished_here, finished_in_repo, resume_found
from fsdp_opt.hub.lease import TRIES as LEASE_TRIES
from fsdp_opt.hub.lease import FileLease, HubLease, Lease, Outcome, hold_seconds, new_holder
from fsdp_opt.hub.retry import describe
from fsdp_opt.hub.store import HubStore, newest_checkpoint, newest_pin
from fsdp_opt.model.sources import model_tag
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok, broadcast_object, print0
from fsdp_opt.runtime.stopping import StopControl
from fsdp_opt.train.components import Setup, for_range
from fsdp_opt.train.inputs import SliceData, read_slice, refuse_changed_mixture
from fsdp_opt.train.methods.base import PlanInput, RunParts
from fsdp_opt.train.saving import save_estimate
from fsdp_opt.train.session import Session, seed_dropout

MARGIN_S = 10.0  # seconds kept free at the end of --time_limit, as the stop rule keeps them


def range_config(config: Config, nxt: NextRange) -> Config:
    """The flags of the explicit chain for this range: its rows, its checkpoint, its pass."""
    return dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, start_idx=nxt.start, end_idx=nxt.end),
        train=dataclasses.replace(config.train, initial_epoch=nxt.epoch),
        checkpoint=dataclasses.replace(config.checkpoint, resume_file=nxt.resume),
    )


def first_range(config: Config, env: DistEnv) -> Config | None:
    """The session's flags with an auto range resolved (others as given); None when the chain is done, said in one
    line. Rank 0 reads the newest checkpoint's name (output_dir, then the Hub repo, which must be readable: a guess
    could train a range twice) and the dataset's row count; every rank gets the decision."""
    dc, cc = config.data, config.checkpoint
    if dc.start_idx != AUTO:
        return config

    def decide() -> tuple[NextRange | None, int, tuple | None]:
        hc = config.hub
        # A repo the token cannot open reads as empty: open (or create) it first, as the uploader would.
        if hc.hf_repo and not HubStore(hc.hf_repo, retries=hc.hub_retries).ensure_repo(private=not hc.hub_public):
            raise CheckpointError(
                f"--start_idx auto: cannot read the Hub repo {hc.hf_repo} now (it cannot be "
                "reached); its newest checkpoint decides the range, so none is guessed"
            )
        newest = newest_checkpoint(Path(cc.output_dir), hc.hf_repo, hc.hub_retries, "--start_idx auto", strict=True)
        pin = newest_pin(newest, hc.hf_repo, hc.hub_retries) if newest else None
        rows = dataset_rows(config, pin)
        return next_range(newest[0] if newest else None, rows, dc.range_size, config.train.num_epochs), rows, newest

    nxt, rows, newest = broadcast_object(all_ranks_ok(lambda: decide() if env.is_main else None))
    if nxt is None:
        print0(
            f"chain: done: {config.train.num_epochs} pass(es) over the {rows:,} rows of {dc.dataset} in ranges of "
            f"{dc.range_size:,}; the newest checkpoint, {newest[0]} (global step {newest[1]}), ends the last range. "
            "Nothing to train."
        )
        return None
    if nxt.resume is None:
        how = "no checkpoint yet: the chain starts"
    elif nxt.finishing:
        how = f"the newest checkpoint, {nxt.resume} (global step {newest[1]}), stopped inside its range: finishing it"
    else:
        how = f"the newest checkpoint, {nxt.resume} (global step {newest[1]}), ends its range: going on"
    print0(f"chain: {how} with rows [{nxt.start}, {nxt.end}) (pass {nxt.epoch + 1} of {config.train.num_epochs})")
    return range_config(config, nxt)


def dataset_rows(config: Config, pin: dict | None) -> int:
    """The split's length: from the chain's record of it where it has one (no card, no footers read), else from the
    split's metadata; a split stored as parquet is not downloaded for it. A mixture redefined since the chain's
    record is refused here, before the lease or the data's own lines."""
    dc = config.data
    refuse_changed_mixture(dc.dataset, pin, mixture_definition(DataSource.of(dc)))
    src = DataSource.of(dc, dc.dataset_revision or pinned_revision(pin, DataSource.of(dc)))
    return len(open_source(src, pin))


def already_trained(config: Config, env: DistEnv) -> bool:
    """An explicit range whose last checkpoint (its name: this range, the epoch the session would end in) is in
    --output_dir or the Hub repo already, as it is when "Save & Run All" runs a finished session's cell again: True
    after one line saying so (nothing is trained or written); refused in one line naming the flags when it trained
    with other settings; with --overwrite, a line, and False: it trains again. Rank 0 looks, before the chain's
    lease is taken and anything is built; every rank gets the answer."""
    dc, cc, hc = config.data, config.checkpoint, config.hub
    if dc.start_idx == AUTO:  # an auto chain trains the range after its newest checkpoint, never one it has
        return False

    def decide() -> str | None:
        out_dir = Path(cc.output_dir)
        resume = cc.resume_file
        if resume == "latest":
            newest = newest_checkpoint(out_dir, hc.hf_repo, 1)
            resume = newest[0] if newest else None
        epoch = last_epoch(
            resume and Path(resume).name, dc.start_idx, dc.end_idx, config.train.initial_epoch, config.train.num_epochs
        )
        tag = model_tag(config.model.model)

        def ours(parsed: dict) -> bool:
            return (
                (parsed["tag"], parsed["start"]) == (tag, dc.start_idx)
                and parsed["epoch"] >= epoch
                and (dc.end_idx in (None, parsed["end"]))
            )

        try:
            found = finished_here(ours, out_dir)
        except CheckpointError as exc:
            if cc.overwrite:  # trained again anyway: an unreadable checkpoint of the range is replaced
                return None
            raise CheckpointError(f"{exc}; it is this range's: --overwrite trains the range again") from None
        if found is None and hc.hf_repo:
            try:
                found = finished_in_repo(ours, hc.hf_repo)
            except Exception as exc:  # noqa: BLE001 - network, auth: the repo is not asked, and the session trains
                print0(
                    f"warning: cannot read the Hub repo {hc.hf_repo} ({describe(exc)}): whether it holds rows "
                    f"[{dc.start_idx}, {dc.end_idx or 'end'}) trained already is not known"
                )
        if found is None or (dc.end_idx is None and parse_name(found.name)["end"] != dataset_rows(config, found.pin)):
            return None
        if cc.resume_file not in (None, "latest") and not resume_found(cc.resume_file, out_dir, hc.hf_repo):
            return None  # a --resume_file found nowhere: that flag's own line, where the run reads it
        return finished_line(config, env, found, epoch)

    line = broadcast_object(all_ranks_ok(lambda: decide() if env.is_main else None))
    if line is not None:
        print0(line)
    return line is not None and not cc.overwrite


def finished_line(config: Config, env: DistEnv, found: Finished, epoch: int) -> str:
    """The line for a range found trained (already_trained); a ConfigError when its settings differ."""
    tc, start = config.train, config.data.start_idx
    end = parse_name(found.name)["end"]
    batch = tc.global_batch if tc.batch_size == AUTO else tc.samples_per_step(env.world_size)
    changes = (
        [] if found.config is None else trained_with_other_settings(config, found.config, found.global_batch, batch)
    )
    what = f"rows [{start}, {end}), epoch {epoch}, are trained already"
    step = "" if found.global_step is None else f", global step {found.global_step}"
    where = f"({found.name}{step}, in {found.where})"
    following = f"--start_idx {end} --end_idx {end + (end - start)} --resume_file {found.name}"
    if config.checkpoint.overwrite:
        return (
            f"overwrite: {what} {where}: training them again; the checkpoint is replaced, and the step logs' records "
            "of the steps trained again move to metrics.replaced.jsonl"
        )
    if changes:
        raise ConfigError(
            f"{listed(changes)}: {what}, with the setting{'s' if len(changes) > 1 else ''} before the arrow {where}. To train them "
            "with these settings, give a new --output_dir (a new chain) or --overwrite (this range again, its "
            f"checkpoint replaced); to go on with the chain, train the next range: {following}"
        )
    unknown = " (the repo's index does not record their settings: not compared)" if found.config is None else ""
    return (
        f"chain: done: {what} with these settings {where}{unknown}. Nothing to train; --overwrite trains them "
        f"again, and the chain goes on with {following}"
    )


def claim(config: Config, env: DistEnv) -> tuple[Config | None, Lease | None]:
    """This session's range (first_range) and the chain's lease, decided against one state of the repo: the lease is
    committed on the head the range was read at, so a commit that landed in between (another session's lease, the
    last checkpoint of one that just ended) sends the session back to decide again. (None, None) when the chain is
    done or another session holds the lease: nothing to train, said in one line. The lease is rank 0's."""
    hc = config.hub
    if already_trained(config, env):
        return None, None

    def make() -> Lease | None:
        hold = hold_seconds(config.checkpoint.time_limit_seconds, hc.hub_wait_seconds)
        if not hc.hf_repo:
            return FileLease(Path(config.checkpoint.output_dir), new_holder(None, None, hold), hold)
        store = HubStore(hc.hf_repo, retries=hc.hub_retries)
        if store.ensure_repo(private=not hc.hub_public):  # a token the Hub refuses: one line, on every rank
            return HubLease(store, new_holder(None, None, hold), hold)
        print0(
            f"warning: the Hub cannot be reached now to take the chain's lease on {hc.hf_repo}: this session "
            "trains without it (uploads will retry)"
        )
        return None

    lease = all_ranks_ok(lambda: make() if env.is_main else None)
    for _ in range(LEASE_TRIES):
        head = broadcast_object(all_ranks_ok(lambda: lease.head() if isinstance(lease, HubLease) else None))
        resolved = first_range(config, env)
        if resolved is None:
            return None, None

        def take() -> Outcome:
            if lease is None:
                return Outcome(True, "")
            lease.holder.start, lease.holder.end = resolved.data.start_idx, resolved.data.end_idx
            return lease.take(hc.take_over, head)

        outcome = broadcast_object(all_ranks_ok(lambda: take() if env.is_main else None))
        if outcome.conflict:
            continue
        if outcome.line:
            print0(outcome.line)
        return (resolved, lease) if outcome.won else (None, None)
    raise CheckpointError(
        f"--hf_repo {hc.hf_repo}: the repo kept changing while this session took the chain's lease "
        f"({LEASE_TRIES} tries); run it again"
    )


def range_fits(steps: int, step_seconds: float, save_seconds: float, seconds_left: float | None) -> bool:
    """Whether a whole range (its steps at the measured step time, then its save) fits in what --time_limit leaves."""
    return seconds_left is None or steps * step_seconds + save_seconds + MARGIN_S <= seconds_left


def next_in_session(session: Session, stop: StopControl, trained_here: int) -> Session | None:
    """After a finished range: the session of the next one, in this process, when --session_ranges and --time_limit
    allow it (None: the session ends here). Every rank calls this at the same point; the decisions are agreed."""
    dc = session.config.data
    if dc.range_size is None or session.chain is None:
        return None
    after = session.chain.following()
    if after is None:
        print0("chain: done: every pass over the data is trained")
        return None
    if dc.session_ranges and trained_here >= dc.session_ranges:
        print0(
            f"chain: {trained_here} range(s) this session (--session_ranges {dc.session_ranges}); the next session "
            f"goes on with [{after[0]}, {after[1]})"
        )
        return None
    reason = stop.check(save_estimate(session))
    if reason:
        print0(f"chain: {reason}: the next session goes on with [{after[0]}, {after[1]})")
        return None
    why_not = session.components.further_range()
    if why_not:
        print0(f"chain: {why_not}: the next session goes on with [{after[0]}, {after[1]})")
        return None
    p = session.position
    config = range_config(
        session.config, NextRange(*after, resume=p.last_saved_path.name if p.last_saved_path else None, finishing=False)
    )
    data = read_slice(
        config, session.tokenizer, session.model_config, session.method, session.data_revision, session.data_pin
    )
    plan = session.method.plan(
        data.blocks,
        PlanInput(
            session.layout.batch_size, session.accum_steps, session.env.rank, session.env.world_size, config.train.seed
        ),
    )
    steps = plan.steps_per_epoch()
    step_s = statistics.median(p.step_seconds) if p.step_seconds else 0.0
    left = stop.seconds_left()
    fits = broadcast_object(range_fits(steps, step_s, save_estimate(session), left) if session.env.is_main else None)
    if not fits:
        print0(
            f"chain: the next range, [{after[0]}, {after[1]}) ({steps} steps, about {steps * step_s / 60:,.1f} min at "
            f"{step_s:.2f} s per step, then a save), does not fit in the {left / 60:,.1f} min left of --time_limit; "
            "the next session starts it"
        )
        return None
    return switch_range(session, config, data, plan)


def switch_range(session: Session, config: Config, data: SliceData, plan) -> Session:  # noqa: ANN001
    """The session of the next range, as a new session resuming from the last checkpoint would start it: its rows,
    plan and position, the method's loss and scorer for them; the model, optimizer, uploader and W&B run go on."""
    data_pin = session.data_pin
    if data_pin is not None:  # rank 0
        data_pin = with_range(
            data_pin,
            data_pin["source"],
            config.data.start_idx,
            data.end_idx,
            data.rows_digest,
            data.tokens_digest,
            packed_as(config.data.max_length, config.data.packing),
        )
    state = TrainState(session.state.global_step, config.train.initial_epoch, 0)
    seed_dropout(config, session.env)
    chain = dataclasses.replace(session.chain, start=config.data.start_idx, end=data.end_idx)
    chain.move_to(state.epoch, 0, plan.num_samples)
    made = Setup(
        env=session.env,
        model_name=config.model.model,
        model_config=session.model_config,
        tokenizer=session.tokenizer,
        lora=session.lora is not None,
        sequences=data.blocks,
        held_out=data.eval_blocks,
        plan=plan,
        epochs=range(state.epoch, state.epoch + 1),
        batch_size=session.layout.batch_size,
        gather=session.layout.gathered,
    )
    components = for_range(session.components, session.model, made)
    parts = RunParts(
        session.env,
        session.model_config,
        session.tokenizer,
        session.head_loss,
        data.blocks,
        data.eval_blocks,
        session.layout.batch_size,
        components,
    )
    print0(
        f"next range in this session: rows [{config.data.start_idx}, {data.end_idx}) -> {len(data.blocks)} blocks, "
        f"{plan.steps_per_epoch()} steps, from global step {state.global_step}"
    )
    print0(chain.line())
    return dataclasses.replace(
        session,
        config=config,
        blocks=data.blocks,
        plan=plan,
        end_idx=data.end_idx,
        eval_blocks=data.eval_blocks,
        eval_label=data.eval_label,
        data_pin=data_pin,
        components=components,
        loss=session.method.loss(parts),
        scorer=session.method.scorer(parts) if data.eval_blocks is not None else None,
        position=dataclasses.replace(session.position, state=state, chain=chain),
    )


def start_status(config: Config, end_idx: int, state: TrainState, plan, saved: dict | None, rows: int) -> ChainStatus:  # noqa: ANN001
    """Where the chain stands as this session starts: the counters of the resumed checkpoint (if it has them) and this
    session's range and position."""
    dc = config.data
    prev = ChainStatus.from_dict(saved)
    auto = dc.range_size is not None
    status = ChainStatus(
        rows=rows,
        start=dc.start_idx,
        end=end_idx,
        epoch=state.epoch,
        position=float(dc.start_idx),
        ranges_done=prev.ranges_done if prev else 0,
        rows_trained=prev.rows_trained if prev else 0.0,
        train_seconds=prev.train_seconds if prev else 0.0,
        range_size=dc.range_size,
        passes=config.train.num_epochs if auto else None,
        session_seconds=config.checkpoint.time_limit_seconds,
    )
    status.move_to(state.epoch, state.offset, plan.num_samples)
    return status
