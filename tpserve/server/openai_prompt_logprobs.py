"""A prompt's log probabilities as the OpenAI API shows them: in front of a completion's legacy
`logprobs` lists (`echo` with `logprobs`, what lm-eval's loglikelihood tasks read), or as vLLM's
`prompt_logprobs` list. The first prompt token has none: null in both shapes."""

from __future__ import annotations

from collections.abc import Callable

from tpserve.server.requests import Prefilled


def echoed_logprobs(prefilled: Prefilled, reply: dict | None, token_text: Callable[[int], str]) -> dict:
    """OpenAI's legacy lists for echo with logprobs: the prompt's tokens, then the reply's (`reply`,
    ReplyShape's lists for the reply alone; its text offsets move past the prompt's text)."""
    texts = [token_text(token) for token in prefilled.prompt_ids]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    rows = prefilled.prompt_logprobs
    tops = [{**{token_text(t): v for t, v in lp.top}, token_text(lp.token_id): lp.logprob} for lp in rows]
    reply = reply or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    return {
        "tokens": texts + reply["tokens"],
        "token_logprobs": [None, *(lp.logprob for lp in rows), *reply["token_logprobs"]],
        "top_logprobs": [None, *tops, *reply["top_logprobs"]],
        "text_offset": offsets + [at + offset for offset in reply["text_offset"]],
    }


def vllm_prompt_logprobs(prefilled: Prefilled, token_text: Callable[[int], str]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, then {token id: {logprob,
    rank, decoded_token}} holding the prompt's token and the likeliest ones (rank 1 the likeliest;
    a prompt token outside the likeliest gets the rank past them, as vLLM's lists never name it)."""
    out: list[dict | None] = [None]
    for lp in prefilled.prompt_logprobs:
        entry = {
            str(t): {"logprob": v, "rank": rank, "decoded_token": token_text(t)}
            for rank, (t, v) in enumerate(lp.top, start=1)
        }
        if str(lp.token_id) not in entry:
            rank = 1 + sum(v > lp.logprob for _, v in lp.top)
            entry[str(lp.token_id)] = {
                "logprob": lp.logprob,
                "rank": rank,
                "decoded_token": token_text(lp.token_id),
            }
        out.append(entry)
    return out
