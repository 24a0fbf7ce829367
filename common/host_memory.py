"""How much memory this host can still give (torch-free; a CUDA device's memory is torch's business)."""

from __future__ import annotations

import os


def available_bytes() -> int:
    """MemAvailable: what new allocations can take without swapping (page cache counted as free)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
