"""The queue's order and bound, as a client sees them: who runs next, and when a request is refused."""

from __future__ import annotations

import pytest

from tpserve.server.job_queue import JobQueue
from tpserve.server.requests import QueueFull


def take_all(queue):
    return [queue.pop() for _ in range(len(queue))]


def test_foreground_runs_before_background_each_in_arrival_order():
    queue = JobQueue(max_size=8)
    for name, background in [("b1", True), ("f1", False), ("b2", True), ("f2", False)]:
        queue.push(name, background=background)
    assert queue.peek() == "f1"
    assert queue.peek_many(3) == ["f1", "f2", "b1"]
    assert take_all(queue) == ["f1", "f2", "b1", "b2"]


def test_a_full_queue_refuses_at_once_and_accepts_again_once_a_job_leaves():
    queue = JobQueue(max_size=2)
    queue.push("a", background=False)
    queue.push("b", background=True)
    with pytest.raises(QueueFull, match="2 requests waiting"):
        queue.push("c", background=False)
    assert queue.pop() == "a"
    queue.push("c", background=False)
    assert take_all(queue) == ["c", "b"]


def test_a_yielded_background_job_goes_first_among_background_and_is_never_refused():
    queue = JobQueue(max_size=2)
    queue.push("b1", background=True)
    queue.push("f1", background=False)
    queue.push_front("yielded", background=True)
    assert len(queue) == 3
    assert take_all(queue) == ["f1", "yielded", "b1"]


def test_remove_takes_out_that_very_job_only():
    queue = JobQueue(max_size=4)
    first, second = ["same"], ["same"]  # equal, but different jobs
    queue.push(first, background=False)
    queue.push(second, background=False)
    assert queue.remove(second)
    assert not queue.remove(second)
    assert queue.pop() is first
    assert queue.peek() is None


def test_drain_empties_in_run_order():
    queue = JobQueue(max_size=4)
    queue.push("b", background=True)
    queue.push("f", background=False)
    assert queue.drain() == ["f", "b"]
    assert len(queue) == 0 and queue.peek() is None


def test_queue_size_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        JobQueue(max_size=0)
