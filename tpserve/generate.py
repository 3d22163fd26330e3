"""`tpserve generate`: one prompt, one reply, offline, on tp ranks started here (no server)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tpserve.default_model import default_model_dir
from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks.device import DEVICE_CHOICES
from tpserve.ranks.errors import UserError
from tpserve.ranks.leader import Leader
from tpserve.ranks.local_ranks import local_rank0
from tpserve.ranks.logs import setup_logging
from tpserve.ranks.model_config import load_model_config
from tpserve.ranks.settings import DTYPE_CHOICES, QUANTIZE_CHOICES, EngineSettings
from tpserve.server.backend import DecodeItem, PrefillItem
from tpserve.server.tokenizer import Tokenizer

LANE = 0


@dataclass(frozen=True)
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str


@contextmanager
def single_stream_leader(settings: EngineSettings) -> Iterator[Leader]:
    """Rank 0's leader with one lane, followers as child processes; stopped on exit."""
    with local_rank0(settings) as (runtime, _):
        leader = Leader(
            runtime.engine,
            runtime.channel,
            num_lanes=1,
            context_size=settings.context_size,
            max_prefill_tokens=settings.max_prefill_tokens,
            batches_prompts=False,
        )
        try:
            yield leader
        finally:
            leader.stop()  # Stop to the followers, unless the engine broke


def open_single_lane(leader: Leader, lane: int, num_tokens: int) -> bool:
    """Open `lane`, a leader's only stream, with blocks for `num_tokens` positions (the pool's first
    blocks: no other lane holds any). False when the room is too small."""
    num_blocks = -(-num_tokens // leader.block_size)
    if num_blocks > leader.num_blocks:
        return False
    leader.open(lane, tuple(range(num_blocks)), 0)
    return True


def generate_tokens(
    settings: EngineSettings, jobs: list[tuple[list[int], SamplingParams]], max_tokens: int, eos_ids
) -> list[Generation]:
    """Start settings.tp_size ranks (followers as child processes), run each job alone, stop them."""
    with single_stream_leader(settings) as leader:
        return [_one_stream(leader, ids, max_tokens, sampling, eos_ids) for ids, sampling in jobs]


def _one_stream(leader: Leader, prompt_ids, max_tokens, sampling, eos_ids) -> Generation:
    if not open_single_lane(leader, LANE, len(prompt_ids) + max_tokens):
        raise UserError(f"no room for {len(prompt_ids) + max_tokens} tokens (room {leader.room})")
    chunk = leader.max_prefill_tokens
    token = None
    for start in range(0, len(prompt_ids), chunk):
        part = tuple(prompt_ids[start : start + chunk])
        last = start + chunk >= len(prompt_ids)
        token = leader.prefill(PrefillItem(LANE, start, part, last, sampling))
    out, position = [token], len(prompt_ids)
    while len(out) < max_tokens and out[-1] not in eos_ids:
        out.append(leader.decode([DecodeItem(LANE, position, out[-1], sampling)])[0])
        position += 1
    leader.close(LANE)
    reason = "stop" if out[-1] in eos_ids else "length"
    return Generation(list(prompt_ids), out, reason)


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate one reply offline on tp ranks started here")
    parser.add_argument("--model", default=None, help="model directory (default: the prepared default model)")
    parser.add_argument("--tp", type=int, choices=(1, 2), default=2)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw prompt text")
    source.add_argument("--chat", help="one user message, rendered with the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="auto: the device's")
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none", help="the weights' format")
    parser.add_argument("--no-batch-invariant", action="store_true", help="use the BLAS's fastest kernels")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    setup_logging(0)
    model_dir = args.model or str(default_model_dir())
    config = load_model_config(model_dir)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    if args.chat is not None:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.chat}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise UserError("the prompt is empty")
    if args.max_tokens < 1:
        raise UserError("--max-tokens must be at least 1")
    context = config.max_position_embeddings
    if len(prompt_ids) + args.max_tokens > context:
        raise UserError(
            f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({args.max_tokens}) exceeds the context of {context} tokens"
        )
    settings = EngineSettings(
        model_dir=model_dir,
        device=args.device,
        dtype=args.dtype,
        quantize=args.quantize,
        tp_size=args.tp,
        num_lanes=1,
        context_size=len(prompt_ids) + args.max_tokens,
        batch_invariant=False if args.no_batch_invariant else None,  # None: the device's default
        prefix_caching=False,  # one prompt: nothing to keep for a later one
    )
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.min_p, args.seed)
    (result,) = generate_tokens(settings, [(prompt_ids, sampling)], args.max_tokens, tokenizer.eos_ids)
    text = tokenizer.decode(result.token_ids)
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_ids": result.prompt_ids,
                    "token_ids": result.token_ids,
                    "text": text,
                    "finish_reason": result.finish_reason,
                }
            )
        )
    else:
        sys.stdout.write(text + "\n")
    return 0
