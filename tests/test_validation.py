"""Request checks on their own: the edges that pass, the server defaults, and the room limit.

The wording of each refusal is frozen by tests/golden/errors/ (run against a live server in
test_grpc_api.py); these tests cover what those files cannot, the requests that must get through.
"""

from __future__ import annotations

import grpc
import pytest

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.server.validation import (
    Limits,
    RequestRefused,
    check_generate,
    max_tokens_for,
    sampling_from,
    tokenize_kind,
)
from tpserve.v1 import serving_pb2

LIMITS = Limits(context_size=100, vocab_size=50)


def refusal(request, limits=LIMITS) -> RequestRefused:
    with pytest.raises(RequestRefused) as raised:
        check_generate(request, limits)
    return raised.value


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.0},
        {"temperature": 100.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": 0},
        {"top_k": 10_000},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"seed": 2**63 - 1},
        {"max_tokens": 1},
        {"max_tokens": 100},
        {"stop": ["x" * 256] * 16},
    ],
)
def test_values_at_the_edges_pass(fields):
    assert check_generate(serving_pb2.GenerateRequest(prompt="hi", **fields), LIMITS) == "prompt"


def test_the_prompt_kind_is_whichever_one_is_set():
    assert check_generate(serving_pb2.GenerateRequest(prompt_token_ids=[0, 49]), LIMITS) == "prompt_token_ids"
    chat = serving_pb2.GenerateRequest(
        messages=[serving_pb2.ChatMessage(role=role) for role in ("system", "tool")]
    )
    assert check_generate(chat, LIMITS) == "messages"
    assert tokenize_kind(serving_pb2.TokenizeRequest(text="")) == "text"  # empty text tokenizes to nothing


def test_media_passes_on_a_vision_server_only():
    vision = Limits(context_size=100, vocab_size=50, vision=True)
    for mime_type in ("image/png", "video/mp4", "video/webm"):
        message = serving_pb2.ChatMessage(role="user")
        message.parts.add(media=serving_pb2.Media(mime_type=mime_type, data=b"\0"))
        request = serving_pb2.GenerateRequest(messages=[message])
        assert refusal(request).code == grpc.StatusCode.FAILED_PRECONDITION
        assert check_generate(request, vision) == "messages"


def test_videos_are_refused_by_type_url_and_bytes_before_any_decoding():
    vision = Limits(context_size=100, vocab_size=50, vision=True, max_video_bytes=8)
    for mime_type, data, words in (
        ("video/avi", b"\0", "is not one of video/mp4, video/webm"),
        ("video/*", b"https://example.com/cat.mp4", "this server fetches none"),
        ("video/mp4", bytes(9), "the most per video is 8 (max_video_bytes)"),
    ):
        message = serving_pb2.ChatMessage(role="user")
        message.parts.add(media=serving_pb2.Media(mime_type=mime_type, data=data))
        refused = refusal(serving_pb2.GenerateRequest(messages=[message]), vision)
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and words in refused.message


def test_unset_sampling_fields_take_the_defaults_and_a_fresh_seed():
    sampling = sampling_from(serving_pb2.GenerateRequest(prompt="hi"), fresh_seed=1234)
    assert sampling == SamplingParams(seed=1234)
    assert sampling.greedy
    request = serving_pb2.GenerateRequest(
        prompt="hi", temperature=0.5, top_p=0.5, top_k=3, min_p=0.25, seed=0
    )
    assert sampling_from(request, fresh_seed=1234) == SamplingParams(0.5, 0.5, 3, 0.25, 0)


def test_unset_max_tokens_is_the_default_capped_by_the_context():
    request = serving_pb2.GenerateRequest(prompt="hi")
    limits = Limits(context_size=1000, vocab_size=50, default_max_tokens=256)
    assert max_tokens_for(request, 10, limits) == 256
    assert max_tokens_for(request, 900, limits) == 100
    assert max_tokens_for(request, 999, limits) == 1


def test_unset_max_tokens_without_a_default_is_what_the_context_leaves():
    request = serving_pb2.GenerateRequest(prompt="hi")
    limits = Limits(context_size=1000, vocab_size=50)
    assert max_tokens_for(request, 10, limits) == 990


def test_a_prompt_that_exactly_fills_the_context_with_max_tokens_passes():
    request = serving_pb2.GenerateRequest(prompt="hi", max_tokens=40)
    assert max_tokens_for(request, 60, LIMITS) == 40
    with pytest.raises(
        RequestRefused, match=r"prompt \(61 tokens\) plus max_tokens \(40\) exceeds the context of 100"
    ):
        max_tokens_for(request, 61, LIMITS)


def test_less_room_than_the_context_shrinks_the_default_and_refuses_what_never_fits():
    limits = Limits(context_size=100, vocab_size=50, room=30)
    assert max_tokens_for(serving_pb2.GenerateRequest(prompt="hi"), 10, limits) == 20
    with pytest.raises(RequestRefused) as raised:
        max_tokens_for(serving_pb2.GenerateRequest(prompt="hi", max_tokens=25), 10, limits)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.message == (
        "prompt (10 tokens) plus max_tokens (25) needs more KV room than the engine holds (30 tokens)"
    )


def test_a_prompt_with_no_tokens_is_refused():
    with pytest.raises(RequestRefused, match="prompt has no tokens"):
        max_tokens_for(serving_pb2.GenerateRequest(prompt=" "), 0, LIMITS)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1 (got 0)"),
        ({"max_tokens": -5}, "max_tokens must be at least 1 (got -5)"),
        ({"max_tokens": 101}, "max_tokens (101) exceeds the context of 100 tokens"),
    ],
)
def test_max_tokens_out_of_range_is_refused_by_the_validator_itself(fields, message):
    # Refused where requests are checked, before tokenizing, with INVALID_ARGUMENT.
    refused = refusal(serving_pb2.GenerateRequest(prompt="hi", **fields))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.message == message
