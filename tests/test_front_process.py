"""The front process against the real daemon: the APIs run in a process of their own beside rank
0's engine loop (server/front_process.py), and the three processes live and die together.

Every other daemon test runs with it too (front_process is on by default); here, what only it adds:
its own pid, a reply through it equal to the in-process one, and each side's death ending the rest
with non-zero codes, within a bound, never a hang.
"""

from __future__ import annotations

import os
import signal

import pytest
from daemon import (
    EXIT_TIMEOUT_S,
    Reply,
    is_alive,
    read_reply,
    running_daemon,
    wait_until,
    write_daemon_model,
)

from tpserve.v1 import serving_pb2

ARGS = ("--context", "256", "--lanes", "2")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_daemon_model(tmp_path_factory.mktemp("front-model"))


def greedy(prompt: str, max_tokens: int = 12, **fields) -> serving_pb2.GenerateRequest:
    return serving_pb2.GenerateRequest(
        prompt=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0, **fields
    )


def generate(served, request) -> Reply:
    return read_reply(served.stub.Generate(request, timeout=60))


def replies(served) -> list[Reply]:
    """A plain reply, the same cut by a stop string from its own middle, one with log probabilities."""
    plain = generate(served, greedy("stop me", 24))
    middle = len(plain.text) // 2
    stop = plain.text[middle : middle + 2]
    assert stop.strip(), plain.text
    return [
        plain,
        generate(served, greedy("stop me", 24, stop=[stop])),
        generate(served, greedy("two", logprobs=2)),
    ]


def test_the_apis_run_in_a_front_process_and_replies_equal_the_in_process_ones(model_dir, tmp_path):
    with running_daemon("spawn", model_dir, tmp_path / "front", *ARGS) as served:
        front = served.front()
        assert front is not None, "no front process among rank 0's children"
        ranks = served.ranks()
        assert front.pid not in {proc.pid for proc in ranks.values()}
        via_front = replies(served)
    with running_daemon("spawn", model_dir, tmp_path / "here", *ARGS, "--front-process", "false") as served:
        assert served.front() is None
        in_process = replies(served)
    for ours, theirs in zip(via_front, in_process, strict=True):
        assert ours.ok and theirs.ok, (ours.details, theirs.details)
        assert (ours.token_ids, ours.text, ours.finish_reason) == (
            theirs.token_ids,
            theirs.text,
            theirs.finish_reason,
        )
        assert ours.last.usage.completion_tokens == theirs.last.usage.completion_tokens
        assert [lp.logprob for lp in ours.logprobs] == [lp.logprob for lp in theirs.logprobs]
    # The stop string cut the reply short, and usage counts what it cost (the stop string's tokens too).
    assert via_front[1].finish_reason == serving_pb2.FINISH_REASON_STOP
    assert len(via_front[1].token_ids) < len(via_front[0].token_ids)
    assert via_front[2].logprobs


@pytest.mark.parametrize("layout", ["spawn", "ranks"])
def test_killing_the_front_process_makes_both_ranks_exit_non_zero(model_dir, tmp_path, layout):
    with running_daemon(layout, model_dir, tmp_path, *ARGS) as served:
        ranks = served.ranks()
        front = served.front()
        assert front is not None
        os.kill(front.pid, signal.SIGKILL)
        wait_until(
            lambda: not any(is_alive(proc) for proc in ranks.values()),
            "both ranks to exit after the front process was killed",
            EXIT_TIMEOUT_S,
        )
        codes = served.wait_exits()
        assert all(code != 0 for code in codes.values()), codes
        assert "the front process went away" in served.logs()


def test_killing_rank_0_ends_the_front_process_too(model_dir, tmp_path):
    with running_daemon("ranks", model_dir, tmp_path, *ARGS) as served:
        front = served.front()
        assert front is not None
        served.signal(0, signal.SIGKILL)
        wait_until(lambda: not is_alive(front), "the front process to exit after rank 0", EXIT_TIMEOUT_S)
        codes = served.wait_exits()
        assert all(code != 0 for code in codes.values()), codes
