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


def packed_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                   device: torch.device) -> Iterator[tuple[torch.Tensor, list[TensorMeta]]]:
    """The tensors, in order, packed into buckets of at most `bucket_bytes` on `device` (a larger
    tensor travels alone in its own): each bucket's flat buffer and its tensors' metadata.

    Each tensor is copied into its bucket as it arrives and let go at once, never collected
    first: fed by a stream that gathers one full tensor at a time from a sharded model
    (`trainer.gather`), memory holds the bucket being filled and the tensor in hand beyond the
    shards, not a list of gathered tensors beside their packed copy. The generator keeps no
    reference to a bucket it has handed out, so the caller's dropping it frees it."""
    buffer: torch.Tensor | None = None
    metas: list[TensorMeta] = []
    end = 0
    for name, tensor in named:
        meta = TensorMeta.of(name, tensor)
        size = _aligned(meta.nbytes)
        if metas and end + size > bucket_bytes:
            yield buffer[:end], metas
            buffer, metas, end = None, [], 0
        if buffer is None:
            # The bucket's capacity: how full it gets is known only once the next tensor arrives.
            buffer = torch.empty(max(bucket_bytes, size), dtype=torch.uint8, device=device)
        buffer[end:end + meta.nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        metas.append(meta)
        end += size
        del tensor  # not held while the next one is gathered
    if metas:
        yield buffer[:end], metas


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
    travels alone in its own bucket): the grouping of `packed_buckets`, without the packing."""
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
