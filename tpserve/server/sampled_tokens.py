"""What a sampled token does to its stream: its log probability looked up when asked for, the job's
accept (text, stop strings, length, eos), and before a stream's first token its Prefilled event with
the prompt's log probabilities. It says how the stream ends, if it does; ending it (its lane closed)
is the scheduler's (lane_scheduler.py).
"""

from __future__ import annotations

from collections.abc import Callable

from tpserve.server.lane_job import Job
from tpserve.server.requests import ERROR, Prefilled, TokenLogprob

End = tuple[str, str | None]  # the finish reason and the error, if any


class SampledTokens:
    def __init__(
        self,
        *,
        eos_ids: frozenset[int],
        clock: Callable[[], float],
        logprobs: Callable[[int, int], TokenLogprob | None] | None,
        prompt_logprobs: Callable[[int], dict[int, TokenLogprob]] | None,
    ):
        self._eos_ids = eos_ids
        self._clock = clock
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs

    def first(self, job: Job, token: int) -> End | None:
        """The token sampled after the job's whole prompt."""
        if not job.prefilled_sent:
            job.prefilled_sent = True
            rows = self._prompt_rows(job)
            job.stream.put(Prefilled(job.cached_tokens, rows, job.request.prompt_ids if rows else ()))
        return self.take(job, token)

    def _prompt_rows(self, job: Job) -> tuple[TokenLogprob, ...]:
        """The log probabilities of the prompt's tokens after its first, when the request asks."""
        if job.request.prompt_logprobs < 0 or self._prompt_logprobs is None or job.lane is None:
            return ()
        found = self._prompt_logprobs(job.lane)
        return tuple(found[p] for p in range(1, len(job.request.prompt_ids)) if p in found)

    def take(self, job: Job, token: int) -> End | None:
        logprob = None
        if self._logprobs is not None and job.wants_logprobs and job.lane is not None:
            logprob = self._logprobs(job.lane, job.next_token_position)
        try:
            reason = job.accept(token, self._eos_ids, self._clock(), logprob)
        except Exception as error:  # a token the tokenizer cannot decode fails this stream alone
            return ERROR, f"could not decode token {token}: {error}"
        return None if reason is None else (reason, None)
