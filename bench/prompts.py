"""The prompts the benchmarks send: short chats and filler text of an exact length."""

from __future__ import annotations

from tpserve.server.tokenizer import Tokenizer

FILLER = (
    "the lane host admits waiting requests, prefills their prompts and runs decode rounds over "
    "every live lane while the follower replays each message on its own shard of the weights"
)


def chat_prompt(tokenizer: Tokenizer, index: int) -> list[int]:
    """A short chat prompt, different for every index."""
    topics = ("rivers", "bridges", "libraries", "volcanoes", "gardens", "trains", "comets", "bees")
    topic = topics[index % len(topics)]
    return tokenizer.encode_chat([{"role": "user", "content": f"Tell me fact {index} about {topic}."}])


def text_prompt(tokenizer: Tokenizer, index: int, num_tokens: int) -> list[int]:
    """A prompt of exactly `num_tokens` ids, different for every index (its opening names it)."""
    text = f"Request {index}: "
    ids: list[int] = []
    while len(ids) < num_tokens:
        text += FILLER + f" (part {len(ids)}). "
        ids = tokenizer.encode(text)
    return ids[:num_tokens]
