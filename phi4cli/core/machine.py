"""What this machine has, as the client and the daemon both read it: its physical cores (the
threads a daemon decodes with by default, what `phi4 config show` says of ``threads = auto``)
and its memory (what the memory plan plans from). Leaves: nothing of phi4's is imported."""

from __future__ import annotations

import os
from pathlib import Path


def physical_cores() -> int:
    """Return the number of physical cores this process may run on (hyperthreads count once)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    cores: set[tuple[str, str]] = set()
    for cpu in allowed:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(
                (
                    (topology / "physical_package_id").read_text().strip(),
                    (topology / "core_id").read_text().strip(),
                )
            )
        except OSError:
            return max(1, len(allowed))
    return max(1, len(cores) or (os.cpu_count() or 1))


def read_meminfo(text: str | None = None) -> tuple[int, int]:
    """Return (MemAvailable, MemTotal) in bytes from /proc/meminfo (or ``text``)."""
    if text is None:
        try:
            text = Path("/proc/meminfo").read_text()
        except OSError:
            pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            return pages // 2, pages
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            values[name] = int(parts[0]) * 1024
    total = values.get("MemTotal", 0)
    return values.get("MemAvailable", values.get("MemFree", total // 2)), total
