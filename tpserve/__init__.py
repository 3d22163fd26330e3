"""tpserve: one language model split across tensor-parallel ranks, served over gRPC."""

from tpserve.ranks.version import VERSION as __version__

__all__ = ["__version__"]
