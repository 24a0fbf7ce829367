"""CPU cores as the unit a replica owns, the way a GPU replica owns its GPUs. Torch-free.

A replica claims cores on its host by locking one file per core (``flock``, non-blocking) in a
host-wide directory: two replicas never hold the same core, and a replica that dies, however it
dies, frees its cores with its file descriptors. The claimed cores are then the replica's
affinity: every thread of the process, and every thread it starts later, runs on them only.

When a host has fewer free cores than asked for (more replicas than cores), the replica borrows
cores it cannot lock and says so: it still runs, sharing them, which is oversubscription.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


def host_cores() -> list[int]:
    """The cores this process may run on (its affinity mask), in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


@dataclass
class CoreClaim:
    """Cores held by this process; ``borrowed`` are shared with another owner (oversubscribed)."""

    cores: list[int]
    borrowed: list[int] = field(default_factory=list)
    _files: list[int] = field(default_factory=list, repr=False)

    @property
    def owned(self) -> list[int]:
        return [c for c in self.cores if c not in self.borrowed]

    def release(self) -> None:
        for fd in self._files:
            os.close(fd)  # closing the descriptor drops its lock
        self._files = []


def claim_cores(count: int, lock_dir: Path, candidates: list[int] | None = None) -> CoreClaim:
    """Lock ``count`` free cores of ``candidates`` (default: this process's cores) under ``lock_dir``.

    Cores are taken lowest first; if fewer than ``count`` are free, the rest are borrowed (shared)."""
    if count < 1:
        raise ValueError(f"count={count} must be >= 1")
    candidates = sorted(candidates if candidates is not None else host_cores())
    _make_shared_dir(lock_dir)
    claim = CoreClaim(cores=[])
    try:
        _lock_free_cores(claim, count, lock_dir, candidates)
    except BaseException:
        claim.release()
        raise
    missing = count - len(claim.cores)
    others = [c for c in candidates if c not in claim.cores]  # held by other replicas
    if missing > 0 and others:
        # Start at a different core per process, so oversubscribed replicas spread over the host.
        start = os.getpid() % len(others)
        claim.borrowed = sorted(others[(start + i) % len(others)] for i in range(min(missing, len(others))))
        claim.cores = sorted(claim.cores + claim.borrowed)
        logger.warning(
            "asked for %d cores, %d were free on this host: sharing core(s) %s with another replica "
            "(oversubscribed; lower the pools' cores or their replicas)",
            count,
            count - missing,
            claim.borrowed,
        )
    elif missing > 0:
        logger.warning("asked for %d cores, this host has %d: running on those", count, len(candidates))
    return claim


def _make_shared_dir(lock_dir: Path) -> None:
    """The host's lock directory, shared by every user's replicas (cores are the host's): made
    world-writable and sticky, as /tmp is, so a second user can add its locks and remove no one's."""
    if not lock_dir.is_dir():
        lock_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # made by another user meanwhile: theirs to set
            os.chmod(lock_dir, 0o1777)


def _open_lock(path: Path) -> int | None:
    """A descriptor to flock ``path`` with; never through a symbolic link (one planted there would
    have this process truncate its target). Another user's lock file opens read-only: flock needs
    no write access, only the holder's pid is not written. None: the file cannot be used."""
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, os.O_RDWR | flags, 0o644)
    except PermissionError:
        pass
    except OSError as exc:  # ELOOP: a link in the lock's place
        logger.warning("not using core lock %s: %s", path, exc)
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        logger.warning("not using core lock %s: %s", path, exc)
        return None


def _lock_free_cores(claim: CoreClaim, count: int, lock_dir: Path, candidates: list[int]) -> None:
    for core in candidates:
        if len(claim.cores) == count:
            return
        fd = _open_lock(lock_dir / f"core-{core}.lock")
        if fd is None:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        claim._files.append(fd)
        claim.cores.append(core)
        with contextlib.suppress(OSError):  # read-only (another user's file): no pid written
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())  # for an operator asking who holds the core


def pin_process(cores: list[int]) -> None:
    """Set the affinity of every thread of this process to ``cores``; threads started later inherit
    it. (``sched_setaffinity(0)`` alone moves only the calling thread.)"""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return
    try:
        thread_ids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        thread_ids = [0]
    for tid in thread_ids:
        with contextlib.suppress(OSError):  # a thread that exited meanwhile
            os.sched_setaffinity(tid, cores)
    os.sched_setaffinity(0, cores)


def split_cores(rank: int, world_size: int, cores: list[int]) -> list[int]:
    """The slice of ``cores`` shard ``rank`` owns: disjoint slices while there are enough cores,
    so the shards of one instance never run their matmuls on each other's cores; with fewer cores
    than shards, shards share them round-robin."""
    if len(cores) < world_size:
        return [cores[rank % len(cores)]] if cores else []
    return cores[rank * len(cores) // world_size : (rank + 1) * len(cores) // world_size]


def format_core_list(cores: list[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"`` (the kernel's cpulist format)."""
    runs: list[str] = []
    for core in sorted(cores):
        if runs and int(runs[-1].rpartition("-")[2]) == core - 1:
            runs[-1] = f"{runs[-1].partition('-')[0]}-{core}"
        else:
            runs.append(str(core))
    return ",".join(runs)
