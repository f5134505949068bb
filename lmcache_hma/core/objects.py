"""The stored object: KV payload plus a 128-byte integrity trailer.

Every object this connector puts into LMCache is one 1-D tensor of the KV dtype:
``[payload | trailer]``. The trailer says what the payload is and lets a load
refuse anything else:

    magic "HMA2" | format u32 | namespace fingerprint 16B | key 32B | kind u32 |
    payload bytes u64 | crc32 of payload u32 | MAC 32B | zero padding

The MAC is HMAC-SHA256, under the deployment's shared secret, of the trailer's
fields before it and the payload; all zero without a secret. A load checks
length, magic, fingerprint (a foreign layout), key (an object stored under the
wrong name), the checksum (corruption, truncation) and, with a secret, the MAC
(an object written by anyone without the secret); any failure is a cache miss
for that chunk, never bytes in the KV cache.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Optional

import torch

try:  # ISA-L's CRC32: the same checksum as zlib's, several times faster
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform without isal wheels
    from zlib import crc32

from lmcache_hma.core.kinds import ObjectKind

TRAILER_BYTES = 128
_FORMAT_VERSION = 2
_MAGIC = b"HMA2"
_HEADER = struct.Struct("<4sI16s32sIQI")  # the fields the MAC covers, then the MAC
_MAC_BYTES = 32


class IntegrityError(ValueError):
    """A stored object failed its checks: treated as a miss."""


def object_elems(payload_bytes: int, dtype: torch.dtype) -> int:
    """Elements of the KV dtype an object with ``payload_bytes`` of payload needs."""
    size = dtype.itemsize
    assert payload_bytes % size == 0 and TRAILER_BYTES % size == 0
    return (payload_bytes + TRAILER_BYTES) // size


def payload_of(obj: torch.Tensor) -> torch.Tensor:
    """The payload part of an object tensor (a view)."""
    return obj[: obj.numel() - TRAILER_BYTES // obj.element_size()]


def _bytes(t: torch.Tensor):
    return t.view(torch.uint8).numpy()


def _mac(secret: Optional[bytes], header: bytes, payload) -> bytes:
    if not secret:
        return bytes(_MAC_BYTES)
    mac = hmac.new(secret, header, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def seal(obj: torch.Tensor, fingerprint: bytes, key: bytes, kind: ObjectKind,
         secret: Optional[bytes] = None) -> None:
    """Write the trailer of ``obj`` (its payload already filled in)."""
    payload = _bytes(payload_of(obj))
    header = _HEADER.pack(_MAGIC, _FORMAT_VERSION, fingerprint, key, int(kind), payload.nbytes,
                          crc32(payload))
    trailer = (header + _mac(secret, header, payload)).ljust(TRAILER_BYTES, b"\0")
    _bytes(obj)[-TRAILER_BYTES:] = memoryview(trailer)


def verify(obj: torch.Tensor, expected_elems: int, fingerprint: bytes, key: bytes,
           kind: ObjectKind, check_crc: bool = True, secret: Optional[bytes] = None,
           trusted: bool = False) -> None:
    """Raise ``IntegrityError`` unless ``obj`` is the intact object named by ``key``.

    With a ``secret`` the MAC is always checked, whatever ``check_crc`` says. A
    ``trusted`` object has not left this process's memory since it was sealed or
    verified here (the CPU tier): only its trailer's fields are checked, not a
    pass over its payload.
    """
    if obj.dim() != 1 or obj.numel() != expected_elems:
        raise IntegrityError(
            f"object has shape {tuple(obj.shape)}, expected ({expected_elems},)"
        )
    verify_bytes(_bytes(obj), fingerprint, key, kind, check_crc, secret, trusted)


def verify_bytes(raw, fingerprint: bytes, key: bytes, kind: ObjectKind, check_crc: bool = True,
                 secret: Optional[bytes] = None, trusted: bool = False) -> None:
    """``verify`` on an object's bytes (a ``memoryview`` or a uint8 array) whose length the
    caller has checked: no tensor is made (a hit checks dozens of objects per lookup)."""
    trailer = raw[-TRAILER_BYTES:].tobytes()
    header = trailer[:_HEADER.size]
    magic, version, fp, k, knd, nbytes, crc = _HEADER.unpack(header)
    if magic != _MAGIC or version != _FORMAT_VERSION:
        raise IntegrityError("object trailer missing or of another format")
    if fp != fingerprint:
        raise IntegrityError("object was stored by another KV layout, model or shared secret")
    if k != key or knd != int(kind):
        raise IntegrityError("object was stored under another key")
    payload = raw[:-TRAILER_BYTES]
    if nbytes != payload.nbytes:
        raise IntegrityError(f"payload is {payload.nbytes} bytes, trailer says {nbytes}")
    if trusted:
        return
    if secret:
        stored = trailer[_HEADER.size:_HEADER.size + _MAC_BYTES]
        if not hmac.compare_digest(stored, _mac(secret, header, payload)):
            raise IntegrityError("object is not signed with this deployment's shared secret "
                                 "(written without it, or altered)")
    elif check_crc and crc32(payload) != crc:
        raise IntegrityError("payload checksum mismatch")
