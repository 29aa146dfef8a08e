"""The verdicts of a checked answer — ``verified``, ``refuted`` or ``unchecked`` — and
:class:`Check`, a verdict with one line saying how it was reached: what
:mod:`phi4cli.text.checking` answers, and what the rest of phi4 reads (the checker's worker
lines, a solve's outcome, the answer as shown). Imports nothing of phi4's.
"""

from __future__ import annotations

from typing import NamedTuple

VERIFIED, REFUTED, UNCHECKED = "verified", "refuted", "unchecked"
VERDICTS = (VERIFIED, REFUTED, UNCHECKED)


class Check(NamedTuple):
    """A verdict on an answer, and one line saying how it was reached."""

    verdict: str  # VERIFIED, REFUTED or UNCHECKED
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"verdict": self.verdict, "detail": self.detail}


def unchecked(detail: str) -> Check:
    return Check(UNCHECKED, detail)
