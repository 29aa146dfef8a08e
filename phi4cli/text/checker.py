"""Checking answers within bounds: :class:`Checker` runs ``phi4cli.text.checking`` in a worker
process of its own, so that a check that runs long or grows large is cut off (killed) and
counts as ``unchecked``, and the answer waits for it about a second at most.

The worker is started when a request that may be checked goes out (``prepare``), so SymPy loads
while the model thinks; it answers checks one at a time over a pipe and leaves when the pipe
closes. It runs at the lowest priority, with its address space and CPU time limited
(``resource``), and a check that takes longer than ``CHECK_S`` is answered ``unchecked`` and
the worker killed (the next check starts another).
"""

from __future__ import annotations

import threading
import time
from typing import IO, TYPE_CHECKING

# SymPy's room (its patterns take milliseconds to compile) and subprocess are imported when a
# check is first prepared, after the request has gone out: not when a solve starts.
if TYPE_CHECKING:
    import subprocess

    from phi4cli.text.check_verdicts import Check

CHECK_S = 1.0  # the longest an answer waits for its check
START_S = 5.0  # the longest a worker may take to load SymPy, from when it was started
MODES = ("auto", "off", "strict")  # the setting "check"


class Checker:
    """Checks answers in a worker process; thread-safe (checks run one at a time)."""

    def __init__(self, seconds: float = CHECK_S, start_s: float = START_S) -> None:
        self.seconds, self.start_s = seconds, start_s
        self._worker: subprocess.Popen[bytes] | None = None
        self._started = 0.0
        self._ready = False
        self._lines: list[bytes] = []
        self._arrived: threading.Condition | None = None
        self._lock = threading.Lock()
        self.timed_out = 0  # checks cut off (their verdict: unchecked)
        self.prepared = False  # prepare has been called

    def prepare(self, problem: str) -> None:
        """Start the worker now if ``problem`` may be checked, so that SymPy is loaded by the
        time its answer comes."""
        from phi4cli.text.checking import checkable

        self.prepared = True
        if checkable(problem):
            with self._lock:
                self._start()

    def check(self, problem: str, answer: str | None) -> Check:
        """The verdict on ``answer`` to ``problem``, within ``seconds`` once the worker is up."""
        from phi4cli.text.check_verdicts import unchecked
        from phi4cli.text.checking import NO_ANSWER, NOT_A_KIND, checkable

        if answer is None or not answer.strip():
            return unchecked(NO_ANSWER)
        if not checkable(problem):
            return unchecked(NOT_A_KIND)
        with self._lock:
            try:
                return self._ask(problem, answer)
            except OSError:
                from phi4cli.text.check_verdicts import unchecked

                self._stop()
                return unchecked("the checker could not be started")

    def close(self) -> None:
        with self._lock:
            self._stop()

    def __enter__(self) -> Checker:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- the worker --

    def _start(self) -> None:
        import os
        import subprocess
        import sys

        if self._arrived is None:
            self._arrived = threading.Condition()

        if self._worker is not None and self._worker.poll() is None:
            return
        self._lines = []
        self._ready = False
        self._started = time.monotonic()
        worker = subprocess.Popen(
            [sys.executable, "-P", "-m", "phi4cli.text.checking"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,  # a Ctrl-C at the terminal is the command's, not the worker's
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
        self._worker = worker
        assert worker.stdout is not None
        threading.Thread(
            target=self._read, args=(worker, worker.stdout), daemon=True, name="phi4-checker"
        ).start()

    def _read(self, worker: subprocess.Popen[bytes], stdout: IO[bytes]) -> None:
        assert self._arrived is not None
        for line in stdout:
            with self._arrived:
                if worker is self._worker:
                    self._lines.append(line)
                    self._arrived.notify_all()
        with self._arrived:
            self._arrived.notify_all()

    def _next_line(self, deadline: float) -> bytes | None:
        assert self._arrived is not None
        with self._arrived:
            while not self._lines:
                left = deadline - time.monotonic()
                worker = self._worker
                if left <= 0 or worker is None or worker.poll() is not None:
                    return None
                self._arrived.wait(min(left, 0.05))
            return self._lines.pop(0)

    def _ask(self, problem: str, answer: str) -> Check:
        import json

        from phi4cli.text.check_verdicts import UNCHECKED, VERDICTS, Check, unchecked

        self._start()
        worker = self._worker
        assert worker is not None and worker.stdin is not None
        if not self._ready:
            line = self._next_line(self._started + self.start_s)
            if line is None:
                self._stop()
                return unchecked("the checker did not start in time")
            self._ready = True
        request = json.dumps({"problem": problem, "answer": answer}) + "\n"
        try:
            worker.stdin.write(request.encode("utf-8", "surrogatepass"))
            worker.stdin.flush()
        except (BrokenPipeError, ValueError):
            self._stop()
            return unchecked("the checker stopped")
        line = self._next_line(time.monotonic() + self.seconds)
        if line is None:
            self.timed_out += 1
            self._stop()  # it may be deep in a long computation: start afresh next time
            return unchecked(f"the check took longer than {self.seconds:g} s")
        try:
            reply = json.loads(line)
            verdict, detail = str(reply["verdict"]), str(reply["detail"])
        except (ValueError, KeyError, TypeError):
            return unchecked("the checker's reply could not be read")
        return Check(verdict if verdict in VERDICTS else UNCHECKED, detail)

    def _stop(self) -> None:
        worker, self._worker = self._worker, None
        self._ready = False
        if worker is None:
            return
        import contextlib
        import subprocess

        with contextlib.suppress(OSError):
            worker.kill()
        if worker.stdin is not None:  # (its stdout ends for the reader: the process is gone)
            with contextlib.suppress(OSError):
                worker.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(timeout=5)
