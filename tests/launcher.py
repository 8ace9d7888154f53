"""A launcher for the tests that forks ranks from a process that has imported torch, transformers and the package
already: the same command as `torchrun --standalone --nproc_per_node=N script args` (or `python script args` for
nproc 0), without paying 6 s of imports in every process of every launch.

How it runs a command:
- one server per pytest worker (`Zygote`), started once with the tests' environment and markers in place of the
  values that differ between tests (HF_HOME, HF_ENDPOINT): it imports the heavy modules, starts no thread, and waits
  on a Unix socket;
- for each request it forks a supervisor in a session of its own, which answers with its pid and forks the ranks;
- each rank takes the request's environment, re-reads the settings huggingface_hub and datasets take from the
  environment at import (and refuses to run if any module still holds a marker), then runs the script or module as
  `__main__` with its arguments, its output going to the files the client named;
- as torchrun does, the supervisor stops the other ranks (SIGTERM, then SIGKILL after 30 s) when one fails and
  reports exit code 1; with nproc 0 the process's own code.

What it does not stand in for: torchrun's own behaviour (its signals, its failure report, its process names). Tests
of those launch the real torchrun (`conftest.torchrun_cmd`, `run_cli(..., real=True)`), and so does any request
whose PYTHONPATH differs from the server's (a test that shadows a package).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HF_HOME_MARK = "/zygote-unset/hf-home"
ENDPOINT_MARK = "http://zygote-unset.invalid"
# Imported once by the server: what a training run, the evaluation and the planner import.
# (Not the commands themselves: runpy warns when the module it runs as __main__ is imported already.)
PRELOAD = (
    "fsdp_opt.train.run",
    "fsdp_opt.train.compare",
    "fsdp_opt.planner.report",
    "fsdp_opt.checkpoint.export",
    "datasets",
    "peft",
    "wandb",
)
# Modules whose settings come from the environment at import; re-read in every rank.
RELOAD = ("huggingface_hub.constants", "datasets.config")
# Copies of those settings that other modules took at their import (`from ..constants import X`).
COPIES = {
    "huggingface_hub.utils._cache_manager": ("HF_HUB_CACHE",),
    "huggingface_hub.utils._cache_assets": ("HF_ASSETS_CACHE",),
    "huggingface_hub.utils.tqdm": ("HF_HUB_DISABLE_PROGRESS_BARS",),
    "huggingface_hub.utils._git_credential": ("ENDPOINT",),
}
SCANNED = ("huggingface_hub", "transformers", "datasets", "peft", "fsdp_opt")
STOP_GRACE_S = 30.0  # torchrun's: SIGTERM, then SIGKILL


# ------------------------------------------------------------------ client side


class Zygote:
    """The server of one pytest worker, started on first use."""

    def __init__(self, env: dict[str, str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="zygote-"))
        self.socket = str(self.dir / "sock")
        self.pythonpath = env.get("PYTHONPATH", "")
        self.omp = env.get("OMP_NUM_THREADS")
        base = dict(env, HF_HOME=HF_HOME_MARK, HF_ENDPOINT=ENDPOINT_MARK)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", self.socket],
            env=base,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / "log", "w"),
        )
        deadline = time.time() + 180
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the launcher's server did not start: {(self.dir / 'log').read_text()[-2000:]}")
            time.sleep(0.05)

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a request with this environment runs as it would in a fresh process."""
        return env.get("PYTHONPATH", "") == self.pythonpath and env.get("OMP_NUM_THREADS") == self.omp

    def run(
        self,
        target: list[str],
        args: list[str],
        cwd: Path,
        env: dict[str, str],
        nproc: int,
        timeout: float,
        late: dict[int, float] | None = None,
    ) -> subprocess.CompletedProcess:
        """`target`: [script] or ["-m", module]. Returns as subprocess.run(capture_output=True, text=True) would.
        `late`: seconds a rank waits before it starts, as a rank slowed by a loaded machine would (the tests of what
        the other ranks do meanwhile)."""
        fd, out = tempfile.mkstemp(prefix="out-", dir=self.dir)
        os.close(fd)
        fd, err = tempfile.mkstemp(prefix="err-", dir=self.dir)
        os.close(fd)
        request = {
            "target": target,
            "args": args,
            "cwd": str(cwd),
            "env": env,
            "nproc": nproc,
            "out": out,
            "err": err,
            "late": {str(k): v for k, v in (late or {}).items()},
        }
        shown = ["fast-launch", f"--nproc={nproc}", *target, *args]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.socket)
            conn.sendall(json.dumps(request).encode() + b"\n")
            reader = conn.makefile("r")
            pid = int(json.loads(reader.readline())["pid"])
            conn.settimeout(timeout)
            try:
                line = reader.readline()
            except TimeoutError:
                _kill_group(pid)
                raise subprocess.TimeoutExpired(shown, timeout, _read(out), _read(err)) from None
            if not line:
                raise RuntimeError(f"the launcher's supervisor {pid} ended without an answer: {_read(err)[-2000:]}")
            code = int(json.loads(line)["returncode"])
        finally:
            conn.close()
        result = subprocess.CompletedProcess(shown, code, _read(out), _read(err))
        for path in (out, err):
            os.unlink(path)
        return result

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------ server side


def serve(path: str) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    import gc
    import threading

    # What the imports made, out of every later collection of the ranks (as a training run's freeze_imported does):
    # a full collection would walk ~450,000 objects, 0.4 s, in every rank of every command.
    gc.collect()
    gc.freeze()

    # NOTE: native threads of numpy's OpenBLAS and pyarrow's jemalloc exist from import on; both libraries reset
    # them at fork. A Python thread would not survive the fork with its locks: there must be none.
    if threading.active_count() != 1:
        raise RuntimeError("the launcher's server has threads after its imports: forking it would not be safe")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = path + ".tmp"
    server.bind(tmp)
    server.listen(64)
    os.rename(tmp, path)  # the client waits for the name: it appears once the socket listens
    parent = os.getppid()
    server.settimeout(2.0)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the pytest worker is gone (killed): so is the need for this server
                return
            continue
        conn.settimeout(None)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            server.close()
            try:
                supervise(conn)
            finally:
                os._exit(0)
        conn.close()


def supervise(conn: socket.socket) -> None:
    os.setsid()  # the client kills the whole group on a timeout
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    reader = conn.makefile("r")
    request = json.loads(reader.readline())
    conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    nproc = int(request["nproc"])
    world = max(1, nproc)
    port = _free_port()
    out = os.open(request["out"], os.O_WRONLY | os.O_APPEND)
    err = os.open(request["err"], os.O_WRONLY | os.O_APPEND)
    pids = []
    for rank in range(world):
        env = dict(request["env"])
        if nproc:
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
                GROUP_RANK="0",
                ROLE_RANK=str(rank),
                ROLE_WORLD_SIZE=str(world),
                ROLE_NAME="default",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                TORCHELASTIC_RUN_ID="fast-launch",
                TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_MAX_RESTARTS="0",
            )
            env.setdefault("OMP_NUM_THREADS", "1")
        pid = os.fork()
        if pid == 0:
            conn.close()
            _rank(request, env, out, err)
        pids.append(pid)
    code = _wait(pids, nproc, err)
    conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")


def _wait(pids: list[int], nproc: int, err: int | None = None) -> int:
    """torchrun's rule: the first rank to fail stops the others; exit 1 when any failed (nproc 0: its own code).
    With nproc > 0, how each rank ended is written to `err` when one failed, as torchrun's failure report has it."""
    left, failed, stopping_since = set(pids), None, None
    codes: dict[int, int] = {}
    while left:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if stopping_since is not None and time.time() - stopping_since > STOP_GRACE_S:
                for p in left:
                    _signal(p, signal.SIGKILL)
            time.sleep(0.02)
            continue
        if pid not in left:
            continue
        left.discard(pid)
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0 and failed is None:
            failed = pid
            stopping_since = time.time()
            for p in left:
                _signal(p, signal.SIGTERM)
    if nproc == 0:
        code = codes[pids[0]]
        return code if code >= 0 else 128 - code
    if failed is not None and err is not None:
        ended = ", ".join(
            f"rank {r}: " + (f"signal {-codes[p]}" if codes[p] < 0 else f"exit {codes[p]}") for r, p in enumerate(pids)
        )
        os.write(err, f"fast-launch: rank {pids.index(failed)} failed first ({ended})\n".encode())
    return 0 if failed is None else 1


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _rank(request: dict, env: dict[str, str], out: int, err: int) -> None:
    code = 1
    try:
        os.dup2(out, 1)
        os.dup2(err, 2)
        import faulthandler

        faulthandler.enable()  # a rank that dies of a signal (SIGSEGV, SIGABRT) says where, in the command's stderr
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(env)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        _reread_environment()
        time.sleep(request.get("late", {}).get(os.environ.get("RANK", "0"), 0.0))
        import runpy

        target, args = request["target"], request["args"]
        # sys.path[0] as Python sets it: the working folder for -m, the script's folder for a script
        if target[0] == "-m":
            sys.path[0] = os.getcwd()
            sys.argv = [target[1], *args]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(target[0]).resolve().parent)
            sys.argv = [target[0], *args]
            runpy.run_path(target[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as an uncaught exception would: its traceback, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reread_environment() -> None:
    """The settings taken from the environment at import, taken again from this request's; a module that still holds
    the server's marker would run with another test's cache or Hub: refuse."""
    for name in RELOAD:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
    import huggingface_hub.constants as constants

    for name, attrs in COPIES.items():
        module = sys.modules.get(name)
        if module is not None:
            for attr in attrs:
                if hasattr(module, attr):
                    setattr(module, attr, getattr(constants, attr))
    # transformers' folder for remote code, as transformers.utils.hub computes it at import
    modules_cache = os.getenv("HF_MODULES_CACHE", os.path.join(constants.HF_HOME, "modules"))
    for name in ("transformers.utils.hub", "transformers.utils", "transformers.dynamic_module_utils"):
        if hasattr(sys.modules.get(name), "HF_MODULES_CACHE"):
            sys.modules[name].HF_MODULES_CACHE = modules_cache
    stale = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(SCANNED):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, (str, os.PathLike)) and (HF_HOME_MARK in str(value) or ENDPOINT_MARK in str(value)):
                stale.append(f"{name}.{attr}")
    if stale:
        raise RuntimeError(
            f"the launcher cannot stand in for a fresh process: {', '.join(stale)} kept the server's environment"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(sys.argv[2])
