"""Host memory of this process: what it holds now, its peak, and giving freed memory back to the system.

RSS counts anonymous memory (tensors, Python objects) and file pages mapped in (a memory-mapped checkpoint
being read). Both count against a machine's RAM while resident, so both are reported.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os

_STATUS = "/proc/self/status"


def _status() -> dict[str, int]:
    """Fields of /proc/self/status in bytes (Linux); empty elsewhere."""
    out: dict[str, int] = {}
    try:
        with open(_STATUS) as f:
            for line in f:
                key, _, value = line.partition(":")
                parts = value.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def rss_bytes() -> dict[str, int]:
    """Resident bytes now: `rss` in all, `anon` (heap, tensors), `file` (mapped files); and `peak` (VmHWM)."""
    s = _status()
    return {
        "rss": s.get("VmRSS", 0),
        "anon": s.get("RssAnon", 0),
        "file": s.get("RssFile", 0),
        "peak": s.get("VmHWM", 0),
    }


def peak_rss_bytes() -> int:
    """The most this process has had resident so far (VmHWM; ru_maxrss where /proc is missing)."""
    peak = _status().get("VmHWM")
    if peak:
        return peak
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return 0


def reset_peak() -> bool:
    """Restart the peak (VmHWM) from what is resident now, so the next peak belongs to what runs next (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mapped_files(suffix: str = "") -> list[str]:
    """Files this process has memory-mapped (Linux), optionally only those whose path ends with `suffix`."""
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip().endswith(suffix) and parts[5].startswith("/"):
                    found.add(parts[5].strip())
    except OSError:
        pass
    return sorted(found)


def file_ranges(path) -> list[tuple[int, int]]:
    """Address ranges where this process maps the file at `path` (Linux; empty elsewhere)."""
    target = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() == target:
                    lo, hi = parts[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return ranges


def total_memory_bytes() -> int | None:
    """This machine's RAM (MemTotal), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


M_MMAP_THRESHOLD = -3  # mallopt parameter number (glibc malloc.h)

MMAP_THRESHOLD_BYTES = 1 << 20
CPU_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest


@functools.lru_cache(maxsize=1)
def _libc():
    """The C library, looked up once (find_library runs a subprocess; drop_pages is called per tensor)."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def configure_allocator(cpu_device: bool = False) -> bool:
    """Serve every host allocation of 1 MiB or more from its own mapping, returned to the system when freed.

    NOTE: glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), so weight-sized
    tensors freed once (a gathered checkpoint, a step's gradients) are then served from the heap and stay in
    RSS: at opt-125m's shape on CPU, RSS grew by 1.3 GiB over three steps with 1.2 GiB live. A fixed threshold
    keeps RSS at what is live, which is what the plan predicts. A MALLOC_MMAP_THRESHOLD_ set by the user wins.

    With `cpu_device` (the model trains in host memory) the fixed threshold is 32 MiB instead: there every step
    allocates its activations and gradients anew, and at 1 MiB each of them is mapped, zero-filled page by page
    and unmapped again every step (benchmarks/allocator.py: the demo's step 1.11x as fast alone, 1.17x with the CPU
    shared, system time down 40%, the same losses). Blocks above 32 MiB still get mappings of their own; a save
    hands the freed blocks back first (checkpoint/save.py), so the host plan holds for a CPU run too.
    Returns whether the threshold was set.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    threshold = CPU_MMAP_THRESHOLD_BYTES if cpu_device else MMAP_THRESHOLD_BYTES
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold))


MADV_DONTNEED = 4  # Linux


def drop_pages(tensor, ranges: list[tuple[int, int]]) -> bool:
    """Take a memory-mapped tensor's pages out of this process's resident memory once they have been read.

    Reading a mapped checkpoint makes each page it touches resident (RssFile) until the file is unmapped: copying
    this rank's slices out of an opt-1.3b checkpoint would hold them all at once. The pages stay in the page
    cache, and a later read of the tensor maps them in again from the file. Only a tensor that lies inside one of
    the file's `ranges` (file_ranges) is touched: anywhere else this would discard data. Whole pages only.
    Returns whether pages were dropped.
    """
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    if not any(lo <= start and end <= hi for lo, hi in ranges):
        return False
    libc = _libc()
    madvise = getattr(libc, "madvise", None) if libc is not None else None
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = -(-start // page) * page, end // page * page
    if madvise is None or last <= first:
        return False
    return madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED) == 0


def freeze_imported() -> None:
    """Leave what exists now (the modules imported, their classes and tables) out of every later garbage collection.

    Those objects live as long as the process. A full collection walks all of them: about 450,000 objects and 0.4 s
    after torch, transformers, datasets and peft are imported, at every checkpoint (release_host_memory) and at
    Python's own full collections. Frozen, a collection walks only what the run made since.
    """
    gc.freeze()


def release_host_memory() -> None:
    """Collect garbage, then hand freed heap pages back to the system.

    NOTE: glibc keeps freed blocks below its mmap threshold (which grows to 32 MiB after large frees) in the
    heap; without malloc_trim a loaded-then-freed checkpoint stays in RSS and adds to the next save's peak.
    """
    gc.collect()
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)
