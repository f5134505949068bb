"""The stored object: KV payload plus a 64-byte integrity trailer.

Every object this connector puts into LMCache is one 1-D tensor of the KV dtype:
``[payload | trailer]``. The trailer says what the payload is and lets a load
refuse anything else:

    magic "HMA1" | format u32 | layout fingerprint 8B | key 8B | kind u32 |
    payload bytes u64 | crc32 of payload u32 | zero padding

A load checks length, magic, fingerprint (a foreign layout), key (an object
stored under the wrong name) and the checksum (corruption, truncation); any
failure is a cache miss for that chunk, never bytes in the KV cache.
"""

from __future__ import annotations

import enum
import struct
import zlib

import torch

TRAILER_BYTES = 64
_FORMAT_VERSION = 1
_MAGIC = b"HMA1"
_STRUCT = struct.Struct("<4sI8s8sIQI")


class ObjectKind(enum.IntEnum):
    FULL = 1
    TAIL = 2


class IntegrityError(ValueError):
    """A stored object failed its checks: treated as a miss."""


def object_elems(payload_bytes: int, dtype: torch.dtype) -> int:
    """Elements of the KV dtype an object with ``payload_bytes`` of payload needs."""
    size = torch.empty(0, dtype=dtype).element_size()
    assert payload_bytes % size == 0 and TRAILER_BYTES % size == 0
    return (payload_bytes + TRAILER_BYTES) // size


def payload_of(obj: torch.Tensor) -> torch.Tensor:
    """The payload part of an object tensor (a view)."""
    return obj[: obj.numel() - TRAILER_BYTES // obj.element_size()]


def _bytes(t: torch.Tensor):
    return t.view(torch.uint8).numpy()


def seal(obj: torch.Tensor, fingerprint: bytes, key: bytes, kind: ObjectKind) -> None:
    """Write the trailer of ``obj`` (its payload already filled in)."""
    payload = _bytes(payload_of(obj))
    trailer = _STRUCT.pack(
        _MAGIC, _FORMAT_VERSION, fingerprint, key, int(kind), payload.nbytes,
        zlib.crc32(payload),
    ).ljust(TRAILER_BYTES, b"\0")
    _bytes(obj)[-TRAILER_BYTES:] = memoryview(trailer)


def verify(obj: torch.Tensor, expected_elems: int, fingerprint: bytes, key: bytes,
           kind: ObjectKind, check_crc: bool = True) -> None:
    """Raise ``IntegrityError`` unless ``obj`` is the intact object named by ``key``."""
    if obj.dim() != 1 or obj.numel() != expected_elems:
        raise IntegrityError(
            f"object has shape {tuple(obj.shape)}, expected ({expected_elems},)"
        )
    raw = _bytes(obj)
    magic, version, fp, k, knd, nbytes, crc = _STRUCT.unpack_from(
        raw[-TRAILER_BYTES:].tobytes()
    )
    if magic != _MAGIC or version != _FORMAT_VERSION:
        raise IntegrityError("object trailer missing or of another format")
    if fp != fingerprint:
        raise IntegrityError("object was stored by another KV layout")
    if k != key or knd != int(kind):
        raise IntegrityError("object was stored under another key")
    payload = raw[:-TRAILER_BYTES]
    if nbytes != payload.nbytes:
        raise IntegrityError(f"payload is {payload.nbytes} bytes, trailer says {nbytes}")
    if check_crc and zlib.crc32(payload) != crc:
        raise IntegrityError("payload checksum mismatch")
