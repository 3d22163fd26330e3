"""Rank 0's daemon: the leader, the lane host, the gRPC server and the HTTP API, from start to exit code.

The APIs run in the front process (tpserve/server/front_process.py, through tpserve/server/front_link.py) when
front_process is on (auto: 4+ CPU cores and no vision, uses_front_process), else here
(tpserve/server/apis.py); either way they begin stopping, drain and stop in the same order.

Exit codes: 0 after a graceful stop (SIGTERM or SIGINT: admission stops, live streams get the
grace period, the rest end cancelled, the followers get Stop); 1 when the engine broke or a
follower was lost (every live stream failed with UNAVAILABLE first), so a supervisor restarts both
ranks, and 1 when a stop took longer than grace_s + STOP_MARGIN_S (a follower did not answer).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import signal
import threading
from pathlib import Path

from tpserve.ranks.deadline import leave_after
from tpserve.ranks.errors import StartupError
from tpserve.ranks.gemma3_vision_config import Gemma3VisionConfig
from tpserve.ranks.glm4v_vision_config import Glm4vVisionConfig
from tpserve.ranks.idefics3_config import Idefics3VisionConfig
from tpserve.ranks.leader import Leader
from tpserve.ranks.loader import DTYPES
from tpserve.ranks.qwen3_vision_config import Qwen3VisionConfig
from tpserve.ranks.qwen_vision_config import QwenVisionConfig
from tpserve.ranks.settings import EngineSettings
from tpserve.ranks.startup import RankRuntime, shutdown
from tpserve.server.apis import LocalApis
from tpserve.server.backend import BackendBroken
from tpserve.server.config import ServeConfig
from tpserve.server.front_link import FrontLink
from tpserve.server.front_wire import FrontSpec
from tpserve.server.gemma3_input import Gemma3VisionInput
from tpserve.server.generation_defaults import generation_defaults, openai_temperature
from tpserve.server.grammar import Grammars
from tpserve.server.heap import return_large_frees_to_the_system
from tpserve.server.idefics3_input import Idefics3VisionInput
from tpserve.server.lane_host import LaneHost
from tpserve.server.qwen_vision_input import QwenVisionInput
from tpserve.server.serving_info import ServingInfo
from tpserve.server.tokenizer import Tokenizer
from tpserve.server.vision_input import VisionInput
from tpserve.server.wiring import build_lane_host, eos_ids_of

log = logging.getLogger(__name__)

BROKEN_FLUSH_S = 2.0  # a broken daemon answers "the engine is broken" this long before it exits
FLUSH_S = 1.0  # for the last messages of ended streams to reach their clients
STOP_MARGIN_S = 10.0  # past grace_s, for the last messages and Stop to the followers
FRONT_MIN_CPUS = 4  # front_process auto: the engine loop and the front each with cores of their own


def serve_rank0(config: ServeConfig, runtime: RankRuntime, settings: EngineSettings) -> int:
    stop = threading.Event()
    broken = threading.Event()
    return_large_frees_to_the_system()
    tokenizer = Tokenizer.from_model_dir(settings.model_dir, chat_template=config.chat_template or None)
    info = _serving_info(config, runtime, settings)
    front = None
    if uses_front_process(config):
        # The APIs, tokenizing and the text in a process of their own (tpserve/server/front_process.py);
        # a front that goes away fails the lane host, so both ranks exit 1.
        spec = FrontSpec(config, info, settings.model_dir, eos_ids_of(runtime, tokenizer))
        grammars = Grammars(tokenizer.backend_json, tokenizer.vocab_size, tokenizer.eos_ids)
        front = FrontLink(spec, grammars, on_lost=lambda reason: host.fail(reason))
    host, leader = build_lane_host(
        runtime,
        tokenizer,
        queue_size=config.queue_size,
        record_dir=config.record,
        on_broken=lambda reason: broken.set(),
        makes_text=front is None,
        on_step=front.step_done if front is not None else None,
    )
    if front is not None:
        front.attach(host)
        apis = front
    else:
        apis = LocalApis(config, host, tokenizer, info, _vision_input(config, runtime, settings, tokenizer))
    if not config.api_key and not _is_loopback(config.host):
        log.warning("serving %s with no api_key: anyone who can reach it may use it", config.host)
    if config.api_key and config.metrics_port and not config.metrics_need_key:
        log.warning(
            "the metrics port has no key check (metrics_need_key adds it); /metrics on the HTTP port needs the key"
        )
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    host.start()
    try:
        http_port, port = apis.start()
    except BaseException:
        # A port already taken, say: the followers hear Stop now instead of noticing, after
        # leader_dead_after_s, that rank 0 went away.
        _stop_unserved(host, leader, apis, runtime)
        raise
    _log_serving(config, info, port, http_port, front)
    _watch_followers(host, runtime, stop, broken)
    if broken.is_set():
        code = _exit_broken(stop, apis)
        if front is not None and front.lost is not None and runtime.liveness is not None:
            runtime.liveness.sever()  # the followers are well: they exit 1 now, not at their timeout
        return code
    return _stop_gracefully(config, host, leader, apis, runtime, broken)


def uses_front_process(config: ServeConfig, cpu_count: int | None = None) -> bool:
    """front_process auto: on where the host has FRONT_MIN_CPUS cores or more, never with --vision
    (the front reads no images yet). On fewer, the front's interpreter takes the core rank 0's
    engine loop needs: bench.front_gap on 2 cores measured a stream's gap 0.74x worse with it."""
    if config.front_process is not None:
        return config.front_process
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return cores >= FRONT_MIN_CPUS and not config.vision


def _serving_info(config: ServeConfig, runtime: RankRuntime, settings: EngineSettings) -> ServingInfo:
    return ServingInfo(
        model_name=(config.served_model_name or (Path(settings.model_dir).name,))[0],
        model_aliases=config.served_model_name[1:],
        tp_size=config.tp,
        num_lanes=config.lanes,
        context_size=config.context,
        room=runtime.kv_budget.kv_tokens,
        vision=config.vision,
        default_max_tokens=config.default_max_tokens,
        sampling_defaults=generation_defaults(settings.model_dir),
        openai_temperature=openai_temperature(settings.model_dir, config.default_temperature),
        max_images=config.max_images,
        max_image_bytes=config.max_image_bytes,
        max_image_pixels=config.max_image_pixels,
        max_video_bytes=config.max_video_bytes,
        max_video_seconds=config.max_video_seconds,
        max_video_frames=config.max_video_frames,
        max_video_pixels=config.max_video_pixels,
        max_logprobs=config.max_logprobs,
    )


def _vision_input(
    config: ServeConfig, runtime: RankRuntime, settings: EngineSettings, tokenizer: Tokenizer
) -> VisionInput | QwenVisionInput | Idefics3VisionInput | Gemma3VisionInput | None:
    """The tower and projector, loaded here on rank 0 only (see tpserve/ranks/vision.py); None without
    vision."""
    if not config.vision:
        return None
    # A Qwen-VL's tower and its images' sizes (tpserve/server/qwen_vision_input.py), an Idefics3's tiles
    # (tpserve/server/idefics3_input.py), Gemma 3's (tpserve/server/gemma3_input.py), or LLaVA's.
    args = (
        settings.model_dir,
        runtime.config,
        tokenizer.token_text(runtime.config.vision.image_token_id),
        DTYPES[settings.dtype],
        runtime.device,
    )
    encode_text = functools.partial(tokenizer.encode, add_bos=False)
    if isinstance(runtime.config.vision, (QwenVisionConfig, Qwen3VisionConfig, Glm4vVisionConfig)):
        return QwenVisionInput.from_model_dir(*args, encode_text=encode_text)
    if isinstance(runtime.config.vision, Idefics3VisionConfig):
        return Idefics3VisionInput.from_model_dir(*args, encode_text=encode_text)
    if isinstance(runtime.config.vision, Gemma3VisionConfig):
        # an image's tokens go in one pass (they see each other): a pass must hold them
        if settings.max_prefill_tokens < runtime.config.vision.tokens_per_image:
            raise StartupError(
                f"--max-prefill-tokens {settings.max_prefill_tokens} is less than an image's "
                f"{runtime.config.vision.tokens_per_image} tokens, which go in one pass"
            )
        decode_text = functools.partial(tokenizer.decode, skip_special_tokens=False)
        return Gemma3VisionInput.from_model_dir(*args, encode_text=encode_text, decode_text=decode_text)
    return VisionInput.from_model_dir(*args)


def _log_serving(
    config: ServeConfig, info: ServingInfo, port: int, http_port: int | None, front: FrontLink | None
) -> None:
    log.info(
        "serving %s on %s:%d, HTTP %s (tp=%d, %d lanes, room %d tokens, APIs %s)",
        info.model_name,
        config.host,
        port,
        "off" if http_port is None else f"port {http_port}",
        config.tp,
        config.lanes,
        info.room,
        "in this process" if front is None else f"in front process {front.pid}",
    )


def _watch_followers(
    host: LaneHost, runtime: RankRuntime, stop: threading.Event, broken: threading.Event
) -> None:
    """Until the stop signal or a broken engine: a lost follower fails the lane host."""
    while not (stop.wait(0.2) or broken.is_set()):
        lost = lost_follower(runtime)
        if lost is not None:
            host.fail(lost)  # ends every stream now; its on_broken sets `broken`


def _exit_broken(stop: threading.Event, apis: LocalApis | FrontLink) -> int:
    log.error("the engine broke; ending every stream and exiting so a supervisor restarts both ranks")
    # The live streams already failed with UNAVAILABLE; for a moment longer new requests hear why
    # (the engine is broken) instead of finding the port closed. The lane host is not joined: its
    # thread may sit in a collective with a lost follower until the timeout.
    stop.wait(BROKEN_FLUSH_S)
    apis.stop(grace_s=FLUSH_S)
    return 1


def _stop_gracefully(
    config: ServeConfig,
    host: LaneHost,
    leader: Leader,
    apis: LocalApis | FrontLink,
    runtime: RankRuntime,
    broken: threading.Event,
) -> int:
    """After the stop signal: drain, stop both APIs, Stop to the followers; the exit code."""
    log.info("stopping: admission closed, live streams have %.0f s to finish", config.grace_s)
    deadline_s = config.grace_s + STOP_MARGIN_S
    leave_after(
        deadline_s, f"did not stop within {deadline_s:.0f} s of the stop signal (a follower does not answer)"
    )
    # Admission closes first with a clear refusal; the gRPC server stays up while the lane host
    # drains, so live streams keep flowing, then it gets a moment to send their last messages.
    apis.begin_stopping()
    stopped = host.stop(grace_s=config.grace_s)
    apis.stop(grace_s=FLUSH_S)
    if not stopped:
        log.error("the followers cannot be told to stop: a pass with them never ended")
        return 1
    if broken.is_set() or lost_follower(runtime) is not None:
        return 1
    try:
        leader.stop()
    except BackendBroken as error:  # a follower went away during the drain
        log.error("could not tell the followers to stop: %s", error)
        return 1
    shutdown(runtime)
    log.info("stopped")
    return 0


def lost_follower(runtime: RankRuntime) -> str | None:
    """Why a follower is gone, once rank 0 knows: silent on the liveness link, or (idle) no longer
    taking the channel's heartbeat."""
    hub = runtime.liveness  # rank 0's end of the liveness link: a LivenessHub (None at tp=1)
    return runtime.channel.lost_follower or (hub.lost if hub is not None else None)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def _stop_unserved(host: LaneHost, leader: Leader, apis: LocalApis | FrontLink, runtime: RankRuntime) -> None:
    apis.stop(grace_s=0)
    host.stop(grace_s=0)
    try:
        leader.stop()
    except BackendBroken as error:
        log.error("could not tell the followers to stop: %s", error)
        return
    shutdown(runtime)  # BYE on the liveness link: the followers' Stop is not a loss
