"""A loaded weight's tensors copied out to a device, or taken in a row order: a float tensor, or a stored
kind that is a dataclass of tensors each with one row per output row (int8 or fp8 values and their
scales, blocks and their scales), done field by field (tpserve/ranks/packing.py STORED_KINDS)."""

from __future__ import annotations

import dataclasses

import torch


def owned_tensor(tensor: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` on the device in `dtype`, in storage of its own size. A slice of the rows comes back from
    safetensors as a view of the whole tensor, and `.to()` on the same device and dtype keeps that view:
    the rank would hold the full tensor, and room would see the memory as taken."""
    out = tensor.to(device=device, dtype=dtype)
    if not out.is_contiguous() or out.untyped_storage().nbytes() != out.numel() * out.element_size():
        out = out.clone(memory_format=torch.contiguous_format)
    return out


def owned_fields(value, device, dtype: torch.dtype):
    """`value` with every tensor owned on the device in its own dtype (int8 values, float32 scales, blocks'
    float16 or float32 scales: a float32 block scale rounded to float16 would be rounded twice); `dtype`,
    the model's, is not theirs."""
    return _replace_tensors(value, lambda tensor: owned_tensor(tensor, device, tensor.dtype))


def rows_of_fields(value, rows: torch.Tensor):
    """`value` with every tensor's rows in the order `rows` gives (each row its own values and scales)."""
    return _replace_tensors(value, lambda tensor: tensor[rows.to(tensor.device)])


def rows_of_tensor(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return tensor[rows.to(tensor.device)]


def _replace_tensors(value, change):
    tensors = {
        field.name: getattr(value, field.name)
        for field in dataclasses.fields(value)
        if isinstance(getattr(value, field.name), torch.Tensor)
    }
    return dataclasses.replace(value, **{name: change(tensor) for name, tensor in tensors.items()})
