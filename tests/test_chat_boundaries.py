"""The submitter marks where a chat's history ends, so the prompt cache can keep that prefix."""

from __future__ import annotations

from fake_backend import FakeBackend
from fake_tokens import EOS_IDS, fake_detokenize
from tiny_models import write_tiny_model

from tpserve.server.lane_host import LaneHost
from tpserve.server.serving_info import ServingInfo
from tpserve.server.submitter import Submitter
from tpserve.server.tokenizer import Tokenizer
from tpserve.v1 import serving_pb2


def test_boundaries_are_the_system_block_and_the_history(tmp_path):
    tokenizer = Tokenizer.from_model_dir(write_tiny_model(tmp_path / "m", "llama"))
    host = LaneHost(FakeBackend(), detokenize=fake_detokenize, eos_ids=EOS_IDS)
    submitter = Submitter(host, tokenizer, ServingInfo("tiny", 1, 4, 256, 4096))
    chat = [
        ("system", "the quick brown fox"),
        ("user", "hello world"),
        ("assistant", "over the lazy dog"),
        ("user", "tensor parallel serving"),
    ]
    messages = [serving_pb2.ChatMessage(role=role, content=text) for role, text in chat]
    ids = submitter.encode_chat(messages)
    system, history = submitter.chat_boundaries(messages, ids)
    rendered = [
        tokenizer.encode_chat([dict(role=r, content=t) for r, t in chat[:n]], add_generation_prompt=False)
        for n in (1, 3)
    ]
    assert (system, history) == (len(rendered[0]), len(rendered[1]))
    assert ids[:history] == rendered[1] and 0 < system < history < len(ids)
