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
from typing import Any

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

CHECK_S = 1.0  # how often the cores others keep busy are re-checked while decoding
IDLE_GAP_S = 1.0  # a pause between decodes longer than this starts a fresh measurement
FREE_MARGIN = 0.05  # of a core: how much less than a whole free core still counts as one
# The governor's own speed: a measurement is the mean of this many decode steps of one batch
# size on one count; a count next to the one in use is tried again after PROBE_EVERY_S (one
# measurement on a slower count: on a quiet machine well under 1% of the decoding), or after
# PROBE_AFTER_DROP_S once the speed fell below DROP of what it was; a trial is kept when it
# was KEEP times as fast.
MEASURE_STEPS = 8
PROBE_EVERY_S = 60.0
PROBE_AFTER_DROP_S = 5.0
DROP = 0.85
KEEP = 1.03
# While others keep less than this of a core busy the machine is quiet: a slowdown is not
# theirs, and a count next to the one in use is tried only every PROBE_QUIET_S (a small model
# can still find one thread faster than two; a big one pays one slower measurement).
BUSY_OTHERS = 0.25
PROBE_QUIET_S = 600.0


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
    """How many threads decode the next step: at most the cores other processes leave free,
    and, among those counts, the one it measured decoding fastest.

    With threads meeting at a barrier after every operation, a thread the kernel deschedules
    for a busy neighbour stalls them all; decoding on fewer threads than the cores others leave
    free loses nothing to that. Every ``CHECK_S`` while decoding it reads how busy the CPUs
    were (/proc/stat) less this process's own time: a thread goes once others keep 0.95 of a
    core busy (the cores others leave free, counted up from there), at least one, at most the
    configured count. That is the ceiling.

    Below it the governor measures itself, since a lighter neighbour (one busy half the time) moves
    no whole core yet can make one thread faster than two: the mean time of ``MEASURE_STEPS`` decode
    steps of one batch size is its speed on that count. While others keep some of the CPUs busy
    (``BUSY_OTHERS``), a count one below (or above, up to the ceiling) is tried for one such
    measurement when its speed is unknown or older than ``PROBE_EVERY_S``, or soon after the speed
    on the count in use fell below ``DROP`` of what it was; on a quiet machine only every
    ``PROBE_QUIET_S``. The trial is kept when it was ``KEEP`` times faster, else the count goes
    back. Each decision is logged, and ``describe`` says the speeds for ``phi4 status``. A user's
    ``--threads N`` is kept as it is (``adapt=False``); a machine without a readable /proc decodes
    on the configured count."""

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
        self._ceiling = threads  # the cores others leave free (at most the configured count)
        self._best = threads  # the count measured fastest (at most the configured count)
        self._trial: int | None = None  # a count being tried for one measurement
        self._trial_from = threads
        self._trial_why = ""  # for the log
        self._step_started: float | None = None
        self._window: list[float] = []  # the decode steps of the measurement under way
        self._window_key = (0, 0)  # its threads and batch size
        # Threads -> (mean seconds a decode step, its batch size, when measured).
        self.speeds: dict[int, tuple[float, int, float]] = {}
        self._last_probe: float | None = None  # when a count was last tried (None: never)
        self._others = 0.0  # of the CPUs, what other processes kept busy at the last check

    def check(self, now: float, hold: bool = False) -> int | None:
        """Before a decode: the new thread count when it should change, else None. With
        ``hold`` (a deterministic request: its answer must not depend on the machine's load)
        the configured count."""
        self._step_started = now
        if not self._adapt:
            return None
        if hold:  # measured afresh after it: the load it ran beside is not counted
            self._sample, self._trial, self._window = None, None, []
            self._ceiling = self.configured
            return self._switch(self.configured)
        if self._sample is None or now - self._last_decode > IDLE_GAP_S:
            self._sample = self._take(now)  # after a pause: measure from here
            if self._sample is None:
                return self._given_up()
        elif now - self._sample[0] >= CHECK_S and not self._load_check(now):
            return self._given_up()
        return self._switch(self._count())

    def _load_check(self, now: float) -> bool:
        """Set the ceiling from how busy others kept the CPUs since the last sample; False when
        /proc could not be read."""
        assert self._sample is not None
        started, busy, own = self._sample
        sample = self._take(now)
        self._sample = sample
        if sample is None:
            return False
        others = max(0.0, ((sample[1] - busy) - (sample[2] - own)) / self._hz / (now - started))
        free = (len(self._cpus) - others) * self._cores / len(self._cpus)
        # A thread goes when others keep about a whole core more busy (two busy processes beside
        # two threads on 2 cores measure 1.0-1.1 CPUs; a lighter, elastic load 0.5-0.9 and
        # returns it when one thread leaves room, which would make the count flap).
        ceiling = max(1, min(self.configured, math.ceil(free - FREE_MARGIN)))
        if others < BUSY_OTHERS <= self._others and self._best < self.configured:
            # The neighbours that made fewer threads faster are gone: all of them again, at
            # once (a quiet machine tries counts only every PROBE_QUIET_S).
            log.info("others left the CPUs: back to %s", _threads(self.configured))
            self._best, self._trial = self.configured, None
        self._others = others
        if ceiling != self._ceiling:
            log.info(
                "at most %d of %d threads (other processes kept %.1f of %d CPUs busy)",
                ceiling,
                self.configured,
                others,
                len(self._cpus),
            )
        self._ceiling = ceiling
        return True

    def _count(self) -> int:
        wanted = self._trial if self._trial is not None else self._best
        return max(1, min(self._ceiling, wanted))

    def describe(self) -> dict[str, Any]:
        """For `phi4 status`: the threads now, the most it uses, whether it adapts, and the
        speeds it measured (tokens a second, by thread count)."""
        return {
            "threads": self.threads,
            "threads_max": self.configured,
            "threads_adapt": self._adapt,
            "threads_measured": {
                str(count): round(batch / step, 1)
                for count, (step, batch, _at) in sorted(self.speeds.items())
            },
        }

    def decoded(self, now: float, batch: int = 0, answering: bool = False) -> None:
        """After a decode (its end time tells a pause between requests from a long step).
        ``answering``: every sequence of the step drew its next token (no prompt was read), so
        the step is one of ``batch`` tokens a measurement may count."""
        self._last_decode = now
        started, self._step_started = self._step_started, None
        if not self._adapt or not answering or started is None or batch < 1 or now <= started:
            return  # (a clock that did not move measures nothing)
        key = (self.threads, batch)
        if key != self._window_key:
            self._window, self._window_key = [], key
        self._window.append(now - started)
        if len(self._window) >= MEASURE_STEPS:
            step = sum(self._window) / len(self._window)
            self._window = []
            self._measured(now, self.threads, batch, step)

    def _measured(self, now: float, threads: int, batch: int, step: float) -> None:
        before = self.speeds.get(threads)
        self.speeds[threads] = (step, batch, now)
        if self._trial is not None:  # the trial's measurement: keep it or go back
            base = self.speeds.get(self._trial_from)
            faster = base is not None and base[1] == batch and step * KEEP <= base[0]
            self._best = threads if faster else self._trial_from
            against = f"{batch / base[0]:.1f}" if base is not None and base[1] == batch else "?"
            log.info(
                "tried %s (%s): %.1f tokens/s against %s on %d; %s %d",
                _threads(threads),
                self._trial_why,
                batch / step,
                against,
                self._trial_from,
                "keeping" if faster else "back to",
                self._best,
            )
            self._trial = None
            return
        if self._last_probe is None:
            self._last_probe = now  # a quiet machine's first try is PROBE_QUIET_S away
        busy = self._others >= BUSY_OTHERS
        every = PROBE_EVERY_S if busy else PROBE_QUIET_S
        dropped = busy and before is not None and before[1] == batch and step * DROP > before[0]
        for other in (threads - 1, threads + 1):
            if not 1 <= other <= self._ceiling:
                continue
            known = self.speeds.get(other)
            if known is not None and known[1] == batch:
                stale = now - known[2] > every
            else:  # never measured at this batch size: at once beside busy neighbours
                stale = busy or now - self._last_probe > every
            if stale or (dropped and now - self._last_probe > PROBE_AFTER_DROP_S):
                self._trial_why = (
                    f"{threads} fell to {batch / step:.1f} tokens/s from {batch / before[0]:.1f}"
                    if dropped and before is not None
                    else "not measured lately"
                )
                self._trial, self._trial_from, self._last_probe = other, threads, now
                return

    def _take(self, now: float) -> tuple[float, int, int] | None:
        busy, own = self._cpu_ticks(self._cpus, self._nice), self._own_ticks()
        if busy is None or own is None:
            return None
        return now, busy, own

    def _given_up(self) -> int | None:
        """/proc could not be read: adapt no more, on the configured count (said once)."""
        log.warning(
            "cannot read how busy the CPUs are: decoding on %d threads from now on", self.configured
        )
        self._adapt = False
        return self._switch(self.configured)

    def _switch(self, threads: int) -> int | None:
        """Decode on ``threads`` from now on: the count when it changes, else None."""
        if threads == self.threads:
            return None
        self.threads = threads
        return threads


def _threads(count: int) -> str:
    return f"{count} thread" if count == 1 else f"{count} threads"
