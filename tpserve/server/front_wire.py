"""What rank 0's engine process and its front process (tpserve/server/front_process.py) say to each other.

Frozen dataclasses, sent whole over one local socket (multiprocessing.connection: a Unix socket
pair, pickled): both ends are the same build started together on one host, never two ranks (the
ranks' wire, tpserve/ranks/wire.py, has its own encoding). Requests travel as token ids and sampling
params; what the engine sends back is bare tokens, one StepOut per scheduling step for every
stream with news (tpserve/server/front_link.py), the front makes the text.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpserve.server.requests import Finished, GenerationRequest, Prefilled, TokenLogprob

# ---- the engine process -> the front ----


@dataclass(frozen=True)
class FrontSpec:
    """The first message: everything the front needs to serve (config: a ServeConfig)."""

    config: object
    info: object  # ServingInfo
    model_dir: str
    eos_ids: frozenset[int]  # as the lane host ends replies: the tokenizer's and the model config's


@dataclass(frozen=True)
class StreamOut:
    """One stream's news in one step, in order: its Prefilled (cached tokens), tokens, Finished."""

    stream_id: int
    # Not None: the prompt is in the KV cache (sent once), with its log probabilities when asked.
    prefilled: Prefilled | None
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob | None, ...]  # one per token id, or () when none were asked
    finished: Finished | None


@dataclass(frozen=True)
class StepOut:
    """What one scheduling step (or the quiet time between steps) produced, for every stream."""

    streams: tuple[StreamOut, ...]
    broken: str | None  # the engine's broken reason, latched before any stream it ended arrives


@dataclass(frozen=True)
class SubmitAnswer:
    """The lane host's answer to a Submit: refusal None (queued), or how it refused and why."""

    stream_id: int
    refusal: str | None  # QUEUE_FULL, UNAVAILABLE or INVALID
    message: str
    broken: str | None


QUEUE_FULL = "queue_full"
UNAVAILABLE = "unavailable"
INVALID = "invalid"


@dataclass(frozen=True)
class Answer:
    """The answer to an Ask: a HostStats or a BlockStats."""

    ask_id: int
    value: object


@dataclass(frozen=True)
class BeginStopping:
    """The stop signal came: refuse new requests ("the server is stopping"), live streams go on."""


@dataclass(frozen=True)
class StopApis:
    """The drain is over: give live calls grace_s for their last messages, close the ports, exit."""

    grace_s: float


# ---- the front -> the engine process ----


@dataclass(frozen=True)
class Submit:
    """A checked, tokenized request; its grammar as llguidance text (the engine keeps the matchers)."""

    stream_id: int
    request: GenerationRequest  # grammar None: grammar_text carries it
    grammar_text: str | None


@dataclass(frozen=True)
class Cancel:
    """End this stream (the client went away, or a stop string matched in the front)."""

    stream_id: int


@dataclass(frozen=True)
class Ask:
    what: str  # STATS or BLOCK_STATS
    ask_id: int


STATS = "stats"
BLOCK_STATS = "block_stats"


@dataclass(frozen=True)
class Ready:
    """Both APIs listen (http_port None: HTTP off)."""

    port: int
    http_port: int | None


@dataclass(frozen=True)
class StartFailed:
    """The front could not start its APIs (a port taken, say); rank 0 stops the followers."""

    error: str
    user_error: bool  # the user's to fix (rank 0 exits 2 with it, as a UserError)


@dataclass(frozen=True)
class ApisStopped:
    """The front closed its ports after StopApis and is exiting."""
