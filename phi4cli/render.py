"""Turning daemon events and records into text for people: answer stream, stats, status, models."""

from __future__ import annotations

import sys
from typing import Any, TextIO


def human_bytes(size: float | None) -> str:
    if size is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def human_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


class AnswerStream:
    """Writes answer text as it arrives; guarantees the output ends with one newline."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self._last = "\n"

    def write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
            self._last = text[-1]

    def finish(self) -> None:
        if self._last != "\n":
            self.out.write("\n")
            self.out.flush()
            self._last = "\n"


def format_stats(stats: dict[str, Any]) -> str:
    """The ``--verbose`` block: prompt and cache use, rates, total time."""
    prompt_eval = stats.get("prompt_eval_tokens", 0)
    prompt_s = stats.get("prompt_eval_s") or 0.0
    completion = stats.get("completion_tokens", 0)
    decode_s = stats.get("decode_s") or 0.0
    lines = [
        f"prompt tokens:    {stats.get('prompt_tokens', 0)} "
        f"({stats.get('cached_tokens', 0)} cached, {prompt_eval} evaluated)",
        f"prompt eval:      {prompt_s:.3f} s"
        + (f" ({prompt_eval / prompt_s:.1f} tokens/s)" if prompt_s > 0 and prompt_eval else ""),
        f"answer tokens:    {completion}",
        f"eval rate:        {completion / decode_s:.1f} tokens/s"
        if decode_s > 0
        else "eval rate:        -",
        f"first token:      {human_seconds(stats.get('first_token_s'))}",
        f"total:            {human_seconds(stats.get('total_s'))}",
        f"finish:           {stats.get('finish_reason')}, seed {stats.get('seed')}",
    ]
    return "\n".join(lines)


def format_status(status: dict[str, Any]) -> str:
    served = status.get("requests_served", 0)
    active = status.get("requests_active", 0)
    queued = status.get("queued", 0)
    keep_alive = status.get("keep_alive_s")
    if status.get("idle_s") is None:
        idle = "busy"
    elif keep_alive is not None and keep_alive < 0:
        idle = f"{human_seconds(status['idle_s'])} (stays resident: keep_alive forever)"
    else:
        idle = (
            f"{human_seconds(status['idle_s'])} "
            f"(exits in {human_seconds(status.get('keep_alive_left_s'))})"
        )
    rows = [
        ("state", status.get("state")),
        ("model", status.get("model") or "-"),
        ("pid", status.get("pid")),
        ("uptime", human_seconds(status.get("uptime_s"))),
        ("memory", human_bytes(status.get("rss_bytes"))),
        ("requests", f"{served} served, {active} active, {queued} queued"),
        ("idle", idle),
        ("context", f"{status.get('n_ctx')} tokens"),
        ("socket", status.get("socket")),
        ("log", status.get("log")),
    ]
    if status.get("error"):
        rows.insert(1, ("error", status["error"]))
    return "\n".join(f"{key:<10}{value}" for key, value in rows)
