"""Weights & Biases: a run per chain of sessions (resumed by id), step metrics, evaluations, and each pushed checkpoint
as an artifact referencing its file on the Hub. The API key is wandb's own; it is never read, printed or stored here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------- Weights & Biases (rank 0)


def wandb_key_configured() -> bool:
    """An API key in WANDB_API_KEY or in ~/.netrc for the W&B host (as `wandb login` leaves it). Never read out."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(flag: str) -> str:
    """The flag; for `auto`, W&B's own WANDB_MODE when set, else online with an API key and offline without."""
    if flag != "auto":
        return flag
    env = {"dryrun": "offline", "run": "online"}.get(os.environ.get("WANDB_MODE", ""), os.environ.get("WANDB_MODE", ""))
    if env in ("online", "offline", "disabled"):
        return env
    return "online" if wandb_key_configured() else "offline"


class WandbRun:
    """One W&B run per training run: the id travels in each checkpoint and is reused by the next session.

    Logs the flags (no secrets are flags), every metrics.jsonl record under train/, eval results under eval/,
    and each pushed checkpoint as an artifact that references its Hub file (no second upload). Any W&B failure
    prints one warning and turns logging off; training goes on.
    """

    def __init__(
        self, *, enabled: bool, project: str, mode: str, run_id: str | None, config: dict[str, Any], out_dir: Path
    ):
        self.run = None
        self.run_id = run_id
        self._start: tuple[str, str, dict[str, Any], Path] | None = None
        if not enabled:
            return
        mode = wandb_mode(mode)
        if mode == "disabled":
            return
        if mode == "online" and not wandb_key_configured():
            print("note: --wandb_mode online without a W&B API key (WANDB_API_KEY or `wandb login`); logging offline")
            mode = "offline"
        try:
            import wandb  # noqa: F401 - only whether it is there
        except ImportError:
            print("warning: wandb is not installed; W&B logging is off")
            return
        self.run_id = run_id or new_run_id()
        # Started with the first thing it logs (the first step's record): a session that stops before it trains (a
        # user error in its first step, say) leaves no W&B run behind, online or in the output folder.
        self._start = (project, mode, config, out_dir)

    def _started(self) -> bool:
        if self.run is None and self._start is not None:
            import wandb

            project, mode, config, out_dir = self._start
            self._start = None
            out_dir.mkdir(parents=True, exist_ok=True)
            for attempt in (mode, "offline") if mode == "online" else (mode,):
                try:
                    settings = wandb.Settings(
                        console="off",
                        silent=True,
                        x_disable_stats=True,
                        init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT", 60)),
                    )
                    self.run = wandb.init(
                        project=project,
                        id=self.run_id,
                        resume="allow",
                        mode=attempt,
                        dir=str(out_dir),
                        config=config,
                        settings=settings,
                    )
                    break
                except Exception as exc:  # noqa: BLE001 - no network, bad key: never fatal
                    first = (str(exc).splitlines() or [type(exc).__name__])[0]
                    try:
                        wandb.teardown()  # a failed start leaves W&B's service half-open; the next start needs a fresh one
                    except Exception:  # noqa: BLE001
                        pass
                    print(
                        f"warning: W&B {attempt} start failed ({type(exc).__name__}: {first})"
                        + ("; logging offline instead" if attempt == "online" else "; W&B logging is off")
                    )
            if self.run is not None:
                print(f"W&B run {self.run_id} ({attempt}) in project {project}; files under {out_dir / 'wandb'}")
        return self.run is not None

    def _safely(self, what: str, fn) -> None:
        if not self._started():
            return
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            print(f"warning: W&B {what} failed ({type(exc).__name__}); W&B logging is off")
            self.run = None

    def log_step(self, record: dict[str, Any]) -> None:
        values = {f"train/{k}": float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        # a mixture's per-source counts (source_rows, source_tokens): one series per source, numbered as in its file
        values |= {
            f"train/{k}/{n}": float(v)
            for k, vs in record.items()
            if k.startswith("source_")
            for n, v in enumerate(vs, 1)
        }
        self._safely("log", lambda: self.run.log(values, step=int(record["step"])))

    def log_eval(self, step: int, values: dict[str, float]) -> None:
        self._safely("log", lambda: self.run.log({f"eval/{k}": v for k, v in values.items()}, step=step))

    def log_values(self, step: int, values: dict[str, float]) -> None:
        """Values under their own names (lm-eval's scores: `arc_easy/acc`) at a step."""
        self._safely("log", lambda: self.run.log(dict(values), step=step))

    def log_table(self, key: str, step: int, rows: list[dict[str, Any]]) -> None:
        """A table (a row per dict; the columns of the first), as W&B shows sample completions."""
        if not rows:
            return

        def log() -> None:
            import wandb

            columns = list(rows[0])
            data = [
                [r.get(c) if isinstance(r.get(c), (int, float, str, type(None))) else str(r.get(c)) for c in columns]
                for r in rows
            ]
            self.run.log({key: wandb.Table(columns=columns, data=data)}, step=step)

        self._safely("table", log)

    def log_checkpoint(self, name: str, url: str, metadata: dict[str, Any]) -> None:
        def log() -> None:
            import wandb

            artifact = wandb.Artifact(_artifact_name(name), type="model", metadata=metadata)
            artifact.add_reference(url, name=name, checksum=False)
            step = metadata.get("global_step")
            self.run.log_artifact(artifact, aliases=["latest"] + ([f"step-{step}"] if step is not None else []))

        self._safely("artifact", log)

    def summarize(self, values: dict[str, Any]) -> None:
        """Keys of the run's summary (what W&B shows on the run's page after it ends)."""
        self._safely("summary", lambda: self.run.summary.update(values))

    def finish(self) -> None:
        if self.run is not None:  # never started (nothing logged): nothing to finish, nothing written
            self._safely("finish", lambda: self.run.finish())
        self._start, self.run = None, None


def new_run_id() -> str:
    """Eight lowercase letters and digits, the form of W&B's own run ids."""
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _artifact_name(checkpoint_name: str) -> str:
    """W&B artifact names allow letters, digits, '-', '_' and '.'."""
    import re

    return re.sub(r"[^\w.-]", "-", checkpoint_name)
