"""What one solve request produced, assembled from its events: reasoning, solution, answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phi4cli.errors import Phi4Error
from phi4cli.reasoning import extract_final_answer


@dataclass
class Outcome:
    index: int
    question: str
    reasoning: str = ""
    solution: str = ""
    stats: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    done: bool = False

    def apply(self, event: dict[str, Any]) -> None:
        """Fold one daemon event into the outcome."""
        kind = event.get("event")
        text = str(event.get("text", ""))
        if kind == "token":
            self.solution += text
        elif kind == "reasoning":
            self.reasoning += text
        elif kind == "retract":
            self.reasoning += self.solution
            self.solution = ""
        elif kind == "stats":
            self.stats = {k: v for k, v in event.items() if k not in ("v", "id", "event")}
        elif kind == "error":
            self.error = {"code": event.get("code"), "message": event.get("message")}
            self.done = True
        elif kind == "done":
            self.done = True

    def exception(self) -> Phi4Error:
        """The error this request ended with, as the exception the CLI reports."""
        assert self.error is not None, "the request did not fail"
        from phi4cli.client import error_for

        return error_for({"event": "error", **self.error})

    @property
    def answer(self) -> str | None:
        """The solution's final answer (last \\boxed{}, or a "final answer is" sentence)."""
        return extract_final_answer(self.solution)

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "index": self.index,
            "question": self.question,
            "answer": self.answer,
            "solution": self.solution,
            "reasoning": self.reasoning,
            "model": self.stats.get("model"),
            "seed": self.stats.get("seed"),
            "stats": self.stats,
        }
        if self.error is not None:
            record["error"] = self.error
        return record
