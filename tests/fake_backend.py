"""A fake Backend for the lane host's tests: the exact Protocol, strict about misuse, and a sampler
whose every token depends on the lane's whole history (tests/fake_tokens.py draw), read back through
its block tables (tests/fake_kv.py), so any rollback, position slip or cross-talk between lanes
changes the reply or is misuse. A request's reply never depends on its lane, its neighbours, or
whether its prompt went alone or in a joint pass; `solo_reply` (a fresh fake and host running the
request alone) is the oracle.

Failures a test can ask for: prompts whose first token is poisoned (prefill and prefill_many raise,
or refuse), a joint pass that raises at its first, middle or last participant, a first sampled token
outside the vocabulary, and a decode round that breaks the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from fake_kv import FakeKV, FakeLane
from fake_replies import Reply, run_all
from fake_tokens import BAD_TOKEN, EOS_IDS, VOCAB_SIZE, draw, fake_detokenize, top_features

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.server.backend import BackendBroken, ChunkRefused, DecodeItem, PrefillItem
from tpserve.server.lane_host import LaneHost
from tpserve.server.requests import GenerationRequest


class FakeFailure(RuntimeError):
    """A failure a test asked for."""


class FakeBackend(FakeKV):
    """The Backend protocol's passes over the KV blocks of FakeKV, its sampler, and the failures to inject."""

    def __init__(
        self,
        *,
        num_lanes: int = 4,
        room: int = 4096,
        block_size: int = 8,
        context_size: int = 256,
        max_prefill_tokens: int = 64,
        batched: bool = False,
        max_batch_streams: int = 16,
        repeat_period: int = 0,
        break_period: int = 0,
        verifies_drafts: bool = True,
    ):
        super().__init__(num_blocks=room // block_size, block_size=block_size)
        self.num_lanes = num_lanes
        self.room = self.num_blocks * block_size
        self.context_size = context_size
        self.max_prefill_tokens = max_prefill_tokens
        self.batches_prompts = batched
        self.verifies_drafts = verifies_drafts
        self.max_batch_streams = max_batch_streams
        self.repeat_period = repeat_period  # > 0: greedy tokens repeat the history with this period
        self.break_period = break_period  # > 0: except at positions divisible by it (drafts fail there)
        # Failures to inject.
        self.poisoned_prompts: set[int] = set()  # first prompt tokens whose prefills fail
        self.refuse_poisoned_passes = False  # prefill_many returns None for them instead of raising
        self.raise_in_pass_at: str | None = None  # "first" | "middle" | "last" participant raises
        self.bad_first_token_prompts: set[int] = set()  # their first sample is BAD_TOKEN
        self.break_after_decodes: int | None = None  # decode raises BackendBroken after this many
        # What happened.
        self.num_opens = 0
        self.num_prefills = 0
        self.num_decodes = 0
        self.num_verifies = 0
        self.num_idles = 0
        self.joint_passes: list[int] = []  # sizes of the prefill_many passes that went through
        self.beside_round: list[int] = []  # prompts (whole ones, a chunk) that went in a decode round's pass
        self.refused_passes: list[int] = []
        self.failed_passes: list[int] = []
        self.decode_sizes: list[int] = []
        # In call order: ("prefill", prompt tokens) for a pass alone or together, ("decode", lanes).
        self.timeline: list[tuple[str, int]] = []
        self.broken = False
        self.num_calls_after_broken = 0
        self.num_copies = 0  # opens that copied a partly matching block's slots

    def open(self, lane: int, blocks: tuple[int, ...], num_cached: int, copy_from: int = -1) -> None:
        """The first num_cached positions are shared blocks of a cached prefix, then the slots copied
        from `copy_from` into the lane's next block: read back through the table like any others, so
        sharing or copying the wrong slots changes the reply."""
        self._call()
        if not 0 <= lane < self.num_lanes or lane in self.lanes:
            self._misuse(f"open of lane {lane}, which is out of range or already open")
        num_shared, partial = divmod(num_cached, self.block_size)
        if num_shared + bool(partial) > len(blocks):
            self._misuse(f"open of lane {lane} with {num_cached} cached tokens on {len(blocks)} blocks")
        if not partial and copy_from != -1:
            self._misuse(
                f"open of lane {lane}: a copy from block {copy_from} with {num_cached} cached tokens"
            )
        if partial:
            self.num_copies += 1
            self._copy_slots(lane, copy_from, blocks[num_shared], partial)
        self.num_opens += 1
        self.lanes[lane] = FakeLane([], num_cached)
        self._share(lane, blocks[:num_shared])
        self._extend(lane, blocks[num_shared:])

    def prefill(self, item: PrefillItem) -> int | None:
        self._call()
        self.num_prefills += 1
        lane = self._check_prefill(item, max_tokens=self.max_prefill_tokens)
        self.timeline.append(("prefill", len(item.token_ids)))
        if self._first_token_of(lane, item) in self.poisoned_prompts:
            self._reset(lane)
            raise FakeFailure(f"the engine refused the prompt on lane {item.lane}")
        self._extend(item.lane, item.blocks)
        self._feed(lane, item.token_ids)
        return self._sample(lane, item.sampling) if item.last else None

    def prefill_many(self, items: list[PrefillItem]) -> list[int] | None:
        self._call()
        if not self.batches_prompts:
            self._misuse("prefill_many on a backend that does not batch prompts")
        if not 2 <= len(items) <= 16 or len({item.lane for item in items}) != len(items):
            self._misuse(f"prefill_many over {len(items)} items (lanes {[item.lane for item in items]})")
        lanes = [self._check_prefill(item, max_tokens=self.max_prefill_tokens) for item in items]
        if any(not item.last for item in items):
            self._misuse("prefill_many with a prompt that does not end in this pass")
        num_tokens = sum(len(item.token_ids) for item in items)
        if num_tokens > self.max_prefill_tokens:
            self._misuse(f"prefill_many over {num_tokens} prompt tokens (at most {self.max_prefill_tokens})")
        self.timeline.append(("prefill", num_tokens))
        poisoned = [
            i for i, item in enumerate(items) if self._first_token_of(lanes[i], item) in self.poisoned_prompts
        ]
        if len(items) > self.max_batch_streams or (poisoned and self.refuse_poisoned_passes):
            self.refused_passes.append(len(items))
            return None
        raise_at = {"first": 0, "middle": len(items) // 2, "last": len(items) - 1}.get(self.raise_in_pass_at)
        fed: list[tuple[FakeLane, int, PrefillItem]] = []
        try:
            for index, (item, lane) in enumerate(zip(items, lanes)):
                fed.append((lane, lane.length, item))
                self._extend(item.lane, item.blocks)
                self._feed(lane, item.token_ids)
                if index == raise_at or index in poisoned:
                    raise FakeFailure(f"the joint prompt pass failed at participant {index}")
        except FakeFailure:
            # The failing participant included, none may keep what this pass fed, nor the blocks
            # it brought (a restored prompt-cache prefix from before the pass stays).
            for lane, length, item in fed:
                self._rewind(lane, length)
                self._unextend(item.lane, item.blocks)
            self.failed_passes.append(len(items))
            raise
        self.joint_passes.append(len(items))
        return [self._sample(lane, item.sampling) for item, lane in zip(items, lanes)]

    def decode(self, items: list[DecodeItem], prompts: Sequence[PrefillItem] = ()) -> list[int]:
        self._call()
        prompt_lanes = self._check_prompts(items, prompts)
        if self.break_after_decodes is not None and self.num_decodes >= self.break_after_decodes:
            self.broken = True
            raise BackendBroken("fake: the decode round failed (a rank was lost)")
        self.num_decodes += 1
        self.decode_sizes.append(len(items))
        self.timeline.append(("decode", len(items)))
        if len({item.lane for item in items}) != len(items):
            self._misuse(f"decode round with a lane twice: {[item.lane for item in items]}")
        tokens = []
        for item in items:
            lane = self._open_lane(item.lane)
            if item.position != lane.length or item.token_id != lane.pending:
                self._misuse(
                    f"lane {item.lane} fed token {item.token_id} at position {item.position}; "
                    f"expected token {lane.pending} at position {lane.length}"
                )
            self._extend(item.lane, item.blocks)
            self._feed(lane, (item.token_id,))
            tokens.append(self._sample(lane, item.sampling))
        return [*tokens, *self._feed_prompts(prompt_lanes, prompts)]

    def _check_prompts(self, items: list[DecodeItem], prompts: Sequence[PrefillItem]) -> list[FakeLane]:
        """Prompts beside a round: each checked as a prefill is, at most 16 whole ones and a chunk,
        and all refused (nothing of the round runs) when one is poisoned, as the engine's vote
        refuses them."""
        lanes = [item.lane for item in items]
        if len({*lanes, *(prompt.lane for prompt in prompts)}) != len(lanes) + len(prompts):
            self._misuse(f"prompts on lanes {[p.lane for p in prompts]} beside a round over {lanes}")
        if len(prompts) > 17:
            self._misuse(f"{len(prompts)} prompts beside a round (at most 16 and a chunk)")
        checked = [self._check_prefill(prompt, max_tokens=self.max_prefill_tokens) for prompt in prompts]
        poisoned = any(
            self._first_token_of(lane, p) in self.poisoned_prompts for lane, p in zip(checked, prompts)
        )
        if poisoned or len(prompts) > self.max_batch_streams:
            raise ChunkRefused(f"lanes {[p.lane for p in prompts]}: the engine refused a prompt")
        if prompts:
            self.beside_round.append(len(prompts))
        return checked

    def _feed_prompts(self, lanes: list[FakeLane], prompts: Sequence[PrefillItem]) -> list[int]:
        """The prompts' sampled tokens, one per prompt that ends, in order."""
        tokens = []
        for lane, prompt in zip(lanes, prompts):
            self.num_prefills += 1
            self.timeline.append(("prefill", len(prompt.token_ids)))
            self._extend(prompt.lane, prompt.blocks)
            self._feed(lane, prompt.token_ids)
            if prompt.last:
                tokens.append(self._sample(lane, prompt.sampling))
        return tokens

    def decode_drafts(self, items: list[DecodeItem], prompts: Sequence[PrefillItem] = ()) -> list[list[int]]:
        """A decode round whose items carry drafts: a token sampled after each fed token. The lane
        then keeps what the host keeps (up to the first sample that differs from the next draft), so
        the next round finds it where the engine's cut would leave it."""
        self._call()
        if not self.verifies_drafts:
            self._misuse("decode_drafts on a backend that does not verify drafts")
        prompt_lanes = self._check_prompts(items, prompts)
        self.num_verifies += 1
        self.timeline.append(("verify", sum(1 + len(item.draft) for item in items)))
        out = []
        for item in items:
            lane = self._open_lane(item.lane)
            if item.position != lane.length or item.token_id != lane.pending:
                self._misuse(f"lane {item.lane} verified at position {item.position}, token {item.token_id}")
            self._extend(item.lane, item.blocks)
            samples, lane.draft_features = [], []
            for token in (item.token_id, *item.draft):
                self._feed(lane, (token,))
                samples.append(self._sample(lane, item.sampling))
                lane.draft_features.append(lane.features)
            num_kept = 1
            while num_kept <= len(item.draft) and samples[num_kept - 1] == item.draft[num_kept - 1]:
                num_kept += 1
            num_samples = lane.num_samples
            self._rewind(lane, item.position + num_kept)
            lane.pending, lane.num_samples = samples[num_kept - 1], num_samples
            out.append(samples)
        return [*out, *([token] for token in self._feed_prompts(prompt_lanes, prompts))]

    def close(self, lane: int) -> None:
        self._call()
        if lane not in self.lanes:
            self._misuse(f"close of lane {lane}, which is not open")
        self._release(lane)

    def idle(self) -> None:
        self._call()
        self.num_idles += 1

    def top_logits(self, lane: int) -> list[tuple[int, float]]:
        """The top logits of the lane's last sampled step (derived from its history)."""
        return list(self._open_lane(lane).features)

    def draft_top_logits(self, lane: int) -> list[list[tuple[int, float]]]:
        """The top logits of each row of the lane's last decode_drafts round."""
        return list(self._open_lane(lane).draft_features)

    def solo_reply(self, request: GenerationRequest) -> Reply:
        """The reply `request` gets alone on a fresh fake of the same shape: the oracle."""
        backend = FakeBackend(
            num_lanes=self.num_lanes,
            room=self.room,
            block_size=self.block_size,
            context_size=self.context_size,
            max_prefill_tokens=self.max_prefill_tokens,
            repeat_period=self.repeat_period,
            break_period=self.break_period,
        )
        host = LaneHost(backend, detokenize=fake_detokenize, eos_ids=EOS_IDS)
        (reply,) = run_all(host, [host.submit(request)])
        backend.assert_clean()
        return reply

    def _call(self) -> None:
        if self.broken:
            self.num_calls_after_broken += 1

    def _check_prefill(self, item: PrefillItem, max_tokens: int) -> FakeLane:
        lane = self._open_lane(item.lane)
        if not item.token_ids or len(item.token_ids) > max_tokens:
            self._misuse(f"prefill of {len(item.token_ids)} tokens (at most {max_tokens} per pass)")
        if item.start != lane.length:
            self._misuse(f"prefill on lane {item.lane} starts at {item.start}; it holds {lane.length}")
        end = item.start + len(item.token_ids)
        for image in item.images:  # as the engine's spans refuse a pass that cuts such an image
            if image.whole and image.offset < end < image.offset + image.num_tokens:
                self._misuse(f"prefill on lane {item.lane} ends at {end}, inside an image that goes whole")
        return lane

    def _sample(self, lane: FakeLane, sampling: SamplingParams) -> int:
        history = self._history(lane)
        value = draw(history, sampling, self.repeat_period, self.break_period)
        token = value % VOCAB_SIZE
        if lane.num_samples == 0 and history[0] in self.bad_first_token_prompts:
            token = BAD_TOKEN
        lane.features = top_features(value)
        lane.pending = token
        lane.num_samples += 1
        return token
