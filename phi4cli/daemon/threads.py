"""How the daemon's decoding threads wait for each other, and how many there are.

llama.cpp's CPU backend, as llama-cpp-python builds it, runs each step's work on OpenMP
threads that meet at a barrier after every operation — hundreds a token. Two things decide how
fast that goes on a machine that is not quiet:

- How a thread waits at the barrier. OpenMP's default is to spin (libgomp: 300,000 turns) before
  it sleeps; beside busy processes a spinning thread burns the time slice that the thread it
  waits for needs, and one descheduled thread stalls them all. Sleeping soon costs a wake-up at
  every barrier where a thread waits longer than its spin, and on a quiet machine that shows
  when long prompts are read (prompts of 1,000 tokens on the shaped Phi-4-mini model, 2 cores: read
  7 to 13% slower with 10,000 turns than with OpenMP's 300,000, alike with 100,000). The daemon
  spins ``GOMP_SPINCOUNT=100000`` turns, a third of OpenMP's default, then sleeps. What that
  costs: beside a light load that the thread count below does not answer (a process busy half
  the time), it decoded 0.51x of its quiet speed where 10,000 turns kept 0.63x. The
  user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is left alone.
- How many threads there are (:class:`ThreadGovernor`): the cores that other processes leave
  free. Beside two busy processes on 2 cores, one thread decoded twice as fast as two spinning.

``bench/contention.py`` measures both.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable, MutableMapping

log = logging.getLogger(__name__)

SPIN_COUNT = "100000"
_USERS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def choose_wait_policy(environ: MutableMapping[str, str] | None = None) -> str:
    """Set how OpenMP's threads wait for this process unless the user has; return what it is
    (in words, for the log). Must run before llama_cpp is imported: OpenMP
    reads its environment once, when it is loaded."""
    env = os.environ if environ is None else environ
    said = {key: env[key] for key in _USERS if env.get(key)}
    if said:
        return ", ".join(f"{key}={value}" for key, value in said.items()) + " (yours)"
    if environ is None and "llama_cpp" in sys.modules:
        log.warning("llama.cpp was loaded before the thread wait policy was set")
    env["GOMP_SPINCOUNT"] = SPIN_COUNT
    return f"GOMP_SPINCOUNT={SPIN_COUNT}"


# --- how many threads decode: the cores that others leave free -------------------------------

CHECK_S = 1.0  # how often the count is re-checked while decoding
IDLE_GAP_S = 1.0  # a pause between decodes longer than this starts a fresh measurement
FREE_MARGIN = 0.05  # of a core: how much less than a whole free core still counts as one


def _cpu_ticks(cpus: frozenset[int], nice: bool = False) -> int | None:
    """Busy clock ticks of ``cpus`` since boot, from /proc/stat: user, system, irq, softirq and
    steal (a hypervisor's other guests are others too), and nice only with ``nice`` (a niced
    process yields its core to ours: it takes nothing from the daemon, unless the daemon is
    niced too). None where /proc/stat is missing, unreadable or lacks one of ``cpus`` (a
    container that numbers them otherwise)."""
    try:
        with open("/proc/stat", "rb") as stat:
            lines = stat.read().split(b"\n")
        busy, seen = 0, 0
        for line in lines[1:]:
            if not line.startswith(b"cpu"):
                break
            name, *fields = line.split()
            if int(name[3:]) in cpus and len(fields) >= 8:
                user, niced, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
                busy += user + system + irq + softirq + steal + (niced if nice else 0)
                seen += 1
    except (OSError, ValueError):
        return None
    return busy if seen == len(cpus) else None


def _own_ticks() -> int | None:
    """Clock ticks this process (all its threads) has run, user and system."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the line)
    except (OSError, IndexError, ValueError):
        return None


class ThreadGovernor:
    """How many threads decode the next step: the configured count, less the cores other
    processes keep busy.

    With threads meeting at a barrier after every operation, a thread the kernel deschedules
    for a busy neighbour stalls them all; decoding on fewer threads than the cores others leave
    free loses nothing to that. Every ``CHECK_S`` while decoding it reads how busy the CPUs
    were (/proc/stat) less this process's own time, and offers a new count when it differs:
    a thread goes once others keep 0.95 of a core busy (the cores others leave free, counted
    up from there), at least one, at most the configured count. A user's ``--threads N`` is
    kept as it is (``adapt=False``); a machine without a readable /proc decodes on the
    configured count."""

    def __init__(
        self,
        threads: int,
        adapt: bool = True,
        cores: int | None = None,
        cpus: frozenset[int] | None = None,
        cpu_ticks: Callable[[frozenset[int], bool], int | None] = _cpu_ticks,
        own_ticks: Callable[[], int | None] = _own_ticks,
        tick_hz: float | None = None,
    ) -> None:
        self.configured = self.threads = threads
        if cpus is None:
            cpus = frozenset(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ())
        self._cpus = cpus
        self._cores = cores or len(cpus) or 1
        self._cpu_ticks, self._own_ticks = cpu_ticks, own_ticks
        self._hz = tick_hz or (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
        self._adapt = adapt and bool(cpus) and threads > 1
        self._sample: tuple[float, int, int] | None = None
        self._last_decode = -1e9
        try:  # a niced daemon's own ticks are counted as nice
            self._nice = os.getpriority(os.PRIO_PROCESS, 0) > 0
        except (AttributeError, OSError):
            self._nice = False

    def check(self, now: float, hold: bool = False) -> int | None:
        """Before a decode: the new thread count when it should change, else None. With
        ``hold`` (a deterministic request: its answer must not depend on the machine's load)
        the configured count."""
        if not self._adapt:
            return None
        if hold:
            self._sample = None
            return self._switch(self.configured)
        if self._sample is None or now - self._last_decode > IDLE_GAP_S:
            self._sample = self._take(now)  # after a pause: measure from here
            return self._given_up() if self._sample is None else None
        started, busy, own = self._sample
        if now - started < CHECK_S:
            return None
        sample = self._take(now)
        self._sample = sample
        if sample is None:
            return self._given_up()
        others = max(0.0, ((sample[1] - busy) - (sample[2] - own)) / self._hz / (now - started))
        free = (len(self._cpus) - others) * self._cores / len(self._cpus)
        # A thread goes when others keep about a whole core more busy (two busy processes beside
        # two threads on 2 cores measure 1.0-1.1 CPUs; a lighter, elastic load 0.5-0.9 and
        # returns it when one thread leaves room, which would make the count flap).
        wanted = max(1, min(self.configured, math.ceil(free - FREE_MARGIN)))
        if wanted != self.threads:
            log.info("decoding on %d of %d threads (other processes kept %.1f of %d CPUs busy)",
                     wanted, self.configured, others, len(self._cpus))  # fmt: skip
        return self._switch(wanted)

    def describe(self) -> dict[str, int | bool]:
        """For `phi4 status`: the threads now, the most it uses, and whether it adapts."""
        return {
            "threads": self.threads,
            "threads_max": self.configured,
            "threads_adapt": self._adapt,
        }

    def decoded(self, now: float) -> None:
        """After a decode (its end time tells a pause between requests from a long step)."""
        self._last_decode = now

    def _take(self, now: float) -> tuple[float, int, int] | None:
        busy, own = self._cpu_ticks(self._cpus, self._nice), self._own_ticks()
        if busy is None or own is None:
            return None
        return now, busy, own

    def _given_up(self) -> int | None:
        """/proc could not be read: adapt no more, on the configured count (said once)."""
        log.warning("cannot read how busy the CPUs are: decoding on %d threads from now on",
                    self.configured)  # fmt: skip
        self._adapt = False
        return self._switch(self.configured)

    def _switch(self, threads: int) -> int | None:
        """Decode on ``threads`` from now on: the count when it changes, else None."""
        if threads == self.threads:
            return None
        self.threads = threads
        return threads
