"""Every stored kind in tpserve/ranks/packing.py STORED_KINDS (float, a checkpoint's int8 or fp8, blocks of
every width) keeps its values through the loader's steps: a piece's slice owned at load holds only its
own rows (room counts what a rank holds), and a partial rotary's row reorder moves each row's values with
its scales, as the dequantized weight's rows move."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tpserve.ranks.block_tensors import MXFP4, BlockValues
from tpserve.ranks.fp8_tensors import Fp8Values
from tpserve.ranks.int8_tensors import Int8Values
from tpserve.ranks.packing import dequantized, owned, rows_taken

NUM_ROWS, NUM_IN = 16, 64


def stored(kind: str):
    """A random [16, 64] weight stored as `kind`."""
    gen = torch.Generator().manual_seed(0)

    def ints(low, high, shape, dtype=torch.uint8):
        return torch.randint(low, high, shape, generator=gen, dtype=dtype)

    def scales(shape):
        return (torch.rand(shape, generator=gen) + 0.1).to(torch.float16)

    rows, blocks = (NUM_ROWS, NUM_IN), (NUM_ROWS, NUM_IN // 32)
    return {
        "float": lambda: torch.randn(rows, generator=gen),
        "int8": lambda: Int8Values(
            ints(-127, 128, rows, torch.int8), torch.rand(NUM_ROWS, generator=gen) + 0.1
        ),
        "fp8": lambda: Fp8Values(
            torch.randn(rows, generator=gen).to(torch.float8_e4m3fn),
            torch.rand(NUM_ROWS, generator=gen) + 0.1,
        ),
        "4-bit": lambda: BlockValues(ints(0, 16, rows), scales(blocks), scales(blocks), bits=4),
        "6-bit": lambda: BlockValues(
            ints(0, 64, rows),
            scales(blocks),
            None,
            ints(-32, 32, (NUM_ROWS, NUM_IN // 16), torch.int8),
            bits=6,
        ),
        "8-bit": lambda: BlockValues(ints(-127, 128, rows, torch.int8), scales(blocks), None, bits=8),
        "mxfp4": lambda: BlockValues(ints(0, 16, rows), ints(120, 130, blocks), None, bits=MXFP4),
    }[kind]()


def rows_view(weight, start: int, end: int):
    """Rows [start, end) as views of the whole weight's tensors, as safetensors gives a piece's slice."""
    if isinstance(weight, torch.Tensor):
        return weight[start:end]
    views = {
        field.name: getattr(weight, field.name)[start:end]
        for field in dataclasses.fields(weight)
        if isinstance(getattr(weight, field.name), torch.Tensor)
    }
    return dataclasses.replace(weight, **views)


def tensors_of(weight) -> list[torch.Tensor]:
    if isinstance(weight, torch.Tensor):
        return [weight]
    return [
        getattr(weight, f.name)
        for f in dataclasses.fields(weight)
        if torch.is_tensor(getattr(weight, f.name))
    ]


KINDS = ["float", "int8", "fp8", "4-bit", "6-bit", "8-bit", "mxfp4"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_slice_owned_at_load_holds_only_its_rows_with_their_values(kind):
    whole = stored(kind)
    piece = owned(rows_view(whole, 4, 12), "cpu", torch.float32)
    for tensor in tensors_of(piece):
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    assert torch.equal(dequantized(piece).float(), dequantized(whole).float()[4:12])
    # the CPU serves no fp8: a CPU's fp8 is its float values from load on; every other kind stays as stored
    assert type(piece) is (torch.Tensor if kind == "fp8" else type(whole))


@pytest.mark.parametrize("kind", KINDS)
def test_rows_reordered_move_with_their_scales(kind):
    weight = stored(kind)
    rows = torch.randperm(NUM_ROWS, generator=torch.Generator().manual_seed(1))
    reordered = rows_taken(weight, rows)
    assert type(reordered) is type(weight)
    assert torch.equal(dequantized(reordered).float(), dequantized(weight).float()[rows])
