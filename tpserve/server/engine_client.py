"""What the APIs need of the engine: the one interface both places it can run behind.

The LaneHost itself (tpserve/server/lane_host.py: in this process, as tests and tools run it) and
RemoteEngine (tpserve/server/remote_engine.py: the front process's proxy for the lane host in rank 0's
engine process) both implement it, so the Submitter (tpserve/server/submitter.py), the gRPC server and the
HTTP API work the same on either. A submitted request's Stream carries the same events, text and
usage in both, and refusals raise the same exceptions (QueueFull, HostUnavailable, ValueError).
"""

from __future__ import annotations

from typing import Protocol

from tpserve.server.kv_blocks import BlockStats
from tpserve.server.lane_stream import Stream
from tpserve.server.requests import GenerationRequest, HostStats


class EngineClient(Protocol):
    @property
    def broken(self) -> bool:
        """Latched once the engine broke (or, from the front, went away); never unlatched."""
        ...

    def submit(self, request: GenerationRequest) -> Stream:
        """Queue a request. Raises QueueFull, HostUnavailable, or ValueError for one that cannot run.
        Stream.cancel ends it early from any thread."""
        ...

    def stats(self) -> HostStats:
        """The load now (metrics read it at scrape time)."""
        ...

    def block_stats(self) -> BlockStats:
        """The KV blocks and the prefix cache in them (metrics, at scrape time)."""
        ...
