"""The code version every rank shows in its start-up flags row (ranks must run the same code)."""

VERSION = "0.1.0"
