"""KV blocks as bytes: export from one engine, import into another (disaggregated prefill →
decode handoff, and the shared cache service later).

Wire format of one :class:`KvBlocks` (:func:`encode` / :func:`decode`)::

    4 bytes  big-endian header length H
    H bytes  JSON header: v, model_id, layer_start, layer_end, dtype, shape, block_size,
             block_hashes
    rest     raw tensor bytes, C order, shape ``[layers, 2 (k, v), kv_heads, num_blocks,
             block_size, head_dim]``

Chunking to the transport's ``max_payload`` is the transport's job (see :func:`split`).
Blocks are identified by their chain hashes, so an importer registers them in its prefix cache
and the next request with that prompt simply gets prefix hits.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgspec
import torch

KV_FORMAT_VERSION = 1
_LEN = struct.Struct(">I")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KvHeader(msgspec.Struct, kw_only=True):
    v: int = KV_FORMAT_VERSION
    model_id: str
    layer_start: int
    layer_end: int  # exclusive
    dtype: str  # "float32" | "bfloat16" | "float16"
    shape: list[int]  # [layers, 2, kv_heads, num_blocks, block_size, head_dim]
    block_size: int
    block_hashes: list[int]  # one chain hash per block, in prefix order


@dataclass(slots=True)
class KvBlocks:
    header: KvHeader
    data: torch.Tensor  # shape header.shape, dtype header.dtype, on the CPU

    @classmethod
    def from_tensor(
        cls, model_id: str, block_hashes: list[int], data: torch.Tensor, layer_start: int = 0
    ) -> KvBlocks:
        dtype = next(name for name, t in _DTYPES.items() if t == data.dtype)
        header = KvHeader(
            model_id=model_id,
            layer_start=layer_start,
            layer_end=layer_start + data.shape[0],
            dtype=dtype,
            shape=list(data.shape),
            block_size=data.shape[4],
            block_hashes=list(block_hashes),
        )
        if data.shape[3] != len(block_hashes):
            raise ValueError(f"{data.shape[3]} blocks of data for {len(block_hashes)} hashes")
        return cls(header, data.contiguous().cpu())


def tail(kv: KvBlocks, skip: int) -> KvBlocks | None:
    """``kv`` without its first ``skip`` blocks (None when nothing is left). Chain hashes name
    each block with its whole prefix, so the tail imports correctly wherever the head is held."""
    n = len(kv.header.block_hashes)
    if skip <= 0:
        return kv
    if skip >= n:
        return None
    h = kv.header
    return KvBlocks.from_tensor(
        h.model_id, h.block_hashes[skip:], kv.data[:, :, :, skip:], h.layer_start
    )


def encode(kv: KvBlocks) -> bytearray:
    """The wire bytes of ``kv``; the tensor is copied once, straight into the payload."""
    header = msgspec.json.encode(kv.header)
    data = kv.data.contiguous().reshape(-1)
    start = _LEN.size + len(header)
    out = bytearray(start + data.numel() * data.element_size())
    _LEN.pack_into(out, 0, len(header))
    out[_LEN.size : start] = header
    if data.numel():
        torch.frombuffer(out, dtype=torch.uint8, offset=start).copy_(data.view(torch.uint8))
    return out


def decode(payload: bytes | bytearray) -> KvBlocks:
    """Parse :func:`encode`'s output; raises ValueError on a malformed payload. A bytearray is
    used in place (the tensor shares its memory); bytes are copied once (read-only)."""
    if len(payload) < _LEN.size:
        raise ValueError("KV payload too short")
    (n,) = _LEN.unpack_from(payload)
    view = memoryview(payload)
    try:
        header = msgspec.json.decode(view[_LEN.size : _LEN.size + n], type=KvHeader)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"bad KV header: {e}") from None
    if header.v != KV_FORMAT_VERSION:
        raise ValueError(f"KV format version {header.v} is not supported")
    dtype = _DTYPES.get(header.dtype)
    if dtype is None:
        raise ValueError(f"unknown KV dtype {header.dtype!r}")
    raw = view[_LEN.size + n :]
    expected = dtype.itemsize
    for d in header.shape:
        expected *= d
    if len(raw) != expected:
        raise ValueError(f"KV payload has {len(raw)} data bytes, header says {expected}")
    if not expected:
        return KvBlocks(header, torch.empty(header.shape, dtype=dtype))
    buffer = raw if isinstance(payload, bytearray) else bytearray(raw)
    data = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(header.shape)
    return KvBlocks(header, data)


def split(payload: bytes | bytearray, max_bytes: int) -> list[bytes]:
    """Cut an encoded payload into pieces of at most ``max_bytes`` (e.g. NATS max_payload)."""
    if max_bytes < 1:
        raise ValueError("max_bytes must be positive")
    view = memoryview(payload)
    return [bytes(view[i : i + max_bytes]) for i in range(0, len(payload), max_bytes)] or [b""]
