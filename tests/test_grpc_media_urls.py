"""gRPC's Media.url (allowed_media_domains) over real gRPC: a real server on loopback, a real lane host
over the fake backend, a tiny LLaVA's tokenizer and vision tower, and the HTTP API's own fetcher
against a real HTTPS server on loopback (tests/test_media_urls.py's: a trustme certificate for
`localhost`, and the address rule relaxed to let loopback through, as only those unit tests do).
The daemon's own refusals (loopback by name, http://, none when off) are in tests/test_vision_daemon.py.
"""

from __future__ import annotations

import grpc
import pytest
import test_media_urls
import torch
from daemon import BackgroundReply, read_reply
from fake_backend import FakeBackend
from test_grpc_api import CONTEXT_SIZE, SlowBackend, serving, wait_until
from test_media_urls import IMAGE, MAX_BYTES, fetcher, url
from tiny_llava import IMAGE_TOKEN, write_tiny_llava

from tpserve.ranks.model_config import load_model_config
from tpserve.server.tokenizer import Tokenizer
from tpserve.server.vision_input import VisionInput
from tpserve.v1 import serving_pb2

WHERE = "messages[0].parts[0].media"
# test_media_urls' fixtures: its certificate authority, and its HTTPS host on loopback
authority, media_host = test_media_urls.authority, test_media_urls.server


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """The tiny LLaVA's tokenizer and vision reader (the fake backend stands in for its text model)."""
    model_dir = write_tiny_llava(tmp_path_factory.mktemp("llava"))
    config = load_model_config(model_dir)
    reader = VisionInput.from_model_dir(model_dir, config, IMAGE_TOKEN, torch.float32)
    return Tokenizer.from_model_dir(model_dir), reader


def serving_llava(llava, backend: FakeBackend, media_fetcher):
    tokenizer, reader = llava
    return serving(
        backend, vision=True, tokenizer=tokenizer, vision_input=reader, media_fetcher=media_fetcher
    )


def chat(media: serving_pb2.Media, max_tokens: int = 6) -> serving_pb2.GenerateRequest:
    request = serving_pb2.GenerateRequest(max_tokens=max_tokens, ignore_eos=True)
    message = request.messages.add(role="user")
    message.parts.add(media=media)
    message.parts.add(text="what")
    return request


def refused(stub, request) -> tuple[grpc.StatusCode, str]:
    reply = read_reply(stub.Generate(request, timeout=30))
    assert not reply.ok, "the request was served"
    return reply.code, reply.details


def test_a_url_of_an_allowed_host_is_fetched_and_reads_as_its_bytes(authority, media_host, llava):
    address = url(media_host, "/cat.png")
    by_url = serving_pb2.Media(mime_type="image/*", url=address)
    by_bytes = serving_pb2.Media(mime_type="image/png", data=IMAGE)
    backend = FakeBackend(num_lanes=1, context_size=CONTEXT_SIZE)
    with serving_llava(llava, backend, fetcher(authority)) as served:
        fetches_before = media_host.paths.count("/cat.png")
        fetched = read_reply(served.stub.Generate(chat(by_url), timeout=30))
        sent = read_reply(served.stub.Generate(chat(by_bytes), timeout=30))
        tokenize = [
            served.stub.Tokenize(serving_pb2.TokenizeRequest(messages=chat(media).messages), timeout=30)
            for media in (by_url, by_bytes)
        ]
    assert fetched.ok and sent.ok, (fetched.details, sent.details)
    assert (fetched.token_ids, fetched.text) == (sent.token_ids, sent.text)
    assert len(fetched.token_ids) == 6
    assert tokenize[0].token_ids == tokenize[1].token_ids
    assert media_host.paths.count("/cat.png") == fetches_before + 2  # Generate's, then Tokenize's


def test_a_failed_fetch_is_invalid_argument_worded_as_over_http_and_a_stream_in_flight_goes_on(
    authority, media_host, llava
):
    backend = SlowBackend(num_lanes=2, context_size=CONTEXT_SIZE)
    with serving_llava(llava, backend, fetcher(authority, timeout_s=0.5)) as served:
        backend.gate.clear()  # the text stream's decode rounds wait until the refusals are in
        text = serving_pb2.GenerateRequest(prompt="hold on", max_tokens=8, ignore_eos=True)
        in_flight = BackgroundReply(served.stub, text, timeout_s=30)
        wait_until(lambda: in_flight.reply.prefilled, "the text stream's prefill")
        slow = refused(
            served.stub, chat(serving_pb2.Media(mime_type="image/*", url=url(media_host, "/slow")))
        )
        endless = url(media_host, "/endless")
        too_large = refused(served.stub, chat(serving_pb2.Media(mime_type="video/*", url=endless)))
        redirect = refused(
            served.stub, chat(serving_pb2.Media(mime_type="image/png", url=url(media_host, "/redirect")))
        )
        backend.gate.set()
        finished = in_flight.join(30)
    assert slow == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{WHERE}: the image from localhost did not arrive within media_fetch_timeout_s (0.5 s)",
    )
    assert too_large == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{WHERE}: the video from localhost is over {MAX_BYTES} bytes, the most per video (max_video_bytes)",
    )
    assert redirect == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{WHERE}: localhost answered 302, a redirect (to elsewhere.invalid); "
        "media URLs are fetched without following redirects",
    )
    assert finished.ok and len(finished.token_ids) == 8, (finished.code, finished.details)


def test_a_url_sent_as_data_is_never_fetched(authority, media_host, llava):
    """Bytes that hold a URL keep their refusal, with a fetcher or without."""
    address = url(media_host, "/cat.png")
    backend = FakeBackend(num_lanes=1, context_size=CONTEXT_SIZE)
    with serving_llava(llava, backend, fetcher(authority)) as served:
        fetches_before = len(media_host.paths)
        code, details = refused(
            served.stub, chat(serving_pb2.Media(mime_type="image/*", data=address.encode()))
        )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "this server fetches none" in details
    assert len(media_host.paths) == fetches_before
