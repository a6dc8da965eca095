"""fleetrl's weight checksum: one sha256 over every tensor of a publish, in send order.

The sender computes it over the tensors it sends, each worker rank over the tensors it
receives; equal digests prove the worker got exactly what was sent. vLLM's own
`/weight_checker` cannot serve here: on CPU fp32 the linear layers are prepacked and their
parameters hash as empty.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16": the wire spelling of a dtype."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in memory order (row-major, native little-endian), on the CPU."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class WeightsHasher:
    """sha256 over (name, dtype, shape, byte count, raw bytes) of each tensor, in order.

    The byte count closes each record, so no two different sequences of tensors can
    produce the same stream of hashed bytes.
    """

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self.bytes = 0  # of tensor data hashed: what a publish moved

    def update(self, name: str, tensor: torch.Tensor) -> None:
        data = raw_bytes(tensor)
        shape = ",".join(str(d) for d in tensor.shape)
        header = f"{name}\0{dtype_name(tensor.dtype)}\0{shape}\0{data.nbytes}\n"
        self._sha.update(header.encode())
        self._sha.update(data)
        self.bytes += data.nbytes

    def update_all(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            self.update(name, tensor)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def checksum_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The checksum a transport reports for sending these tensors in this order."""
    hasher = WeightsHasher()
    hasher.update_all(named_tensors)
    return hasher.hexdigest()
