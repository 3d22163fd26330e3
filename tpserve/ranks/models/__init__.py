"""One file per model family, each its decoder composed of the shared layers (tpserve/ranks/layers/)."""
