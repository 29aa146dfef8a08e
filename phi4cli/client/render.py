"""Turning records into text for people: stats, status, the warm table, settings, models, eval's
summary, chat's `/show` and `/list` (an answer itself is shown by ``presenters``)."""

from __future__ import annotations

from typing import Any

from phi4cli.core.protocol import Stats
from phi4cli.text.sanitize import clean_text


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


def format_stats(stats: Stats) -> str:
    """The ``--verbose`` block, like ``ollama run --verbose``: load, prompt, cache, rates, total."""
    prompt_eval, prompt_s = stats.prompt_eval_tokens, stats.prompt_eval_s
    completion, decode_s = stats.completion_tokens, stats.decode_s
    said = []
    if stats.budget_reached:
        said.append("budget reached")
    elif stats.answered_early:
        said.append("answered early")
    elif stats.thinking_unfinished:
        said.append("unfinished")
    if stats.loop is not None:
        said.append(
            f"looped at {stats.loop_at:,}: "
            + ("ended, the model answered" if stats.loop == "answered" else "stopped")
        )
    if stats.waits:
        said.append(f"{stats.waits} early end{'s' if stats.waits > 1 else ''} made Wait")
    thinking = "; ".join(said)
    rows = [
        ("load time", human_seconds(stats.load_s)),
        (
            "prompt tokens",
            f"{stats.prompt_tokens} ({stats.cached_tokens} cached, {prompt_eval} evaluated)",
        ),
        (
            "prompt eval",
            f"{prompt_s:.3f} s"
            + (f" ({prompt_eval / prompt_s:.1f} tokens/s)" if prompt_s > 0 and prompt_eval else ""),
        ),
        (
            "reasoning tokens",
            f"{stats.reasoning_tokens}" + (f" ({thinking})" if thinking else ""),
        ),
        ("answer tokens", f"{stats.answer_tokens}"),
        ("eval rate", f"{completion / decode_s:.1f} tokens/s" if decode_s > 0 else "-"),
        *(
            [("drafted", f"{stats.draft_tokens} tokens verified, {stats.draft_accepted} kept")]
            if stats.draft_tokens
            else []
        ),
        ("confidence", _confidence(stats)),
        ("first token", human_seconds(stats.first_token_s)),
        ("total", human_seconds(stats.total_s)),
        (
            "finish",
            stats.finish_reason
            if stats.seed is None
            else f"{stats.finish_reason}, seed {stats.seed}",
        ),
    ]
    return "\n".join(f"{label + ':':<18}{value}" for label, value in rows if value is not None)


def _confidence(stats: Stats) -> str | None:
    mean, lowest = stats.confidence, stats.lowest_group_confidence
    if mean is None or lowest is None:
        return None
    return f"{mean:.2f} mean, {lowest:.2f} lowest over a window"


def plan_rows(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """The daemon's memory plan as (label, text) rows, for `phi4 warm` and `phi4 status`."""
    if not plan:
        return []
    layers = plan.get("gpu_layers", 0)
    many = "s" if plan["parallel"] != 1 else ""
    if plan.get("kv_layout") == "streams":
        at_once = (
            f"{plan['slots']} request{'s' if plan['slots'] != 1 else ''}, a stream of "
            f"{plan['request_capacity']:,} tokens each (kv_layout streams)"
        )
    else:
        at_once = (
            f"{plan['parallel']} such request{many}; up to {plan['slots']} shorter ones "
            "(one shared cache)"
        )
    rows = [
        (
            "KV cache",
            f"{plan['n_ctx']:,} tokens x {human_bytes(plan['kv_bytes_per_token'])} "
            f"({plan['kv_cache_type']}) = {human_bytes(plan['kv_bytes'])}"
            + (", set by n_ctx" if plan.get("n_ctx_source") == "setting" else ""),
        ),
        (
            "per request",
            f"{plan['request_tokens']:,} tokens (prompt, thinking and answer) "
            "unless --max-tokens says otherwise",
        ),
        ("at once", at_once),
        (
            "offload",
            f"{'all' if layers < 0 else layers} layers on {plan.get('device')}"
            if layers
            else "none (CPU)",
        ),
    ]
    return rows + [("note", note) for note in plan.get("notes", [])]


def format_warm(timings: dict[str, Any]) -> str:
    """The `phi4 warm` table: stage to RAM, load, warm-up decode, system-prompt prefill, total."""
    if timings.get("staged"):
        how = "copied to" if timings.get("stage_copied") else "reused"
        stage = f"{timings.get('stage_s', 0):.2f} s ({how} {timings.get('loaded_from')})"
    elif timings.get("stage_note"):
        stage = f"skipped: {timings['stage_note']}"
    else:
        stage = "off"
    prefill = timings.get("prefill")
    prefill_how = "restored from the saved state" if prefill == "restored" else "computed, saved"
    steps = [timings.get(key) or 0.0 for key in ("stage_s", "load_s", "warmup_s", "prefill_s")]
    mlock = timings.get("mlock")
    rows = [
        ("model", timings.get("model")),
        ("stage to RAM", stage),
        ("load (mmap)", f"{timings.get('load_s', 0):.2f} s" + (", mlock" if mlock else "")),
        ("warm-up decode", f"{timings.get('warmup_s', 0):.3f} s"),
        (
            "system prompt",
            f"{timings.get('prefill_s', 0):.3f} s "
            f"({timings.get('system_tokens', 0)} tokens, {prefill_how})",
        ),
        ("total", f"{sum(steps):.2f} s"),
    ]
    if timings.get("start_cells"):
        rows.append(
            (
                "",
                f"(answers from {timings['start_cells']:,} cells while the whole KV "
                "cache is made in the background)",
            )
        )
    if timings.get("already_loaded"):
        rows.append(("", "(already warm: these are the timings of its load)"))
    rows += plan_rows(timings.get("memory") or {})
    return clean_text("\n".join(f"{key:<16}{value}" for key, value in rows))


def _speculation_row(speculation: dict[str, Any]) -> str:
    """Exact self-speculation now: the mode, the gate's length, drafts kept, and what each
    source's drafts would have had right."""
    mode, lengths = speculation.get("mode"), speculation.get("draft_lengths") or []
    if mode == "off":
        return "off"
    drafted, kept = speculation.get("draft_tokens", 0), speculation.get("draft_accepted", 0)
    if any(lengths):
        row = f"{mode}: drafting {'/'.join(str(n) for n in lengths)} a step"
    else:
        row = f"{mode}: not drafting now"
    row += f"; {kept:,} of {drafted:,} drafted tokens kept"
    sources = speculation.get("acceptance") or {}
    if sources:
        row += " (right: " + ", ".join(f"{name} {share:.0%}" for name, share in sources.items())
        row += ")"
    return row


def _threads_row(memory: dict[str, Any]) -> str:
    """How many threads decode now, and why."""
    now, most = memory["threads"], memory.get("threads_max", memory["threads"])
    if not memory.get("threads_adapt"):
        return f"{now} (fixed: --threads or a single core)"
    measured = memory.get("threads_measured") or {}
    speeds = ", ".join(f"{rate:g} tokens/s on {count}" for count, rate in measured.items())
    said = f"; measured {speeds}" if speeds else ""
    if now < most:
        return f"{now} of {most} (the fastest the free cores allow{said})"
    return f"{now} (fewer while other processes keep cores busy or one fewer decodes faster{said})"


def format_status(status: dict[str, Any]) -> str:
    served = status.get("requests_served", 0)
    active = status.get("requests_active", 0)
    queued = status.get("queued", 0)
    memory = status.get("memory") or {}
    # "active" counts the queued too: say running and queued, the words of the kv row below.
    running = memory.get("running", max(0, active - queued))
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
        ("requests", f"{served:,} served; now {running:,} running, {queued:,} queued"),
        ("idle", idle),
        ("context", f"{status['n_ctx']:,} tokens" if status.get("n_ctx") else "planned at load"),
    ]
    if memory:
        rows.append(
            (
                "kv now",
                f"{memory['reserved_tokens']:,} reserved by {memory['running']} "
                f"running, {memory['free_tokens']:,} free, "
                f"{memory['idle_cached_tokens']:,} cached for reuse",
            )
        )
        kept = memory.get("prompt_cache")
        if kept:
            rows.append(
                (
                    "prompts",
                    f"{kept['prompts']:,} kept in RAM, "
                    f"{human_bytes(kept['bytes'])} of "
                    f"{human_bytes(kept['max_bytes'])}; put back "
                    f"{counted(kept['hits'], 'time')} "
                    f"({kept['hit_tokens']:,} tokens not read again)",
                )
            )
        speculation = memory.get("speculation")
        if speculation:
            rows.append(("speculation", _speculation_row(speculation)))
        growing = memory.get("context_growing_s")
        if growing is not None:
            rows.append(
                (
                    "kv growing",
                    f"answering from {memory['context_cells']:,} of its "
                    f"{memory['n_ctx']:,} cells while the whole context is "
                    f"made (for {human_seconds(growing)}; requests may "
                    "reserve the whole)",
                )
            )
    if memory.get("threads"):
        rows.append(("threads", _threads_row(memory)))
    waiting = status.get("waiting")
    if waiting:
        rows.append(
            (
                "waiting",
                f"for memory: the next request needs {waiting['needed']:,} "
                f"tokens, {waiting['free']:,} are free",
            )
        )
    rows += plan_rows(memory.get("plan") or {})
    rows += [("socket", status.get("socket")), ("log", status.get("log"))]
    if status.get("error"):
        rows.insert(1, ("error", status["error"]))
    return clean_text("\n".join(f"{key:<12}{value}" for key, value in rows))


def format_setting(key: str, value: Any) -> str:
    """One setting's value as `phi4 config show` and `config set` print it: durations as
    written (30m), booleans as config.toml spells them, None as what it means for that key."""
    from phi4cli.core.config import format_duration
    from phi4cli.core.machine import physical_cores

    if key in ("keep_alive", "backend_timeout", "backend_deadline"):
        return format_duration(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):  # the backend's replicas
        return " ".join(value)
    if value is None:
        if key == "threads":
            return f"auto ({physical_cores()} physical cores)"
        from phi4cli.core.options import SETTING

        return SETTING[key].none if key in SETTING else "none"
    return str(value)


def format_settings(sources: dict[str, tuple[Any, str]]) -> str:
    """`phi4 config show`: each setting, its value and where the value comes from."""
    width = max(map(len, sources))
    lines = [
        f"{key:<{width}}  {format_setting(key, value):<24}  {source}"
        for key, (value, source) in sources.items()
    ]
    return clean_text("\n".join(lines))  # a system prompt in the config is anyone's text


def format_models(rows: list[Any]) -> str:
    """`phi4 models`: each alias and every other .gguf, its size, and where it is or comes from."""
    width = max(len(row.name) for row in rows)
    lines = []
    for row in rows:
        state = human_bytes(row.size) if row.present else "not on disk"
        lines.append(f"{row.name:<{width}}  {state:>11}  {row.description}")
        fetch = f"phi4 pull {row.name}" if row.source.startswith("hf:") else row.source
        where = row.path if row.present else f"get it: {fetch}"
        lines.append(f"{'':<{width}}  {'':>11}  {where}")
    return clean_text("\n".join(lines))


def format_rows(rows: list[tuple[str, object]], gap: int = 2) -> str:
    """Label-value rows, labels padded to the longest: status, /show, /help and the like."""
    width = max((len(label) for label, _ in rows), default=0) + gap
    return clean_text("\n".join(f"{label:<{width}}{value}" for label, value in rows))


def counted(number: int, one: str, many: str | None = None) -> str:
    """``1 turn``, ``2 turns``; ``many`` where the plural is not ``one`` and an s."""
    return f"{number} {one if number == 1 else many or one + 's'}"


def format_chat_show(
    conversation: Any, stats: Stats, model: str, settings: str, n_ctx: object
) -> str:
    """The chat's `/show`: the conversation, its model and settings, context use and cache."""
    used = stats.context_used
    return format_rows(
        [
            ("conversation", f"{conversation.name} ({counted(len(conversation.turns), 'turn')})"),
            ("model", model),
            ("system", conversation.system or "(the model default)"),
            ("settings", settings),
            (
                "context",
                f"{used} of {n_ctx} tokens used"
                if used
                else f"{n_ctx} tokens, unused"
                if isinstance(n_ctx, int)
                else f"{n_ctx}, unused",
            ),
            ("cached", f"{stats.cached_tokens} tokens of the last prompt came from cache"),
            ("dropped", f"{conversation.dropped} oldest turn(s) no longer in the model's context"),
        ],
        gap=1,
    )


def format_chat_list(entries: list[tuple[str, int, float]]) -> str:
    """The chat's `/list`: (name, turns, seconds since last saved), most recent first."""
    if not entries:
        return "no saved conversations"
    return clean_text(
        "\n".join(
            f"{name}  {turns} turns, {human_seconds(age)} ago" for name, turns, age in entries
        )
    )


def format_eval(summary: dict[str, Any], seconds: float, output: object) -> str:
    """`phi4 eval`'s table: how many right, wrong, unanswered; pass@k; thinking; time."""
    total = summary["problems"]

    def share(count: int) -> str:
        return f"{count:,}  ({count / total:.1%})" if total else f"{count:,}"

    rows: list[tuple[str, object]] = [
        ("problems", f"{total:,}"),
        ("correct", share(summary["correct"])),
        ("wrong", share(summary["wrong"])),
        ("no answer", share(summary["no_answer"])),
        ("truncated", share(summary["truncated"]) + "  (ran out of tokens: raise --max-tokens)"),
        ("errors", share(summary["error"])),
    ]
    if "samples" in summary:
        rows[1] = ("correct", share(summary["correct"]) + f"  (majority of {summary['samples']})")
        taken = "  (some sample taken was right)" if summary.get("adaptive") else ""
        rows.insert(2, (f"pass@{summary['samples']}", share(summary["pass_at_k_count"]) + taken))
        used = f"{summary['mean_samples_used']:.1f} a problem of at most {summary['samples']}"
        if summary.get("adaptive"):
            used += " (each stops once its vote is settled)"
        if summary.get("samples_unsure"):
            used += f"; {summary['samples_unsure']:,} stopped as unsure"
        rows.insert(3, ("samples", used))
    rows.append(
        ("thinking", f"{summary['mean_reasoning_tokens']:,.0f} tokens a solution on average")
    )
    if "completion_tokens" in summary:
        by = "by the samples taken" if "samples" in summary else "in all"
        rows.append(
            ("tokens", f"{summary['completion_tokens']:,} written {by} (thinking included)")
        )
    confidence = summary.get("mean_confidence")
    if confidence:

        def mean(status: str) -> str:
            value = confidence.get(status)
            return "-" if value is None else f"{value:.2f}"

        said = f"{mean('correct')} right, {mean('wrong')} wrong (the answers' mean lowest window)"
        rows.append(("confidence", said))
    checks = summary.get("checks")
    if checks:
        decided = checks["verified"] + checks["refuted"]
        rows.append(
            (
                "checked",
                f"{decided:,} answers decided: {checks['verified']:,} verified, "
                f"{checks['refuted']:,} refuted; {checks['wrong_verdicts']:,} "
                "against the references",
            )
        )
    rows += [("time", f"{human_seconds(seconds)} this run"), ("results", str(output))]
    return format_rows(rows)


def format_replicas(replicas: list[dict[str, Any]]) -> str:
    """`phi4 status --backend`: a line per server, up (what it serves, how fast it answered,
    its load) or down (why)."""
    lines = []
    for replica in replicas:
        if replica["state"] == "up":
            how = f"answered in {replica['probe_s']:.2f} s  {_replica_load(replica)}"
            if replica.get("models"):
                how = f"serving {', '.join(replica['models'])}  {how}"
        else:
            how = replica["reason"] or ""
        lines.append(f"{replica['replica']}  {replica['state']}  {how}")
    return clean_text("\n".join(lines))


def _replica_load(replica: dict[str, Any]) -> str:
    """ "in flight 3, waiting 0, answered 120, 45.2 tokens/s": what the server's /metrics says
    (a part it does not publish is left out)."""
    parts = [
        f"{label} {int(replica[key]):,}"
        for key, label in (
            ("in_flight", "in flight"),
            ("waiting", "waiting"),
            ("answered", "answered"),
        )
        if replica.get(key) is not None
    ]
    if replica.get("tokens_per_s") is not None:
        parts.append(f"{replica['tokens_per_s']:g} tokens/s")
    return ", ".join(parts) if parts else "(it publishes no load metrics)"
