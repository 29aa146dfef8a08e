"""What `phi4 status` says: counts in one vocabulary, thousands separated."""

from __future__ import annotations

from phi4cli.client.render import format_status


def test_status_counts_running_and_queued_in_the_words_of_the_kv_row():
    shown = format_status(
        {
            "state": "ready",
            "requests_served": 12345,
            "requests_active": 8,
            "queued": 7,
            "n_ctx": 32768,
            "idle_s": None,
            "memory": {
                "reserved_tokens": 8192,
                "running": 1,
                "free_tokens": 24576,
                "idle_cached_tokens": 0,
            },
        }
    )
    rows = dict(line.split(None, 1) for line in shown.splitlines() if " " in line)
    assert rows["requests"] == "12,345 served; now 1 running, 7 queued"
    assert rows["context"] == "32,768 tokens"
    assert "1 running" in rows["kv"], "the same count as the requests row"


def test_status_without_a_memory_report_counts_running_as_active_less_queued():
    shown = format_status(
        {"state": "ready", "requests_served": 3, "requests_active": 5, "queued": 2, "idle_s": None}
    )
    assert "3 served; now 3 running, 2 queued" in shown


def test_status_says_the_thread_count_and_the_speeds_the_governor_measured():
    def threads_row(memory: dict[str, object]) -> str:
        shown = format_status(
            {
                "state": "ready",
                "idle_s": None,
                "memory": {
                    "reserved_tokens": 0,
                    "running": 0,
                    "free_tokens": 1,
                    "idle_cached_tokens": 0,
                    **memory,
                },
            }
        )
        return next(line for line in shown.splitlines() if line.startswith("threads"))

    measured = threads_row(
        {
            "threads": 1,
            "threads_max": 2,
            "threads_adapt": True,
            "threads_measured": {"1": 9.9, "2": 8.5},
        }
    )
    assert measured.split(None, 1)[1] == (
        "1 of 2 (the fastest the free cores allow; measured 9.9 tokens/s on 1, 8.5 tokens/s on 2)"
    )
    fixed = threads_row({"threads": 1, "threads_max": 1, "threads_adapt": False})
    assert "fixed" in fixed and "measured" not in fixed
