import zlib

import pytest
import torch

from lmcache_hma.core.kinds import ObjectKind
from lmcache_hma.core.objects import TRAILER_BYTES, IntegrityError, object_elems, payload_of, seal, verify

FP, KEY = b"0123456789abcdef", bytes(range(32))
SECRET = b"a-shared-secret-of-the-fleet"


def sealed(n_payload_bytes=256, secret=None):
    obj = torch.zeros(object_elems(n_payload_bytes, torch.bfloat16), dtype=torch.bfloat16)
    payload_of(obj).copy_(torch.randn(n_payload_bytes // 2))
    seal(obj, FP, KEY, ObjectKind.FULL, secret)
    return obj


def forge(obj):
    """What someone with write access but without the secret can do: new payload, valid CRC."""
    raw = obj.view(torch.uint8)
    payload = raw[:-TRAILER_BYTES]
    payload.copy_(torch.randint(0, 256, payload.shape, dtype=torch.uint8))
    crc_at = raw.numel() - TRAILER_BYTES + 4 + 4 + 16 + 32 + 4 + 8
    raw[crc_at:crc_at + 4] = torch.frombuffer(bytearray(zlib.crc32(payload.numpy()).to_bytes(4, "little")),
                                              dtype=torch.uint8)


def test_roundtrip():
    obj = sealed()
    verify(obj, obj.numel(), FP, KEY, ObjectKind.FULL)


def test_keys_are_full_256_bit_digests():
    obj = sealed()
    other = bytearray(KEY)
    other[-1] ^= 1  # differs only past the first 8 bytes
    with pytest.raises(IntegrityError, match="another key"):
        verify(obj, obj.numel(), FP, bytes(other), ObjectKind.FULL)


@pytest.mark.parametrize("damage, match", [
    (lambda o: o.view(torch.uint8).__setitem__(3, 7), "checksum"),
    (lambda o: None, "another KV layout"),
])
def test_detects_corruption_and_foreign_layout(damage, match):
    obj = sealed()
    damage(obj)
    fp = FP if match != "another KV layout" else b"fedcba9876543210"
    with pytest.raises(IntegrityError, match=match):
        verify(obj, obj.numel(), fp, KEY, ObjectKind.FULL)


def test_detects_truncation_wrong_key_and_kind():
    obj = sealed()
    with pytest.raises(IntegrityError, match="shape"):
        verify(obj[:-8], obj.numel(), FP, KEY, ObjectKind.FULL)
    with pytest.raises(IntegrityError, match="another key"):
        verify(obj, obj.numel(), FP, bytes(32), ObjectKind.FULL)
    with pytest.raises(IntegrityError, match="another key"):
        verify(obj, obj.numel(), FP, KEY, ObjectKind.TAIL)
    blank = torch.zeros_like(obj)
    with pytest.raises(IntegrityError, match="trailer"):
        verify(blank, obj.numel(), FP, KEY, ObjectKind.FULL)


def test_forged_object_passes_the_crc_but_not_the_shared_secret():
    plain = sealed()
    forge(plain)
    verify(plain, plain.numel(), FP, KEY, ObjectKind.FULL)  # without a secret a forgery is accepted ...
    signed = sealed(secret=SECRET)
    verify(signed, signed.numel(), FP, KEY, ObjectKind.FULL, secret=SECRET)
    forge(signed)
    verify(signed, signed.numel(), FP, KEY, ObjectKind.FULL)  # ... its CRC is valid ...
    with pytest.raises(IntegrityError, match="shared secret"):  # ... the MAC is not
        verify(signed, signed.numel(), FP, KEY, ObjectKind.FULL, secret=SECRET)
    unsigned = sealed()  # written by a deployment without the secret
    with pytest.raises(IntegrityError, match="shared secret"):
        verify(unsigned, unsigned.numel(), FP, KEY, ObjectKind.FULL, check_crc=False, secret=SECRET)


def test_checksum_is_zlibs_crc32():
    """The trailer's checksum is CRC32 whichever library computes it (ISA-L's when installed):
    objects stored by any release or build verify in any other."""
    import zlib

    import numpy as np

    from lmcache_hma.core.objects import crc32

    data = np.random.default_rng(0).integers(0, 256, 3 * 2**20 + 7, dtype=np.uint8)
    assert crc32(data) == zlib.crc32(data) and crc32(b"") == 0
