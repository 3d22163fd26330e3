"""Benchmarks of tpserve, run from the repository root: `python -m bench.<name>` (see README.md)."""
