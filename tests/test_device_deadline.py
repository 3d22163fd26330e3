"""A lost peer on a GPU leaves rank 0's stream waiting forever on the pass's collective; rank 0's
wait for the logits gives up at its deadline and the engine breaks, so every live stream ends with
an error naming the rank that did not answer (UNAVAILABLE at the API), new requests are refused,
and the daemon exits 1. On this CPU machine the stuck stream is a device event that never
completes; the wait, the engine, the leader and the lane host are the real ones."""

from __future__ import annotations

import pytest
import torch
from tiny_models import write_tiny_model

from tpserve.kernels.sampling_params import SamplingParams
from tpserve.ranks import engine as engine_module
from tpserve.ranks.device_wait import wait_for
from tpserve.ranks.engine import Engine
from tpserve.ranks.kv_store import KVPool
from tpserve.ranks.leader import Leader
from tpserve.ranks.loader import load_rank_model
from tpserve.ranks.model_config import load_model_config
from tpserve.server.lane_host import LaneHost
from tpserve.server.requests import Finished, GenerationRequest, HostUnavailable

DEVICE_TIMEOUT_S = 0.3


class NeverDone:
    """The event after a collective whose peer is gone."""

    def query(self) -> bool:
        return False


class PeerCollectives:
    """Rank 0's forward collectives with a peer whose part is as if its shard were rank 0's."""

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x, x]


class FollowerThatAgrees:
    """Rank 0's channel with one follower that took every message and votes yes."""

    world_size = 2
    lost_follower = None

    def send(self, msg) -> None:
        pass

    def vote(self, ok: bool) -> bool:
        return ok


@pytest.fixture
def stuck_leader(tmp_path, monkeypatch) -> Leader:
    model_dir = write_tiny_model(tmp_path / "llama", "llama")
    config = load_model_config(model_dir)
    model = load_rank_model(
        model_dir, tp_rank=0, tp_size=2, dtype=torch.float32, max_positions=128, collectives=PeerCollectives()
    )
    kv = KVPool(config.num_layers, 256, model.kv_heads_per_piece(), config.head_dim, torch.float32)
    engine = Engine(model, kv, device_timeout_s=DEVICE_TIMEOUT_S)

    def stuck_copy(tensor, timeout_s, what):
        wait_for(NeverDone(), timeout_s, what)

    monkeypatch.setattr(engine_module, "to_host", stuck_copy)
    return Leader(
        engine,
        FollowerThatAgrees(),
        num_lanes=2,
        context_size=128,
        max_prefill_tokens=64,
        batches_prompts=False,
    )


def test_a_pass_stuck_on_the_device_ends_every_stream_naming_the_peer(stuck_leader):
    broken: list[str] = []
    host = LaneHost(stuck_leader, detokenize=lambda ids: "", eos_ids=frozenset(), on_broken=broken.append)
    host.start()
    try:
        stream = host.submit(GenerationRequest((5, 6, 7), 4, SamplingParams()))
        events = list(stream.events(timeout_each=30.0))
        last = events[-1]
        assert isinstance(last, Finished) and last.reason == "error", events
        assert "rank 1 never finished" in last.error and "never reached the host" in last.error
        assert f"within {DEVICE_TIMEOUT_S:g}s" in last.error
        assert host.broken and broken  # the daemon's on_broken: health NOT_SERVING, then exit 1
        with pytest.raises(HostUnavailable):
            host.submit(GenerationRequest((5,), 2, SamplingParams()))
    finally:
        host.stop(grace_s=0)
