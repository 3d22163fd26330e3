"""One reply's sampled tokens as the client's TokenDelta events: text, stop strings, the ending.

Two forms with one interface, `take(token_id, logprob, ends) -> finish reason | None`:
- ReplyText detokenizes and matches stop strings (tpserve/server/text_stream.py): what a reply sends where
  the text is made, the lane host's scheduling thread in one process, or the front process
  (tpserve/server/front_process.py) with the engine apart;
- RawReply sends each token as it comes, with no text: what the engine process sends the front,
  which makes the text there, so detokenizing never holds the engine loop's interpreter.
Both end a reply at the same token for EOS, stop_token_ids and max_tokens; only ReplyText sees
stop strings (the front then cancels the engine's stream).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tpserve.server.requests import LENGTH, STOP, GenerationRequest, TokenDelta, TokenLogprob
from tpserve.server.text_stream import TextOut, TextStream


def ends_reply(request: GenerationRequest, token_id: int, eos_ids: frozenset[int]) -> bool:
    """Whether this sampled token ends the reply (a stop token id, or EOS unless ignored)."""
    return token_id in request.stop_token_ids or (token_id in eos_ids and not request.ignore_eos)


class ReplyText:
    def __init__(
        self,
        request: GenerationRequest,
        detokenize: Callable[[Sequence[int]], str],
        put: Callable[[TokenDelta], None],
    ):
        self._request = request
        self._put = put
        self._wants_logprobs = request.sampling.logprobs >= 0
        self.text = TextStream(
            detokenize,
            request.stop,
            context_ids=request.prompt_ids,
            include_stop=request.include_stop_str_in_output,
        )
        self.num_tokens = 0  # every token taken, sent or held back
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob | None] = []  # per taken token, when the request asks
        self._num_tokens_sent = 0

    def take(self, token_id: int, logprob: TokenLogprob | None, ends: bool) -> str | None:
        """One sampled token; sends what text it releases; the finish reason when the reply ends."""
        self._ids.append(token_id)
        self.num_tokens += 1
        if self._wants_logprobs:
            self._logprobs.append(logprob)
        if ends:
            self._send(self.text.finish())
            self._send_stop_tokens()
            return STOP
        self._send(self.text.push(token_id))
        if self.text.stopped:
            self._send_stop_tokens()
            return STOP
        if self.num_tokens >= self._request.max_tokens:
            self._send(self.text.finish())
            return LENGTH
        return None

    def _send_stop_tokens(self) -> None:
        """The tokens that ended the reply (an EOS token, a stop string's tokens): their ids, with no
        text, so a reply's token ids are the tokens usage counts."""
        unsent = tuple(self._ids[self._num_tokens_sent :])
        if unsent:
            self._send(TextOut(unsent, ""))

    def _send(self, out: TextOut) -> None:
        if not out:
            return
        # Released tokens are the next taken ones, in order (text_stream.py).
        start, self._num_tokens_sent = self._num_tokens_sent, self._num_tokens_sent + len(out.token_ids)
        logprobs = self._logprobs[start : self._num_tokens_sent] if self._wants_logprobs else []
        self._put(TokenDelta(out.token_ids, out.text, tuple(lp for lp in logprobs if lp is not None)))


class RawReply:
    def __init__(self, request: GenerationRequest, put: Callable[[TokenDelta], None]):
        self._max_tokens = request.max_tokens
        self._put = put
        self.num_tokens = 0

    def take(self, token_id: int, logprob: TokenLogprob | None, ends: bool) -> str | None:
        """One sampled token, sent as it is (its log probability beside it, or none)."""
        self.num_tokens += 1
        self._put(TokenDelta((token_id,), "", () if logprob is None else (logprob,)))
        if ends:
            return STOP
        return LENGTH if self.num_tokens >= self._max_tokens else None
