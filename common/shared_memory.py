"""Memory another process on this host can map: anonymous memfd regions, shared by file descriptor.

A region has no name in /dev/shm, so nothing is left behind when its process dies (the kernel frees
it once the last mapping and descriptor close), and it is not bounded by a container's small
/dev/shm. It travels to another process only as a descriptor over a Unix socket (SCM_RIGHTS), which
the receiving side maps read-only.

The registry answers "is this address inside a shared region, and where?" so a transport can let
its peer read a tensor in place instead of copying it out first.
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import mmap
import os
import threading
from dataclasses import dataclass

_ids = itertools.count(1)
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; 0 elsewhere: pages come at first touch
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_lock = threading.Lock()
_regions: dict[int, SharedRegion] = {}


@dataclass(frozen=True, slots=True)
class SharedRegion:
    region_id: int  # unique within this process
    fd: int
    nbytes: int
    buffer: mmap.mmap
    address: int  # where the mapping starts in this process


def create_shared_region(nbytes: int, label: str = "pdserve-kv", populate: bool = False) -> SharedRegion:
    """A zero-filled, writable region of ``nbytes``, registered for ``find_shared_region``; with
    ``populate``, its pages are allocated now instead of at first touch."""
    if nbytes < 1:
        raise ValueError(f"a shared region needs at least one byte, not {nbytes}")
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        # Its size is fixed for good: a peer that mapped it can never be made to read past its end
        # (a region shrunk under a mapping raises SIGBUS in the reader, which kills the process).
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS | fcntl.F_SEAL_SEAL)
        flags = mmap.MAP_SHARED | (MAP_POPULATE if populate else 0)
        buffer = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    anchor = ctypes.c_char.from_buffer(buffer)
    address = ctypes.addressof(anchor)
    del anchor  # the buffer export must end, or the mapping could never be closed
    region = SharedRegion(next(_ids), fd, nbytes, buffer, address)
    with _lock:
        _regions[region.region_id] = region
    return region


def find_shared_region(address: int, nbytes: int) -> tuple[SharedRegion, int] | None:
    """The region holding ``[address, address + nbytes)`` and the offset of ``address`` in it."""
    with _lock:
        for region in _regions.values():
            offset = address - region.address
            if offset >= 0 and offset + nbytes <= region.nbytes:
                return region, offset
    return None


def close_shared_region(region: SharedRegion) -> None:
    """Unregister and drop this process's descriptor. The mapping itself goes with its last user
    (tensors viewing it may outlive this call); peers that mapped it keep their own mapping."""
    with _lock:
        if _regions.pop(region.region_id, None) is None:
            return
    os.close(region.fd)


def map_shared_region(fd: int, nbytes: int) -> mmap.mmap:
    """Map a peer's region read-only: this side can read the peer's memory, never write it. Only a
    region sealed against shrinking is mapped: the peer could otherwise truncate it under this
    mapping, and the next read here would kill this process (SIGBUS)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a memfd, or one made without sealing
    if seals & _SIZE_SEALS != _SIZE_SEALS:
        raise ValueError("the shared region's size is not sealed: its owner could shrink it under this mapping")
    size = os.fstat(fd).st_size
    if nbytes > size:
        raise ValueError(f"the shared region holds {size} bytes, not the {nbytes} announced")
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
