"""The daemon's configuration: YAML plus command-line flags, validated once into frozen values.

Every key has one name, used both in YAML (`context: 4096`) and as a flag (`--context 4096`).
Flags override the YAML; an unknown key or a bad value is refused by name before anything starts.
The API key alone may also come from the environment (TPSERVE_API_KEY, between the YAML and the
flag), so a secret need not sit in a file or on a command line that `ps` shows.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from tpserve.ranks.collectives_choice import CHOICES
from tpserve.ranks.device import DEVICE_CHOICES
from tpserve.ranks.errors import UserError
from tpserve.ranks.settings import DTYPE_CHOICES, MAX_DRAFT_TOKENS, QUANTIZE_CHOICES, EngineSettings
from tpserve.server.api_key import API_KEY_ENV, key_problem
from tpserve.server.chat_reply import REASONING_PARSERS
from tpserve.server.media_hosts import domain_problem
from tpserve.server.tls import tls_problem
from tpserve.server.tool_calls import PARSERS as TOOL_CALL_PARSERS


class ConfigError(UserError):
    pass


# Keys an older config may still hold, and what took their place.
RETIRED = {
    "cache_budget_bytes": "the prompt cache now shares the KV pool's blocks, with no budget of its "
    "own; prefix_caching: true or false turns it on or off",
}


# The engine's defaults are the daemon's: every engine key below takes its default from here.
_ENGINE = EngineSettings(model_dir="")
# The engine settings whose key (a flag, a YAML key) is shorter than the code's name for it; every
# other engine setting has one name in both.
ENGINE_NAMES = {"tp": "tp_size", "lanes": "num_lanes", "context": "context_size"}


@dataclass(frozen=True)
class ServeConfig:
    model: str = ""  # empty: the prepared default model
    # The engine's settings (tpserve/ranks/settings.py says what each means).
    device: str = _ENGINE.device
    dtype: str = _ENGINE.dtype
    kv_dtype: str = _ENGINE.kv_dtype
    quantize: str = _ENGINE.quantize  # README, "Quantized weights"
    tp: int = _ENGINE.tp_size
    lanes: int = _ENGINE.num_lanes
    context: int = _ENGINE.context_size
    kv_budget_bytes: tuple[int, ...] = _ENGINE.kv_budget_bytes
    prefix_caching: bool = _ENGINE.prefix_caching
    kv_block_size: int = _ENGINE.kv_block_size
    max_prefill_tokens: int = _ENGINE.max_prefill_tokens
    step_tokens: int | None = _ENGINE.step_tokens  # None: auto
    batch_prefill: bool = _ENGINE.batch_prefill
    batch_invariant: bool | None = _ENGINE.batch_invariant  # None: auto
    cpu_collectives: str = _ENGINE.cpu_collectives
    draft_tokens: int | None = _ENGINE.draft_tokens  # None: auto
    threads_per_rank: int = _ENGINE.threads_per_rank
    init_timeout_s: float = _ENGINE.init_timeout_s
    collective_timeout_s: float = _ENGINE.collective_timeout_s
    leader_dead_after_s: float = _ENGINE.leader_dead_after_s
    interface: str = _ENGINE.interface
    refuse_token_on_rank: tuple[int, ...] = _ENGINE.refuse_token_on_rank  # a fault drill for tests
    # The serving side's own.
    queue_size: int = 64
    default_max_tokens: int | None = None  # None (auto): the context the prompt leaves, as vLLM
    # An unset temperature over the OpenAI HTTP API; None (auto): the model's generation_config.json,
    # else 1.0, as vLLM. gRPC's unset is the model's, else greedy, whatever this says.
    default_temperature: float | None = None
    # The likeliest tokens a request may ask per position (logprobs, top_logprobs, prompt_logprobs),
    # vLLM's --max-logprobs; -1: any number, and a request's -1 (the whole vocabulary) with it.
    max_logprobs: int = 20
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 0  # 0: no metrics endpoint
    metrics_need_key: bool = False  # the metrics port needs api_key too (as /metrics on the HTTP port does)
    http_port: int = 8000  # the OpenAI-compatible HTTP API, on `host` beside gRPC; 0: none
    # The HTTP API's connections (tpserve/server/http_connections.py): a request's head and its body must
    # each arrive within their timeout, an idle kept-alive connection closes, and past
    # http_max_connections open ones a new connection gets 503.
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 30.0
    http_keep_alive_s: float = 5.0
    http_max_connections: int = 1024
    # A connection whose client reads nothing while a reply waits to be written is closed after
    # this (tpserve/server/http_connections.py).
    http_write_stall_s: float = 30.0
    # A gRPC connection that has not finished its HTTP/2 handshake (the preface and the client's
    # SETTINGS) within this is closed, as an HTTP request head's timeout closes a silent one.
    grpc_handshake_timeout_s: float = 10.0
    # A gRPC connection with calls open is pinged after this long without traffic and closed when
    # the ping goes unanswered for as long again (a vanished client's calls end, freeing their places).
    grpc_keepalive_s: float = 60.0
    # A reply is cancelled once more tokens than this wait unread, beyond what its connection holds
    # (a client that stopped reading): gRPC ends the call RESOURCE_EXHAUSTED (tpserve/server/lane_stream.py).
    max_unread_tokens: int = 1024
    api_key: str = field(default="", repr=False)  # "": anyone may call; else Bearer KEY on both APIs
    vision: bool = False  # read image parts (a vision-language model only)
    max_images: int = 4  # with --vision: image and video parts per request
    max_image_bytes: int = 10 << 20  # with --vision: encoded bytes per image
    max_image_pixels: int = 4096 * 4096  # with --vision: width x height per image
    max_video_bytes: int = 10 << 20  # with --vision: encoded bytes per video
    max_video_seconds: float = 120.0  # with --vision: a video's duration
    max_video_frames: int = 3600  # with --vision: frames in a video's file, before sampling
    max_video_pixels: int = 1920 * 1080  # with --vision: width x height per video frame
    # With --vision: the hosts whose https image and video URLs both APIs fetch, each named
    # exactly (vLLM's --allowed-media-domains); empty: none, every remote URL refused
    # (tpserve/server/media_fetch.py). The byte limits above hold while the body is read.
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout_s: float = 10.0  # one URL's whole fetch: resolving, connecting, the body
    record: str = ""  # a directory: record every stream there
    # How chat replies are read over HTTP: "" reads the family from the chat template.
    tool_call_parser: str = ""  # hermes, llama3, mistral, harmony or none
    reasoning_parser: str = ""  # qwen3 (<think>), deepseek_r1 (opens inside one), gpt_oss (harmony) or none
    # The names the model answers to (the first is the one replies carry); empty: the model
    # directory's name. A request naming any other model is a 404.
    served_model_name: tuple[str, ...] = ()
    chat_template: str = ""  # a Jinja file used instead of the checkpoint's chat template
    # Origins browsers may call the HTTP API from (CORS); "*" any; empty: no CORS headers.
    cors_origins: tuple[str, ...] = ()
    # TLS on both APIs (tpserve/server/tls.py): PEM files of the certificate chain and its key; "": plain.
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    grace_s: float = 10.0
    # The APIs, tokenizing and detokenizing in a process of their own beside rank 0's engine loop
    # (tpserve/server/front_process.py), so they never hold its interpreter. None (auto): on where the host
    # has at least 4 CPU cores (rank 0's engine loop and the front each need cores of their own: on
    # 2 cores bench.front_gap measured a 0.74x worse gap with it on) and never with vision; true forces it (not with vision).
    front_process: bool | None = None
    rank: int = -1  # -1: from torchrun's environment (or 0 when run alone)
    master: str = ""  # HOST[:PORT] of rank 0, for one process per host

    def engine_settings(self, model_dir: str) -> EngineSettings:
        """The engine's settings, the one place they come from the config."""
        return EngineSettings(
            model_dir=model_dir, **{ENGINE_NAMES.get(key, key): getattr(self, key) for key in ENGINE_KEYS}
        )


# The config's keys that are engine settings (shape_dependent_on_rank is a drill tests set in code).
_ENGINE_FIELDS = {f.name for f in fields(EngineSettings)} - {"model_dir", "shape_dependent_on_rank"}
ENGINE_KEYS = tuple(f.name for f in fields(ServeConfig) if ENGINE_NAMES.get(f.name, f.name) in _ENGINE_FIELDS)


_CHOICES = {
    "device": DEVICE_CHOICES,
    "dtype": DTYPE_CHOICES,
    "kv_dtype": DTYPE_CHOICES,
    "quantize": QUANTIZE_CHOICES,
    "tp": (1, 2),
    "cpu_collectives": CHOICES,
    "tool_call_parser": ("", *TOOL_CALL_PARSERS, "none"),
    "reasoning_parser": ("", *REASONING_PARSERS, "none"),
}
_AT_MOST = {"draft_tokens": MAX_DRAFT_TOKENS}  # a decode product holds 16 rows: the token and 15 drafts
# Keys whose default (None) is "auto": the device's own default, decided when the rank knows it.
_AUTO_KINDS = {
    "batch_invariant": bool,
    "draft_tokens": int,
    "default_max_tokens": int,
    "default_temperature": float,
    "step_tokens": int,
    "front_process": bool,
}
_POSITIVE = {
    "lanes",
    "context",
    "max_prefill_tokens",
    "step_tokens",
    "kv_block_size",
    "queue_size",
    "default_max_tokens",
    "init_timeout_s",
    "collective_timeout_s",
    "leader_dead_after_s",
    "grace_s",
    "http_header_timeout_s",
    "http_body_timeout_s",
    "http_keep_alive_s",
    "http_max_connections",
    "http_write_stall_s",
    "grpc_handshake_timeout_s",
    "grpc_keepalive_s",
    "max_unread_tokens",
    "max_images",
    "max_image_bytes",
    "max_image_pixels",
    "max_video_bytes",
    "max_video_seconds",
    "max_video_frames",
    "max_video_pixels",
    "media_fetch_timeout_s",
}


def _field_types() -> dict[str, type]:
    return {f.name: _AUTO_KINDS.get(f.name, type(f.default)) for f in fields(ServeConfig)}


# Tuples of strings, not of numbers.
_NAME_LISTS = {"served_model_name", "cors_origins", "allowed_media_domains"}


def _coerce(key: str, value, kind: type, origin: str):
    if key in _AUTO_KINDS and str(value).lower() == "auto":
        return None
    try:
        if key in _NAME_LISTS:
            items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
            value = tuple(str(item) for item in items)
        elif kind is tuple:
            items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
            value = tuple(int(item) for item in items)
        elif kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                value = value.lower() in ("true", "1", "yes")
            elif not isinstance(value, bool):
                raise ValueError
        elif kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            value = int(value)
        elif kind is float:
            if isinstance(value, bool):
                raise ValueError
            value = float(value)
        else:
            value = str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{origin}: {key}: {value!r} is not a valid {kind.__name__}") from None
    if key in _CHOICES and value not in _CHOICES[key]:
        raise ConfigError(f"{origin}: {key}: {value!r} is not one of {', '.join(map(str, _CHOICES[key]))}")
    if key in _AT_MOST and not 0 <= value <= _AT_MOST[key]:
        raise ConfigError(f"{origin}: {key}: must be between 0 and {_AT_MOST[key]}, not {value!r}")
    if key in _POSITIVE and not value > 0:
        raise ConfigError(f"{origin}: {key}: must be positive, not {value!r}")
    return value


def load_config(
    path: str | Path | None, overrides: dict, environ: Mapping[str, str] | None = None
) -> ServeConfig:
    """Build the config from a YAML file (optional), the environment's API key (`environ`, default
    os.environ) and flag overrides (None values are unset)."""
    types = _field_types()
    values: dict = {}
    if path:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML ({error})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the config must be a mapping of keys to values")
        for key, value in raw.items():
            name = str(key).replace("-", "_")
            if name in RETIRED:
                raise ConfigError(f"{path}: {key!r} is gone: {RETIRED[name]}")
            if name not in types:
                raise ConfigError(f"{path}: unknown key {key!r} (known: {', '.join(sorted(types))})")
            values[name] = _coerce(name, value, types[name], str(path))
    environ = os.environ if environ is None else environ
    if environ.get(API_KEY_ENV):
        values["api_key"] = environ[API_KEY_ENV]
    for name, value in overrides.items():
        if value is not None:
            values[name] = _coerce(name, value, types[name], f"--{name.replace('_', '-')}")
    config = ServeConfig(**values)
    if config.rank >= config.tp:
        raise ConfigError(f"--rank: {config.rank} is not below tp ({config.tp})")
    if not 0 <= config.http_port <= 65535:
        raise ConfigError(f"http_port: {config.http_port} is not a port (0 turns the HTTP API off)")
    problem = key_problem(config.api_key)
    if problem is not None:
        raise ConfigError(f"api_key: {problem} (the key itself is not shown)")
    problem = tls_problem(config.ssl_certfile, config.ssl_keyfile)
    if problem is not None:
        raise ConfigError(problem)
    for entry in config.allowed_media_domains:
        problem = domain_problem(entry)
        if problem is not None:
            raise ConfigError(problem)
    if config.allowed_media_domains and not config.vision:
        raise ConfigError("allowed_media_domains: media URLs are fetched only with vision on")
    if config.front_process and config.vision:
        raise ConfigError(
            "front_process: the front process reads no images yet; with vision set it to auto or false"
        )
    if config.default_temperature is not None and not 0.0 <= config.default_temperature <= 100.0:
        raise ConfigError(f"default_temperature: must be from 0 to 100, not {config.default_temperature:g}")
    if config.max_logprobs < -1:
        raise ConfigError(f"max_logprobs: must be -1 (no limit) or more, not {config.max_logprobs}")
    if config.refuse_token_on_rank and len(config.refuse_token_on_rank) != 2:
        raise ConfigError("refuse_token_on_rank: give two numbers, a rank and a token id")
    return config


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config key, all defaulting to None (unset) so the YAML's value stands."""
    parser.add_argument("--config", help="YAML config file (flags override its keys)")
    for f in fields(ServeConfig):
        flag = "--" + f.name.replace("_", "-")
        if _field_types()[f.name] is bool:
            parser.add_argument(flag, nargs="?", const="true", default=None, metavar="BOOL")
        else:
            parser.add_argument(flag, default=None)


def overrides_from(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(ServeConfig)}
