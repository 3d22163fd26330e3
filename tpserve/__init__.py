"""tpserve: one language model split across tensor-parallel ranks, served over gRPC."""

__version__ = "0.1.0"
