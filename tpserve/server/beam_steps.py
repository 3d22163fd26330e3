"""A beam search run on the lane host: each step's candidates asked of the engine
(tpserve/server/beam_search.py decides which beams live).

Every live beam is one request per step: the prompt and the beam's tokens as token ids, one greedy
token with the 2 x width likeliest next tokens' log probabilities, an end-of-sequence token not
ending it. A step's requests are all submitted before any is read, so its beams share the engine's
passes, and their common prefix comes from the prompt cache. The log probabilities are of the raw
logits, worked the same whatever batch a row ran in (tpserve/kernels/sampling.py), so a search answers the
same alone or beside other traffic. Runs on a worker thread; every wait has a deadline.
"""

from __future__ import annotations

import time

import grpc

from tpserve.server.beam_search import BeamResult, BeamSettings, Candidates, search
from tpserve.server.lane_stream import Stream
from tpserve.server.requests import ERROR, Finished, TokenDelta
from tpserve.server.submitter import Submitter
from tpserve.server.validation import RequestRefused, invalid_argument, max_tokens_for
from tpserve.v1 import serving_pb2

STEP_TIMEOUT_S = 600.0  # one step's token, queueing included
POLL_S = 1.0


def run_beam_search(
    submitter: Submitter, request: serving_pb2.GenerateRequest, width: int, length_penalty: float
) -> BeamResult:
    """The search for one prompt (`request`'s, checked and tokenized as Generate would)."""
    limit = submitter.limits.max_logprobs
    if limit != -1 and 2 * width > limit:
        raise invalid_argument(
            f"use_beam_search weighs 2 x n = {2 * width} candidates a step; the server's max_logprobs is {limit}"
        )
    prompt_ids = submitter.prompt_ids(request)
    settings = BeamSettings(
        width=width,
        max_tokens=max_tokens_for(request, len(prompt_ids), submitter.limits),
        length_penalty=length_penalty,
        ignore_eos=request.ignore_eos,
    )
    steps = _Steps(submitter, prompt_ids, 2 * width)
    beams = search(steps, settings, submitter.tokenizer.eos_ids)
    return BeamResult(tuple(prompt_ids), tuple(beams))


class _Steps:
    def __init__(self, submitter: Submitter, prompt_ids: list[int], num_candidates: int):
        self._submitter = submitter
        self._prompt_ids = prompt_ids
        self._num_candidates = num_candidates

    def __call__(self, beams: list[tuple[int, ...]]) -> list[Candidates]:
        streams: list[Stream] = []
        try:
            for beam in beams:
                step = serving_pb2.GenerateRequest(
                    prompt_token_ids=[*self._prompt_ids, *beam],
                    max_tokens=1,
                    temperature=0.0,
                    logprobs=self._num_candidates,
                    ignore_eos=True,  # the search, not the host, decides what an ending token does
                )
                streams.append(self._submitter.submit(step))
            return [self._candidates(stream) for stream in streams]
        finally:
            for stream in streams:
                if stream.finished is None:
                    stream.cancel()

    def _candidates(self, stream: Stream) -> Candidates:
        """The step's likeliest next tokens, best first (equal figures by lower id)."""
        deadline = time.monotonic() + STEP_TIMEOUT_S
        found: Candidates | None = None
        while (left := deadline - time.monotonic()) > 0:
            for event in stream.next_events(min(left, POLL_S)):
                if isinstance(event, TokenDelta) and event.logprobs and found is None:
                    found = event.logprobs[0].top
                elif isinstance(event, Finished):
                    return self._ended(event, found)
        raise RequestRefused(
            grpc.StatusCode.DEADLINE_EXCEEDED, f"a beam search step got no token within {STEP_TIMEOUT_S:g} s"
        )

    def _ended(self, event: Finished, found: Candidates | None) -> Candidates:
        refusal = self._submitter.broke_mid_reply(event)
        if refusal is not None:
            raise refusal
        if event.reason == ERROR or found is None:
            raise RequestRefused(grpc.StatusCode.INTERNAL, event.error or "a beam search step gave no token")
        return found
