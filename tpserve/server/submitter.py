"""What both front ends (gRPC and HTTP) do with a request before and after the lane host runs it.

A request arrives as a tpserve.v1 GenerateRequest (the HTTP API translates OpenAI JSON into one), so
both APIs share one set of checks and one wording (tpserve/server/validation.py, tests/golden/errors/). This
module checks it, tokenizes it (the chat template included), submits it and turns the host's own
refusals (queue full, stopping, broken) into RequestRefused; it also counts outcomes in the metrics.
Nothing protocol-specific lives here.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass

import grpc

from tpserve.ranks.errors import UserError
from tpserve.server.engine_client import EngineClient
from tpserve.server.grammar import Grammars
from tpserve.server.heap import LARGE_REQUEST_BYTES, give_back_free_memory
from tpserve.server.lane_stream import Stream
from tpserve.server.media_checks import is_video
from tpserve.server.metrics import ServingMetrics
from tpserve.server.prompt_size import max_prompt_bytes
from tpserve.server.requests import (
    CANCELLED,
    ERROR,
    Finished,
    GenerationRequest,
    HostUnavailable,
    QueueFull,
    TokenDelta,
)
from tpserve.server.serving_info import ServingInfo
from tpserve.server.template_inputs import template_inputs, tool_fields
from tpserve.server.tokenizer import Tokenizer
from tpserve.server.validation import (
    Limits,
    RequestRefused,
    check_generate,
    check_messages,
    check_min_tokens,
    check_prompt_size,
    invalid_argument,
    logprobs_count,
    max_tokens_for,
    message_texts,
    sampling_from,
    tokenize_kind,
    truncated,
)
from tpserve.server.vision_input import VisionInput
from tpserve.v1 import serving_pb2

QUEUE_FULL = "the queue is full; try again later"
ENGINE_BROKEN = "the engine is broken; the server must be restarted"
ENGINE_BROKE_MID_REPLY = "the engine broke during this reply; the server must be restarted"
STOPPING = "the server is stopping"
NO_MEDIA_MODEL = "this server's model reads no image or video inputs"
UNREAD_OVERFLOW = (
    "the client stopped reading: more than {limit} tokens of this reply waited unread "
    "(max_unread_tokens), so it was cancelled"
)
DEFAULT_MAX_UNREAD_TOKENS = 1024

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submitted:
    """A request on the lane host: its stream, and the prompt and budget it runs with (what an
    OpenAI reply reports per chunk and where its last token falls)."""

    stream: Stream
    prompt_ids: tuple[int, ...]
    max_tokens: int


class Submitter:
    def __init__(
        self,
        lane_host: EngineClient,
        tokenizer: Tokenizer,
        info: ServingInfo,
        metrics: ServingMetrics | None = None,
        vision: VisionInput | None = None,
        max_unread_tokens: int = DEFAULT_MAX_UNREAD_TOKENS,
    ):
        """lane_host: the lane host here, or the front process's RemoteEngine
        (tpserve/server/engine_client.py).
        `vision`: the model's image reader, on a server started with --vision for a vision model.
        max_unread_tokens: a stream is cancelled once more tokens than this wait unread, beyond what
        its connection holds (tpserve/server/lane_stream.py)."""
        self.lane_host = lane_host
        self.max_unread_tokens = max_unread_tokens
        self.tokenizer = tokenizer
        self.info = info
        self.vision = vision
        self.metrics = metrics if metrics is not None else ServingMetrics()
        self.limits = Limits(
            context_size=info.context_size,
            vocab_size=tokenizer.vocab_size,
            room=info.room if info.room < info.context_size else None,
            vision=info.vision,
            default_max_tokens=info.default_max_tokens,
            max_images=info.max_images,
            max_image_bytes=info.max_image_bytes,
            max_image_pixels=info.max_image_pixels,
            max_video_bytes=info.max_video_bytes,
            max_video_seconds=info.max_video_seconds,
            max_video_frames=info.max_video_frames,
            max_video_pixels=info.max_video_pixels,
            max_logprobs=info.max_logprobs,
            max_prompt_bytes=max_prompt_bytes(info.context_size, tokenizer.longest_token_bytes),
        )
        self.grammars = Grammars(tokenizer.backend_json, tokenizer.vocab_size, tokenizer.eos_ids)
        self._stopping = False

    @property
    def serving(self) -> bool:
        """False once the engine is broken or the server is stopping (health reports this)."""
        return not (self.lane_host.broken or self._stopping)

    def begin_stopping(self) -> None:
        """From now on every new request is refused with UNAVAILABLE "the server is stopping"."""
        self._stopping = True

    def submit(self, request) -> Stream:
        """A checked, tokenized GenerateRequest on the lane host; RequestRefused when it will not run
        (counted in the metrics)."""
        return self.submit_sized(request).stream

    def submit_sized(self, request) -> Submitted:
        """submit, with the prompt's token ids (truncated, where asked) and the reply's budget."""
        try:
            submitted = self._submit(request)
        except RequestRefused as refusal:
            self.metrics.count_outcome(refusal.code.name.lower())
            raise
        finally:
            if (
                request.ByteSize() >= LARGE_REQUEST_BYTES
            ):  # memory back to its baseline (tpserve/server/heap.py)
                give_back_free_memory()
        submitted.stream.bound_unread(self.max_unread_tokens)
        submitted.stream.on_overflow(self._count_overflow)
        return submitted

    @property
    def unread_overflow(self) -> str:
        """What a client whose stream bound_unread cancelled is told."""
        return UNREAD_OVERFLOW.format(limit=self.max_unread_tokens)

    def _count_overflow(self) -> None:
        # Counted as the client's going away once its API gives up on the stream, like a disconnect.
        log.warning(
            "cancelled a reply whose client stopped reading (max_unread_tokens %d)", self.max_unread_tokens
        )

    def _submit(self, request) -> Submitted:
        # A broken engine is the news a client can act on (the server needs a restart), so it
        # comes first, also while the broken daemon is on its way out.
        if self.lane_host.broken:
            raise RequestRefused(grpc.StatusCode.UNAVAILABLE, ENGINE_BROKEN)
        if self._stopping:
            raise RequestRefused(grpc.StatusCode.UNAVAILABLE, STOPPING)
        prompt_ids, boundaries, placed = self._prompt(request)
        max_tokens = max_tokens_for(request, len(prompt_ids), self.limits)
        grammar = self.grammars.compile(request.constraint) if request.HasField("constraint") else None
        check_min_tokens(request, max_tokens)
        images = ()
        if placed:  # only now, once nothing cheaper refuses the request, does the tower run
            media, wheres = _media_parts(request.messages)
            images = self.vision.read(media, placed, wheres, self.limits)
        job = GenerationRequest(
            prompt_ids=tuple(prompt_ids),
            max_tokens=max_tokens,
            sampling=sampling_from(
                request, secrets.randbits(63), self.info.sampling_defaults, self.limits.vocab_size
            ),
            stop=tuple(request.stop),
            ignore_eos=request.ignore_eos,
            background=request.background,
            keep_boundaries=boundaries,
            images=images,
            grammar=grammar,
            stop_token_ids=tuple(request.stop_token_ids),
            min_tokens=request.min_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            prompt_logprobs=(
                logprobs_count(request.prompt_logprobs, self.limits.vocab_size)
                if request.HasField("prompt_logprobs")
                else -1
            ),
            skip_special_tokens=not request.keep_special_tokens,
        )
        try:
            return Submitted(self.lane_host.submit(job), job.prompt_ids, max_tokens)
        except QueueFull as error:
            raise RequestRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, QUEUE_FULL) from error
        except HostUnavailable as error:
            message = ENGINE_BROKEN if self.lane_host.broken else STOPPING
            raise RequestRefused(grpc.StatusCode.UNAVAILABLE, message) from error
        except ValueError as error:
            # The host's own checks; validation refuses all of these first unless the limits given
            # here disagree with the backend's.
            raise RequestRefused(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from error

    def prompt_ids(self, request) -> list[int]:
        """A checked GenerateRequest's prompt as the engine would run it (templated, tokenized and
        truncated), for callers that submit its continuations themselves (tpserve/server/beam_steps.py)."""
        prompt_ids, _, placed = self._prompt(request)
        if placed:
            raise invalid_argument("use_beam_search takes no image inputs")
        return prompt_ids

    def _prompt(self, request) -> tuple[list[int], tuple[int, ...], list]:
        """Checks the request; its prompt's token ids, the chat boundaries kept in the prompt cache
        and where each image's positions start (the vision input's PlacedParts, for its read)."""
        kind = check_generate(request, self.limits)
        boundaries: tuple[int, ...] = ()
        placed: list = []
        if kind == "prompt":
            prompt_ids = self.tokenizer.encode(request.prompt)
        elif kind == "messages":
            prompt_ids, placed = self._encode_chat(request.messages, **template_inputs(request))
            boundaries = self.chat_boundaries(request.messages, prompt_ids)
        else:
            prompt_ids = list(request.prompt_token_ids)
        if request.HasField("truncate_prompt_tokens"):
            cut = truncated(request, prompt_ids, self.limits)
            if placed and len(cut) < len(prompt_ids):
                raise invalid_argument("truncate_prompt_tokens cannot cut a prompt with image inputs")
            # A kept chat boundary moves with the prompt's dropped head (or goes, if cut off).
            dropped = 0 if request.truncate_right else len(prompt_ids) - len(cut)
            boundaries = tuple(b - dropped for b in boundaries if 0 < b - dropped < len(cut))
            prompt_ids = cut
        return prompt_ids, boundaries, placed

    def broke_mid_reply(self, event: Finished) -> RequestRefused | None:
        """The refusal a stream that ended in ERROR because the whole engine broke fails with (not
        this request's fault: clients retry UNAVAILABLE elsewhere); None for any other ending."""
        if event.reason == ERROR and self.lane_host.broken:
            self.metrics.count_outcome(grpc.StatusCode.UNAVAILABLE.name.lower())
            return RequestRefused(grpc.StatusCode.UNAVAILABLE, f"{ENGINE_BROKE_MID_REPLY} ({event.error})")
        return None

    def count_finished(self, event: Finished) -> None:
        usage = event.usage
        self.metrics.count_outcome(event.reason)
        self.metrics.count_usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        self.metrics.observe_finished(
            event.reason, usage.prompt_tokens, usage.completion_tokens, usage.total_s
        )
        if usage.time_to_first_token_s is not None:
            self.metrics.observe_first_token(usage.time_to_first_token_s)

    def count_delta(self, event: TokenDelta, last_delta_at: float | None) -> float:
        """Observes the time per token since the stream's previous delta (the first delta's wait is
        time to first token, counted at the end); returns now, for the next call."""
        now = time.monotonic()
        if event.token_ids and last_delta_at is not None:
            self.metrics.observe_inter_token((now - last_delta_at) / len(event.token_ids))
        return now

    def count_gone(self) -> None:
        """A client went away before its stream's Finished reached it."""
        self.metrics.count_outcome(CANCELLED)

    def tokenize(self, request) -> list[int]:
        """A TokenizeRequest's token ids, as Generate would see them."""
        try:
            return self._tokenize(request)
        finally:
            if request.ByteSize() >= LARGE_REQUEST_BYTES:
                give_back_free_memory()

    def _tokenize(self, request) -> list[int]:
        if tokenize_kind(request) == "text":
            check_prompt_size([request.text], "text", self.limits)
            special = not request.HasField("add_special_tokens") or request.add_special_tokens
            return self.tokenizer.encode(request.text, add_bos=None if special else False)
        check_prompt_size(message_texts(request.messages), "messages' text", self.limits)
        check_messages(request.messages, self.limits)
        add_bos = request.add_special_tokens  # unset: false for a chat, as vLLM's /tokenize has it
        return self._encode_chat(request.messages, **template_inputs(request), add_bos=add_bos)[0]

    def chat_boundaries(self, messages, prompt_ids: list[int]) -> tuple[int, ...]:
        """Where later chats are likely to share this one's prefix: the end of a leading system
        message, and the start of the last message (the history before it). Offsets only where the
        template renders that part of the chat as a prefix of the whole."""
        cuts = {len(messages) - 1}
        if messages[0].role == "system":
            cuts.add(1)
        boundaries = []
        for cut in sorted(c for c in cuts if 0 < c < len(messages)):
            try:
                head = self.encode_chat(messages[:cut], add_generation_prompt=False)
            except RequestRefused:
                continue
            if head and prompt_ids[: len(head)] == head:
                boundaries.append(len(head))
        return tuple(boundaries)

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        """Checked messages -> token ids through the model's chat template (each image as its
        tokens_per_image image tokens)."""
        return self._encode_chat(messages, add_generation_prompt)[0]

    def _encode_chat(
        self,
        messages,
        add_generation_prompt: bool = True,
        *,
        tools=None,
        template_kwargs=None,
        continue_final_message: bool = False,
        add_bos: bool = False,
    ) -> tuple[list[int], list]:
        """The token ids and where each image's positions start (the vision input's PlacedParts)."""
        num_images = sum(part.HasField("media") for message in messages for part in message.parts)
        if num_images and self.vision is None:
            # Validation let media through (--vision), but this server's model reads none.
            raise RequestRefused(grpc.StatusCode.UNIMPLEMENTED, NO_MEDIA_MODEL)
        chat = []
        for message in messages:
            if self.vision is not None:  # vision templates read content as a list of typed parts
                parts = message.parts if message.parts else [serving_pb2.ContentPart(text=message.content)]
                content = [_typed_part(part) for part in parts]
            else:
                content = "".join(part.text for part in message.parts) if message.parts else message.content
            chat.append({"role": message.role, "content": content, **tool_fields(message)})
        try:
            ids = self.tokenizer.encode_chat(
                chat,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                template_kwargs=template_kwargs,
                continue_final_message=continue_final_message,
                add_bos=add_bos,
            )
        except UserError as error:  # the template refused the conversation, or there is none
            raise RequestRefused(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from error
        if self.vision is None:
            return ids, []
        return self.vision.expand(ids, num_images, *_media_parts(messages), self.limits)


def _typed_part(part) -> dict:
    """A content part as transformers' multimodal chat templates read it."""
    if not part.HasField("media"):
        return {"type": "text", "text": part.text}
    return {"type": "video" if is_video(part.media) else "image"}


def _media_parts(messages) -> tuple[list, list[str]]:
    """Every media part in prompt order, and where each sits in the request (for refusals)."""
    media, wheres = [], []
    for index, message in enumerate(messages):
        for part_index, part in enumerate(message.parts):
            if part.HasField("media"):
                media.append(part.media)
                wheres.append(f"messages[{index}].parts[{part_index}]")
    return media, wheres
