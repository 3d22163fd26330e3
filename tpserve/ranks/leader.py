"""Rank 0's side of the engine: the Backend the lane host drives.

Each pass is sent on the wire as one StepPlan (carrying the lanes opened and closed since the last
message, which rank 0 applied at once), then applied here with the same code the followers run
(`apply_message`), and only here are tokens sampled. Any failure of the wire or of a pass whose
collectives already started latches the leader broken: it cannot know what the followers hold.
"""

from __future__ import annotations

import logging

import torch

from tpserve.kernels.device_sampling import Shortlist, lists_on_device, samples_on_device
from tpserve.kernels.sampling import sample, sample_listed, token_logprobs, top_logits
from tpserve.kernels.sampling_params import TokenLogprob
from tpserve.ranks.apply import VotedDown, apply_message
from tpserve.ranks.channel import ChannelBroken, gist_of
from tpserve.ranks.engine import Engine
from tpserve.ranks.errors import BackendBroken, ChunkRefused
from tpserve.ranks.mrope import chunk_rope
from tpserve.ranks.step_profile import NoProfile, StepProfile
from tpserve.ranks.wire_messages import Admit, Idle, Prefill, Release, Round, StepPlan, Stop, Verify
from tpserve.ranks.wire_spans import Span, Step

log = logging.getLogger(__name__)

NUM_FEATURES = 8  # top logits kept per step for the recorder


def media_in_chunk(images, start: int, num_tokens: int):
    """The image runs of a prompt chunk at positions start..start+num_tokens-1: (offset in the
    chunk, length) per run, and the feature rows of each run ([length, hidden] each).

    images: the prompt's images (offset, num_tokens, features [num_tokens, hidden]); a chunk or a
    cached prefix can cut an image anywhere, so a run may be a slice of one."""
    runs, rows = [], []
    for image in images:
        first = max(image.offset, start)
        end = min(image.offset + image.num_tokens, start + num_tokens)
        if first < end:
            runs.append((first - start, end - first))
            rows.append(image.features[first - image.offset : end - image.offset])
    return tuple(runs), rows


def _kind_of(msg) -> str:
    """What a message ran, for the broken reason: a plan's pass by its parts ("Round+Prefill")."""
    if isinstance(msg, StepPlan) and msg.runs_pass:
        return "+".join(type(part).__name__ for part in (msg.round, msg.prefill) if part is not None)
    return type(msg).__name__


class Leader:
    def __init__(
        self,
        engine: Engine,
        channel,
        *,
        num_lanes: int,
        context_size: int,
        max_prefill_tokens: int,
        batches_prompts: bool,
        record_features: bool = False,
        profile: StepProfile | NoProfile | None = None,
        device_type: str | None = None,
    ):
        """device_type: where rounds' tokens may be taken or shortlisted (tpserve/kernels/device_sampling.py
        samples_on_device, lists_on_device); None: the engine's device."""
        self.engine = engine
        self.device_type = device_type or engine.model.device.type
        self.channel = channel
        self.num_lanes = num_lanes
        self.num_blocks = engine.num_blocks  # the lanes' (a graphed engine keeps one spare)
        self.block_size = engine.kv.block_size
        self.room = self.num_blocks * self.block_size
        self.context_size = context_size
        self.max_prefill_tokens = max_prefill_tokens
        self.batches_prompts = batches_prompts
        self.verifies_drafts = True
        self.broken: str | None = None
        self._idle = False
        # Lanes opened and closed since the last message: applied here at once, and sent to the
        # followers inside the next step's StepPlan, so a lane costs no message of its own.
        self._unsent: list[Admit | Release] = []
        self._features: dict[int, list[tuple[int, float]]] = {}
        self._draft_features: dict[int, list[list[tuple[int, float]]]] = {}  # per row of a Verify
        # The log probabilities of the last sampling pass's tokens, by (lane, position), for the
        # streams that asked; the lane host reads them right after the pass.
        self._logprobs: dict[tuple[int, int], TokenLogprob] = {}
        # Prompt log probabilities by lane and position, gathered over a prompt's chunks for the
        # items that ask (PrefillItem.prompt_logprobs), until the lane host takes them.
        self._prompt_logprobs: dict[int, dict[int, TokenLogprob]] = {}
        self._record_features = record_features  # top logits per step, for the recorder only
        self.profile = (
            profile or NoProfile()
        )  # the step timers, when measured (tpserve/ranks/step_profile.py)

    # The Backend protocol ---------------------------------------------------------------------
    def open(self, lane: int, blocks: tuple[int, ...], num_cached: int, copy_from: int = -1) -> None:
        self._apply_here(Admit(lane, blocks, num_cached, copy_from))

    def prefill(self, item) -> int | None:
        tokens = self.prefill_many([item])
        if tokens is None:
            raise RuntimeError(f"lane {item.lane}: prefill refused")
        return tokens[0] if item.last else None

    def prefill_many(self, items) -> list[int] | None:
        msg, media = self._prefill_message(items)
        try:
            logits = self._run(StepPlan(prefill=msg), media)
        except VotedDown:
            return None
        logits = self._take_prompt_rows(logits, items)
        return self._sample(logits, items, [i.start + len(i.token_ids) for i in items])

    @staticmethod
    def _prefill_message(items) -> tuple[Prefill, torch.Tensor | None]:
        spans, features = [], []
        for item in items:
            runs, rows = media_in_chunk(item.images, item.start, len(item.token_ids))
            every_row = item.prompt_logprobs >= 0
            # () for a 1-D rotary
            rope = chunk_rope(item.images, item.start, len(item.token_ids), item.prompt_length)
            spans.append(
                Span(item.lane, item.start, tuple(item.token_ids), runs, item.blocks, every_row, rope)
            )
            features += rows
        return Prefill(tuple(spans)), torch.cat(features) if features else None

    def _with_prompts(self, round_msg, prompts):
        """Run a Round or Verify, with `prompts` (PrefillItems) in the same pass. Returns the logits
        of the round's rows, then one row per prompt that ends (item.last), in order."""
        if not prompts:
            return self._run(StepPlan(round=round_msg))
        prefill, media = self._prefill_message(prompts)
        try:
            logits = self._run(StepPlan(round=round_msg, prefill=prefill), media)
        except VotedDown as error:
            lanes = ", ".join(str(item.lane) for item in prompts)
            raise ChunkRefused(f"lanes {lanes}: a prompt beside the decode round refused") from error
        num_prompt_rows = sum(len(p.token_ids) if p.prompt_logprobs >= 0 else 1 for p in prompts)
        num_round = logits.shape[0] - num_prompt_rows  # the prompts' rows follow the round's
        last = self._take_prompt_rows(logits[num_round:], prompts)
        ended = [i for i, item in enumerate(prompts) if item.last]
        if len(ended) == len(prompts):
            return torch.cat([logits[:num_round], last])
        return torch.cat([logits[:num_round], last[ended]])

    def _take_prompt_rows(self, logits: torch.Tensor, items) -> torch.Tensor:
        """logits: a prompt pass's rows, item by item (every row of an item asking for prompt log
        probabilities, else its last). Keeps those items' prompt log probabilities; returns each
        item's last row ([len(items), vocab]), what sampling reads."""
        if all(item.prompt_logprobs < 0 for item in items):
            return logits
        last, at = [], 0
        for item in items:
            if item.prompt_logprobs < 0:
                last.append(at)
                at += 1
                continue
            targets = item.prompt_targets
            if len(targets) > len(item.token_ids):
                raise ValueError(
                    f"lane {item.lane}: {len(targets)} prompt targets for a chunk of {len(item.token_ids)}"
                )
            found = token_logprobs(
                logits[at : at + len(targets)], targets, [item.prompt_logprobs] * len(targets)
            )
            kept = self._prompt_logprobs.setdefault(item.lane, {})
            for k, (token, (logprob, top)) in enumerate(zip(targets, found)):
                kept[item.start + k + 1] = TokenLogprob(token, logprob, tuple(top))
            at += len(item.token_ids)
            last.append(at - 1)
        return logits[last]

    def decode_drafts(self, items, prompts=()) -> list[list[int]]:
        msg = Verify(tuple(Span(i.lane, i.position, (i.token_id, *i.draft), (), i.blocks) for i in items))
        rows = [(item, k) for item in items for k in range(1 + len(item.draft))]
        # Row k of an item samples after its first k drafts, which count as its stream's tokens.
        streams = [None if i.counts is None else (i.counts, i.draft[:k]) for i, k in rows]
        # A constrained stream brings no draft (tpserve/server/drafts.py), so its one row takes its mask.
        masks = [item.allowed if k == 0 else None for item, k in rows]
        rows = [(item, item.position + 1 + k) for item, k in rows]
        ended = [item for item in prompts if item.last]
        for item in ended:
            rows.append((item, item.start + len(item.token_ids)))
            masks.append(item.allowed)
            streams.append(None if item.counts is None else (item.counts, ()))
        logits = self._with_prompts(msg, prompts)
        with self.profile.part("sample"):
            tokens = sample(logits, [item.sampling for item, _ in rows], [p for _, p in rows], masks, streams)
        with self.profile.part("logprobs"):
            self._keep_logprobs(
                logits, [(item.lane, item.sampling) for item, _ in rows], [p for _, p in rows], tokens
            )
        features = top_logits(logits, NUM_FEATURES) if self._record_features else None
        out, at = [], 0
        for item in items:
            out.append(tokens[at : at + 1 + len(item.draft)])
            if features is not None:
                self._draft_features[item.lane] = features[at : at + 1 + len(item.draft)]
            at += 1 + len(item.draft)
        for item in ended:  # each ending prompt's first sampled token
            out.append(tokens[at : at + 1])
            if features is not None:
                self._features[item.lane] = features[at]
            at += 1
        return out

    def decode(self, items, prompts=()) -> list[int]:
        msg = Round(tuple(Step(i.lane, i.position, i.token_id, i.blocks) for i in items))
        if not prompts and self._greedy_on_device(items):
            with self.profile.part("sample"):
                # [lanes] int64: only the ids left the device
                ids = self._run(StepPlan(round=msg), greedy=True)
            self._logprobs.clear()
            return ids.tolist()
        if not prompts and self._lists_on_device(items):
            sampling = tuple(item.sampling for item in items)
            with self.profile.part("sample"):
                # only each row's shortlist left the device
                packed = self._run(StepPlan(round=msg), listed=sampling)
                listed = Shortlist.unpack(packed)
                positions = [i.position + 1 for i in items]
                tokens = sample_listed(
                    listed.greedy_ids,
                    listed.rows,
                    listed.ids,
                    listed.logits,
                    sampling,
                    positions,
                    listed.vocab_size,
                )
            self._logprobs.clear()
            return tokens
        logits = self._with_prompts(msg, prompts)
        ended = [item for item in prompts if item.last]
        positions = [i.position + 1 for i in items] + [i.start + len(i.token_ids) for i in ended]
        return self._sample(logits, [*items, *ended], positions)

    def _greedy_on_device(self, items) -> bool:
        return samples_on_device(*self._device_terms(items))

    def _lists_on_device(self, items) -> bool:
        return lists_on_device(*self._device_terms(items))

    def _device_terms(self, items) -> tuple:
        """What the device-sampling choosers read of a round: where, its rows' sampling, grammar
        masks and token counts, and whether its logits are recorded."""
        sampling = [item.sampling for item in items]
        allowed = [item.allowed for item in items]
        streams = [item.counts for item in items]
        return self.device_type, sampling, allowed, streams, self._record_features

    def close(self, lane: int) -> None:
        self._features.pop(lane, None)
        self._prompt_logprobs.pop(lane, None)
        self._draft_features.pop(lane, None)
        self._apply_here(Release(lane))

    def top_logits(self, lane: int) -> list[tuple[int, float]]:
        return self._features.get(lane, [])

    def draft_top_logits(self, lane: int) -> list[list[tuple[int, float]]]:
        """The top logits of every row of the lane's last Verify (recorded runs only)."""
        return self._draft_features.get(lane, [])

    def idle(self) -> None:
        """Tell the followers no message is coming soon, so they wait off any collective timeout."""
        self.profile.flush()
        if not self._idle and self.broken is None:
            self._run(Idle())  # the lanes rank 0 opened or closed go with the next step (_run)
            self._idle = True

    # Beyond the protocol -------------------------------------------------------------------------
    def logprobs(self, lane: int, position: int) -> TokenLogprob | None:
        """The log probability of the token the last pass sampled for `lane` at `position`, when its
        sampling asked for them (SamplingParams.logprobs >= 0); else None."""
        return self._logprobs.get((lane, position))

    def prompt_logprobs(self, lane: int) -> dict[int, TokenLogprob]:
        """The prompt log probabilities the lane's prompt passes gathered, by position (each the
        log probability of the prompt token there, given those before it), taken: a second call
        returns what later passes gathered."""
        return self._prompt_logprobs.pop(lane, {})

    def stop(self) -> None:
        if self.broken is None:
            self._run(Stop())

    def _apply_here(self, msg: Admit | Release) -> None:
        """Apply an Admit or Release on rank 0 now; the followers get it with the next message."""
        if self.broken is not None:
            raise BackendBroken(self.broken)
        apply_message(self.engine, self.channel, msg)  # raises EngineError on an unsound table
        self._unsent.append(msg)

    def _run(self, msg: StepPlan | Idle | Stop, media=None, greedy: bool = False, listed=None):
        """Send `msg` (a StepPlan with the lanes opened and closed since the last message) and apply
        its pass here (greedy: a round's argmax ids instead of its logits; listed: its rows'
        SamplingParams, for its shortlist instead; rank 0's affair: the followers' message is the
        same). Any failure but a vote's no latches the leader broken."""
        if self.broken is not None:
            raise BackendBroken(self.broken)
        try:
            if isinstance(msg, StepPlan):
                unsent, self._unsent = tuple(self._unsent), []
                sent = StepPlan(unsent, msg.round, msg.prefill)
            else:
                # Idle: the lanes opened and closed since the last step wait for the next one
                # (nothing on a follower reads them while it waits), so an idle spell costs the wire
                # its one Idle; Stop: they go first, in a plan with no pass.
                if self._unsent and isinstance(msg, Stop):
                    self.channel.send(StepPlan(tuple(self._unsent)))  # what rank 0 already applied
                    self._unsent = []
                sent = msg
            with self.profile.part("wire send"):
                self.channel.send(sent)
            self._idle = False
            if isinstance(msg, StepPlan) and msg.prefill is not None:
                self.profile.prefilled()
            with self.profile.part("forward (and vote)"):
                # msg, not sent: rank 0 applied its lanes' changes as it made them
                return apply_message(self.engine, self.channel, msg, media, greedy=greedy, listed=listed)
        except VotedDown:
            raise
        except ChannelBroken as error:  # names the rank that did not answer
            self.broken = f"{_kind_of(msg)} failed: {error}"
            log.error("rank 0: engine broken: %s", self.broken)
            raise BackendBroken(self.broken) from error
        except Exception as error:  # the ranks may now disagree: nothing more can be trusted
            peers = ", ".join(str(rank) for rank in range(1, self.channel.world_size))
            where = f" (a collective with rank {peers} failed or timed out)" if peers else ""
            self.broken = f"{_kind_of(msg)} failed{where}: {gist_of(error)}"
            log.error("rank 0: engine broken: %s", self.broken)
            raise BackendBroken(self.broken) from error

    def _sample(self, logits, items, positions) -> list[int]:
        # Only sampled items need the position (the token's own position keys its noise).
        streams = [None if i.counts is None else (i.counts, ()) for i in items]
        with self.profile.part("sample"):
            tokens = sample(
                logits, [i.sampling for i in items], positions, [i.allowed for i in items], streams
            )
        with self.profile.part("logprobs"):
            self._keep_logprobs(logits, [(i.lane, i.sampling) for i in items], positions, tokens)
        if self._record_features:
            for item, features in zip(items, top_logits(logits, NUM_FEATURES)):
                self._features[item.lane] = features
        return tokens

    def _keep_logprobs(self, logits, rows, positions, tokens) -> None:
        """rows: (lane, sampling) per logits row; positions and tokens: what each row sampled."""
        self._logprobs.clear()
        if all(sampling.logprobs < 0 for _, sampling in rows):
            return
        found = token_logprobs(logits, tokens, [sampling.logprobs for _, sampling in rows])
        for (lane, _), position, token, figures in zip(rows, positions, tokens, found):
            if figures is not None:
                self._logprobs[(lane, position)] = TokenLogprob(token, figures[0], tuple(figures[1]))
