"""Durable file writes: a checkpoint is either whole under its final name or not there at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fsdp_opt.base import CheckpointError, size_text


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


@contextlib.contextmanager
def atomic_path(path: Path, durable: bool = True) -> Iterator[Path]:
    """The one way files are written here: the caller writes the temporary name this yields, in the same folder;
    on success it is fsynced (`durable`) and renamed to `path`, on any failure removed. Never a half file under
    `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save through `atomic_path`."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGXFSZ"):
        # A file-size limit should fail the write (EFBIG), not kill the process mid-file.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        sink = _RecordingWriter(f)
        try:
            torch.save(obj, sink)
        except RuntimeError:
            # torch's zip writer reports a failed write as a RuntimeError; surface the OS's reason.
            if sink.error is not None:
                raise sink.error from None
            raise


def atomic_save_text(text: str, path: Path) -> None:
    """A small text file (a report, a config), written to a temporary name and renamed into place."""
    with atomic_path(path, durable=False) as tmp:
        tmp.write_text(text)


class _RecordingWriter:
    """A file wrapper that remembers the OSError of a failed write."""

    def __init__(self, f: Any):
        self.f = f
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_or_explain(obj: Any, path: Path) -> None:
    """atomic_save, turning a full disk into one line that names the path and the space needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    needed = tensor_bytes(obj)
    free = shutil.disk_usage(path.parent).free
    if needed > free:
        raise CheckpointError(
            f"cannot save {path}: about {size_text(needed)} needed, {size_text(free)} free there "
            "(free space, or use --save_optimizer false / a smaller --keep_last); earlier checkpoints are kept"
        )
    try:
        atomic_save(obj, path)
    except OSError as exc:
        raise CheckpointError(
            f"cannot save {path}: {exc.strerror or exc} (about {size_text(needed)} needed, "
            f"{size_text(shutil.disk_usage(path.parent).free)} free there); earlier checkpoints are kept"
        ) from None


def remove_stale_temp(output_dir: Path) -> list[Path]:
    """Temporary files and folders a killed save, Hub download or upload left behind (never a checkpoint's final name)."""
    if not output_dir.is_dir():
        return []
    stale = [
        p
        for p in output_dir.iterdir()
        if p.name.startswith(".")
        and (".tmp" in p.name or p.name.endswith(".old") or p.name.startswith((".download-", ".upload-")))
    ]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return stale
