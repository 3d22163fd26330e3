"""`--record DIR`: a Backend wrapper writing what every stream fed and sampled, one file per stream.

A stream is one open..close of a lane; its file is `stream-NNNN.jsonl`, numbered in open order (a
background stream that yields and resumes gets a second file). One JSON object per line:

    {"step": "open"}
    {"step": "cached", "num_tokens": 32}                               shared blocks of a cached prefix
    {"step": "prefill", "start": 0, "token_ids": [...], "position": 70, "fed": 9, "sampled": 12, "features": [...]}
    {"step": "decode", "position": 71, "fed": 12, "sampled": 30, "features": [...]}
    {"step": "prefill", "start": 0, "token_ids": [...]}                  a prompt closed before its end

`position` is where the fed token went; the sampled token goes at position + 1. `features` are the
inner backend's top logits (Backend.top_logits) when it keeps them, else absent. A prompt is one
line however it was cut into chunks (the chunks beside a decode round depend on what else ran), held
until its last chunk; a prompt in a joint prefill_many is written exactly as after its own prefill,
and a pass that was refused or failed writes nothing, so a batched run and a solo run can be
compared file by file. Every operation of the
Backend protocol is forwarded unchanged, flags included (drafts stay on when recording); a Verify is
written as the decode steps of the samples its stream keeps, so drafts on or off, and however many a
round checked, write the same lines.

A stream's file is closed when its lane closes. Only a broken engine leaves files open (its lanes are
forgotten, never closed, and the process exits); every line is flushed as written, so they lose
nothing but the chunks of a prompt held for its line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from tpserve.server.backend import Backend, DecodeItem, PrefillItem, check_backend
from tpserve.server.drafts import count_kept

FILE_PATTERN = "stream-*.jsonl"


def _inner_figure(name: str) -> property:
    return property(lambda self: getattr(self._inner, name), doc=f"The inner backend's {name}.")


class RecordingBackend:
    def __init__(self, inner: Backend, out_dir: str | Path):
        check_backend(inner)
        self._inner = inner
        self._out_dir = Path(out_dir)
        self._out_dir.mkdir(parents=True, exist_ok=True)
        if any(self._out_dir.glob(FILE_PATTERN)):
            raise FileExistsError(f"{self._out_dir} already holds a recording; record into an empty folder")
        self._files: dict[int, IO[str]] = {}
        self._chunks: dict[int, tuple[int, list[int]]] = {}  # lane -> a prompt's start and ids so far
        self._num_streams = 0

    # The inner backend's figures and flags, read through (they are the inner's to change).
    num_lanes = _inner_figure("num_lanes")
    num_blocks = _inner_figure("num_blocks")
    block_size = _inner_figure("block_size")
    room = _inner_figure("room")
    context_size = _inner_figure("context_size")
    batches_prompts = _inner_figure("batches_prompts")
    verifies_drafts = _inner_figure("verifies_drafts")
    max_prefill_tokens = _inner_figure("max_prefill_tokens")

    def open(self, lane: int, blocks: tuple[int, ...], num_cached: int, copy_from: int = -1) -> None:
        # Block ids are left out: they depend on what ran beside the stream, and a batched run's
        # files must read as a solo run's. A cached prefix is written: the prefill starts after it.
        self._inner.open(lane, blocks, num_cached, copy_from)
        self._num_streams += 1
        path = self._out_dir / f"stream-{self._num_streams:04d}.jsonl"
        self._files[lane] = path.open("w", encoding="utf-8")
        self._write(lane, {"step": "open"})
        if num_cached:
            self._write(lane, {"step": "cached", "num_tokens": num_cached})

    def prefill(self, item: PrefillItem) -> int | None:
        token = self._inner.prefill(item)
        self._write_prefill(item, token)
        return token

    def prefill_many(self, items: list[PrefillItem]) -> list[int] | None:
        tokens = self._inner.prefill_many(items)
        if tokens is not None:
            for item, token in zip(items, tokens):
                self._write_prefill(item, token)
        return tokens

    def decode(self, items: list[DecodeItem], prompts: Sequence[PrefillItem] = ()) -> list[int]:
        tokens = self._inner.decode(items, prompts)
        for item, token in zip(items, tokens):
            step = {"step": "decode", "position": item.position, "fed": item.token_id, "sampled": token}
            self._write(item.lane, self._with_features(item.lane, step))
        self._write_prompts(prompts, tokens[len(items) :])
        return tokens

    def decode_drafts(self, items: list[DecodeItem], prompts: Sequence[PrefillItem] = ()) -> list[list[int]]:
        """A Verify, written as the decode steps of the samples the stream keeps (count_kept): the
        very lines plain decoding writes, so a run with drafts records what one without does."""
        samples = self._inner.decode_drafts(items, prompts)
        self._write_prompts(prompts, [token for tokens in samples[len(items) :] for token in tokens])
        for item, tokens in zip(items, samples):
            features = self._inner.draft_top_logits(item.lane)
            fed = (item.token_id, *item.draft)
            for i in range(count_kept(item.draft, tokens)):
                step = {"step": "decode", "position": item.position + i, "fed": fed[i], "sampled": tokens[i]}
                if features:
                    step["features"] = [list(pair) for pair in features[i]]
                self._write(item.lane, step)
        return samples

    def close(self, lane: int) -> None:
        try:
            self._inner.close(lane)
        finally:
            start, token_ids = self._chunks.pop(lane, (0, []))
            if token_ids:
                self._write(lane, {"step": "prefill", "start": start, "token_ids": token_ids})
            file = self._files.pop(lane, None)
            if file is not None:
                file.close()

    def idle(self) -> None:
        self._inner.idle()

    def top_logits(self, lane: int) -> list[tuple[int, float]]:
        return self._inner.top_logits(lane)

    def draft_top_logits(self, lane: int) -> list[list[tuple[int, float]]]:
        return self._inner.draft_top_logits(lane)

    def _write_prompts(self, prompts: Sequence[PrefillItem], tokens: list[int]) -> None:
        """The prompts that rode with a decode round, each written as after its own prefill
        (`tokens`: one per prompt that ended, in order)."""
        ended = iter(tokens)
        for item in prompts:
            self._write_prefill(item, next(ended) if item.last else None)

    def _write_prefill(self, item: PrefillItem, token: int | None) -> None:
        start, token_ids = self._chunks.pop(item.lane, (item.start, []))
        token_ids += item.token_ids
        if not item.last:
            self._chunks[item.lane] = (start, token_ids)
            return
        position = item.start + len(item.token_ids) - 1
        step = {"step": "prefill", "start": start, "token_ids": token_ids}
        step |= {"position": position, "fed": item.token_ids[-1], "sampled": token}
        self._write(item.lane, self._with_features(item.lane, step))

    def _with_features(self, lane: int, step: dict) -> dict:
        features = self._inner.top_logits(lane)
        if features:
            step["features"] = [list(pair) for pair in features]
        return step

    def _write(self, lane: int, step: dict) -> None:
        file = self._files[lane]
        file.write(json.dumps(step) + "\n")
        file.flush()  # a crashed run keeps every step up to the crash
