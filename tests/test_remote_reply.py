"""The front process's text (tpserve/server/remote_engine.py RemoteReply) against the lane host's own: the
same deltas, the same ending and usage, from the engine's bare tokens (tpserve/server/front_wire.py)."""

from __future__ import annotations

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.server.front_wire import StreamOut
from tpserve.server.lane_stream import Stream
from tpserve.server.remote_engine import RemoteReply
from tpserve.server.reply_text import ReplyText, ends_reply
from tpserve.server.requests import CANCELLED, STOP, Finished, GenerationRequest, Prefilled, TokenDelta, Usage

EOS = 25


def letters(ids) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def in_process(request: GenerationRequest, tokens: list[int]) -> tuple[list, str | None]:
    """What the lane host's Job sends: ReplyText on the scheduling thread."""
    stream = Stream(lambda: None)
    reply = ReplyText(request, letters, stream.put)
    reason = None
    for token in tokens:
        reason = reply.take(token, None, ends_reply(request, token, frozenset({EOS})))
        if reason is not None:
            break
    return stream.next_events(0), reason


def through_the_front(request: GenerationRequest, tokens: list[int], finished: Finished | None):
    cancels = []
    reply = RemoteReply(request, letters, frozenset({EOS}), lambda: cancels.append(True))
    reply.apply(StreamOut(1, Prefilled(3), tuple(tokens), (), None))
    if finished is not None:
        reply.apply(StreamOut(1, None, (), (), finished))
    return reply.stream.next_events(0), cancels


def request(**fields) -> GenerationRequest:
    return GenerationRequest((1, 2, 3), max_tokens=10, sampling=SamplingParams(), **fields)


def usage(completion_tokens: int) -> Usage:
    return Usage(3, completion_tokens, 3, 0.0, 0.1)


def test_a_stop_string_ends_the_reply_in_the_front_and_cancels_the_engines_stream():
    asked = request(stop=("de",))
    tokens = [0, 1, 2, 3, 4, 5, 6, 7]  # "abcdefgh": the engine runs on past the stop string
    expected, reason = in_process(asked, tokens)
    assert reason == STOP
    events, cancels = through_the_front(asked, tokens, Finished(CANCELLED, usage(8)))
    assert events[0] == Prefilled(3)
    assert [e for e in events if isinstance(e, TokenDelta)] == expected
    assert "".join(e.text for e in expected) == "abc"
    ending = events[-1]
    assert isinstance(ending, Finished) and ending.reason == STOP  # not the engine's CANCELLED
    assert ending.usage.completion_tokens == 5  # up to the stop string's last token, as in-process
    assert cancels == [True]


def test_eos_and_max_tokens_end_where_the_engine_ends_and_its_finished_is_the_streams():
    for asked, tokens in ((request(), [0, 1, EOS]), (request(stop=("zz",)), list(range(10)))):
        expected, reason = in_process(asked, tokens)
        engine_end = Finished(reason, usage(len(tokens)))
        events, cancels = through_the_front(asked, tokens, engine_end)
        assert [e for e in events if isinstance(e, TokenDelta)] == expected
        assert events[-1] == engine_end and cancels == []
