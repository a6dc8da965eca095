"""Buckets: several tensors packed into one flat uint8 buffer, so that a broadcast moves
megabytes per collective instead of one small tensor at a time.

Sender and receiver compute the same layout from the same metadata (names, dtypes,
shapes), so only the metadata travels beside the buffer, never offsets.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from fleetrl.weights.checksum import dtype_name, parse_dtype

# Every tensor starts on a 16-byte boundary: a uint8 slice can be viewed as any dtype
# only at an offset that is a multiple of its element size.
ALIGN = 16


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # wire spelling, e.g. "bfloat16"
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.torch_dtype.itemsize


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(metas: list[TensorMeta]) -> tuple[list[int], int]:
    """Byte offset of each tensor in the bucket, and the bucket's total size."""
    offsets, end = [], 0
    for meta in metas:
        offsets.append(end)
        end = _aligned(end + meta.nbytes)
    return offsets, end


def pack_bucket(named: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, list[TensorMeta]]:
    metas = [TensorMeta.of(name, tensor) for name, tensor in named]
    offsets, total = layout(metas)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    for (_, tensor), meta, offset in zip(named, metas, offsets):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset:offset + meta.nbytes].copy_(flat)
    return buffer, metas


def unpack_bucket(buffer: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views into `buffer` (no copies): they keep the buffer alive as long as they live."""
    offsets, total = layout(metas)
    if buffer.numel() != total:
        raise ValueError(f"bucket holds {buffer.numel()} bytes but its metadata describes {total}")
    return [
        (meta.name, buffer[offset:offset + meta.nbytes].view(meta.torch_dtype).view(meta.shape))
        for meta, offset in zip(metas, offsets)
    ]


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Groups tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor
    travels alone in its own bucket)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = _aligned(tensor.numel() * tensor.element_size())
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
