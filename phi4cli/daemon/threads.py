"""How the daemon's decoding threads wait for each other: set before llama.cpp is loaded.

llama.cpp's CPU backend, as llama-cpp-python builds it, runs each step's work on OpenMP
threads that meet at a barrier after every operation — hundreds a token. OpenMP's default is
to spin there (libgomp: 300,000 turns) before sleeping. On a quiet machine that saves the
wake-ups (which shows on small models, whose steps are short); on a busy one a thread that
spins burns the time slice that the thread it waits for needs, and one descheduled thread
stalls them all: decoding on two threads beside two busy processes ran several times slower
than on one. With the passive policy a waiting thread sleeps at once and its core goes to
whoever can use it (``bench/contention.py`` measures both).

The user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is left alone.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

WAIT_POLICY = "PASSIVE"
_USERS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def choose_wait_policy(environ: MutableMapping[str, str] | None = None) -> str:
    """Set the OpenMP wait policy for this process unless the user has; return what it is
    (in words, for the log). Must run before llama_cpp is imported: OpenMP
    reads its environment once, when it is loaded."""
    env = os.environ if environ is None else environ
    said = {key: env[key] for key in _USERS if env.get(key)}
    if said:
        return ", ".join(f"{key}={value}" for key, value in said.items()) + " (yours)"
    if environ is None and "llama_cpp" in sys.modules:
        log.warning("llama.cpp was loaded before the thread wait policy was set")
    env["OMP_WAIT_POLICY"] = WAIT_POLICY
    return f"OMP_WAIT_POLICY={WAIT_POLICY}"
