"""The layer objects every family's decoder is composed of, each owning its weights on this rank."""
