"""One OpenAI request as the streams that answer it: a choice per prompt of a prompt list, times `n`.

Choice indexes are OpenAI's: prompt i's j-th choice is choice i * n + j. Each choice is its own
stream on the lane host; choices of one prompt share its KV through the prompt cache when one runs
after another has prefilled it. A seeded request gives choice j the seed seed + j (vLLM's rule for
n > 1), so each choice is reproducible alone and the choices differ; an unseeded one gets a fresh
seed per choice. Greedy choices are all the same reply, as on vLLM.
"""

from __future__ import annotations

from tpserve.server.openai_fields import FieldRefused
from tpserve.server.requests import Usage
from tpserve.server.validation import MAX_SEED
from tpserve.v1 import serving_pb2

MAX_CHOICES = 64  # streams one request may ask for (n times the prompts)


def choice_requests(
    first: serving_pb2.GenerateRequest, more_prompts: list, n: int
) -> tuple[serving_pb2.GenerateRequest, ...]:
    """`first` (holding the first prompt and every other field), for each prompt and each of n."""
    if n * (1 + len(more_prompts)) > MAX_CHOICES:
        raise FieldRefused(
            "n",
            f"n ({n}) times the prompts ({1 + len(more_prompts)}) exceeds the {MAX_CHOICES} choices one request may ask",
        )
    prompts = [first]
    for prompt in more_prompts:
        request = serving_pb2.GenerateRequest()
        request.CopyFrom(first)
        request.ClearField("prompt")
        request.ClearField("prompt_token_ids")
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.extend(prompt)
        prompts.append(request)
    choices = []
    for request in prompts:
        for j in range(n):
            choice = serving_pb2.GenerateRequest()
            choice.CopyFrom(request)
            if j and request.HasField("seed"):
                choice.seed = (request.seed + j) % (MAX_SEED + 1)
            choices.append(choice)
    return tuple(choices)


def cancel_all(streams: list) -> None:
    """A request refused after some of its choices were submitted: those end at once."""
    for stream in streams:
        stream.cancel()


def total_usage(usages: list[Usage], n: int) -> Usage:
    """One request's usage over its choices: each prompt counted once (its first choice's), every
    reply token counted."""
    firsts = usages[::n]
    ttfts = [u.time_to_first_token_s for u in usages if u.time_to_first_token_s is not None]
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in firsts),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in firsts),
        time_to_first_token_s=min(ttfts) if ttfts else None,
        total_s=max((u.total_s for u in usages), default=0.0),
    )
