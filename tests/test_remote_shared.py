"""The reader of a shared request (samples asked together with ``n``, issue 50): a choice whose
sample left is dropped at once, and a live choice read slowly holds a bounded queue while the
socket waits, losing nothing. In-process, against a scripted server; the client's memory under
a flood is measured in tests/test_samples_n.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from phi4cli.backends.remote import Attempt, RemoteServer, StreamState
from phi4cli.backends.remote_shared import CHOICE_QUEUE_CHARS, CHUNK_OVERHEAD, SharedRequest
from phi4cli.core.protocol import Ask, SolveParams
from tests.scripted_server import Step, data, scripted_server
from tests.test_samples_n import piece

FLOOD_PIECES = 15_000  # of choice 0, about 2 MiB: eight times what a choice may hold unread


def flood_then_answer(body: dict[str, Any]) -> Iterator[str | Step]:
    """Choice 0 writes FLOOD_PIECES pieces, then choice 1 answers, then choice 0 ends."""
    yield piece(0, {"role": "assistant", "content": ""})
    yield piece(1, {"role": "assistant", "content": ""})
    for at in range(0, FLOOD_PIECES, 500):
        yield "".join(piece(0, {"content": f" w{i}"}) for i in range(at, at + 500))
    yield piece(1, {"content": "\\boxed{4}"})
    yield piece(1, {}, "stop")
    yield piece(0, {}, "stop")
    yield data("[DONE]")


def shared_pair(url: str) -> tuple[SharedRequest, list[Iterator[dict[str, Any] | None]]]:
    """A started request of two choices, and each sample's chunks."""
    shared = SharedRequest(RemoteServer(url, "m"), SolveParams("q", Ask()), 2)
    readers = []
    for index in range(2):
        state = StreamState(time.monotonic())
        state.attempt = Attempt()
        readers.append(shared.member(index).chunks(state))
    shared.start()
    return shared, readers


def contents(chunk: dict[str, Any] | None) -> list[str]:
    assert chunk is not None
    return [c["delta"].get("content", "") for c in chunk.get("choices", ())]


@pytest.mark.timeout(60)
def test_a_choice_whose_sample_left_is_dropped_at_once_and_after():
    with scripted_server(flood_then_answer) as server:
        shared, (first, second) = shared_pair(server.url)
        assert contents(next(first)) == [""]
        assert contents(next(second)) == [""]
        assert contents(next(first)) == [" w0"]
        first.close()  # its sample leaves (-n spent, a loop caught, ...)
        assert shared.left[0] and not shared.inboxes[0] and shared.queued[0] == 0
        # Choice 1's answer comes after the whole flood: all of it was read meanwhile, and
        # none of it kept.
        assert contents(next(second)) == ["\\boxed{4}"]
        assert not shared.inboxes[0] and shared.queued[0] == 0
        assert contents(next(second)) == [""] and next(second) is None  # its finish, its end
        second.close()
        assert all(shared.left) and shared.attempt.cancelled  # the last to leave hangs up


@pytest.mark.timeout(60)
def test_a_live_choice_read_slowly_holds_a_bounded_queue_and_loses_nothing():
    with scripted_server(flood_then_answer) as server:
        shared, (first, second) = shared_pair(server.url)
        deadline = time.monotonic() + 20
        while shared.queued[0] < CHOICE_QUEUE_CHARS:  # choice 0 unread: the reader fills it
            assert time.monotonic() < deadline, shared.queued
            time.sleep(0.01)
        time.sleep(0.5)  # and then waits, reading nothing, rather than go on
        largest = 200 + CHUNK_OVERHEAD  # (an event here has less than 200 characters)
        assert shared.queued[0] < CHOICE_QUEUE_CHARS + largest, shared.queued
        assert len(shared.inboxes[0]) < FLOOD_PIECES // 4

        # Choice 1 waits behind (its answer is behind the flood in the stream), but nothing
        # deadlocks: the live sample of choice 0 reads on, and everything comes, in order.
        answered: list[list[str]] = []
        reader = threading.Thread(
            target=lambda: answered.extend(contents(c) for c in second if c is not None)
        )
        reader.start()
        assert contents(next(first)) == [""]
        pieces = [text for chunk in first if chunk is not None for text in contents(chunk)]
        assert pieces == [f" w{i}" for i in range(FLOOD_PIECES)] + [""]
        reader.join(10)
        assert answered == [[""], ["\\boxed{4}"], [""]]
        assert all(shared.left)
