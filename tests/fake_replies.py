"""What a test reads from the lane host's streams: each stream's Reply, and stepping a host until every
stream finished; `make_request` builds the requests (greedy unless seeded).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.server.lane_host import LaneHost
from tpserve.server.lane_stream import Stream
from tpserve.server.requests import Finished, GenerationRequest, Prefilled, TokenDelta


@dataclass(frozen=True)
class Reply:
    """Everything a client read from one stream (timings aside, so replies compare across runs)."""

    token_ids: tuple[int, ...]
    text: str
    reason: str
    error: str | None
    completion_tokens: int
    num_prefilled_events: int
    finished: Finished = field(compare=False)


def read_reply(stream: Stream) -> Reply:
    """Read a finished stream's events (they are all there already)."""
    token_ids: list[int] = []
    texts: list[str] = []
    num_prefilled = 0
    for event in stream.events(timeout_each=0):
        if isinstance(event, TokenDelta):
            token_ids += event.token_ids
            texts.append(event.text)
        elif isinstance(event, Prefilled):
            if token_ids:
                raise AssertionError("Prefilled arrived after a token")
            num_prefilled += 1
        elif isinstance(event, Finished):
            usage = event.usage
            return Reply(
                tuple(token_ids),
                "".join(texts),
                event.reason,
                event.error,
                usage.completion_tokens,
                num_prefilled,
                event,
            )
    raise AssertionError("the stream ended without Finished")


def step_until_finished(host: LaneHost, streams: list[Stream], max_steps: int = 10_000) -> None:
    """Step the host until every stream has its Finished event."""
    for _ in range(max_steps):
        if all(stream.finished is not None for stream in streams):
            return
        host.step()
    raise AssertionError(f"streams still running after {max_steps} steps")


def run_all(host: LaneHost, streams: list[Stream], max_steps: int = 10_000) -> list[Reply]:
    """Step the host until every stream finished; their replies in order."""
    step_until_finished(host, streams, max_steps)
    return [read_reply(stream) for stream in streams]


def make_request(
    prompt_ids: Sequence[int], max_tokens: int = 12, *, seed: int | None = None, **kwargs
) -> GenerationRequest:
    """A request; greedy unless a seed is given (then sampled, temperature 0.8)."""
    sampling = SamplingParams() if seed is None else SamplingParams(temperature=0.8, seed=seed)
    return GenerationRequest(tuple(prompt_ids), max_tokens, sampling, **kwargs)
