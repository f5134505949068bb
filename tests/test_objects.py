import pytest
import torch

from lmcache_hma.objects import IntegrityError, ObjectKind, object_elems, payload_of, seal, verify

FP, KEY = b"12345678", b"abcdefgh"


def sealed(n_payload_bytes=256):
    obj = torch.zeros(object_elems(n_payload_bytes, torch.bfloat16), dtype=torch.bfloat16)
    payload_of(obj).copy_(torch.randn(n_payload_bytes // 2))
    seal(obj, FP, KEY, ObjectKind.FULL)
    return obj


def test_roundtrip():
    obj = sealed()
    verify(obj, obj.numel(), FP, KEY, ObjectKind.FULL)


@pytest.mark.parametrize("damage, match", [
    (lambda o: o.view(torch.uint8).__setitem__(3, 7), "checksum"),
    (lambda o: None, "another KV layout"),
])
def test_detects_corruption_and_foreign_layout(damage, match):
    obj = sealed()
    damage(obj)
    fp = FP if match != "another KV layout" else b"87654321"
    with pytest.raises(IntegrityError, match=match):
        verify(obj, obj.numel(), fp, KEY, ObjectKind.FULL)


def test_detects_truncation_wrong_key_and_kind():
    obj = sealed()
    with pytest.raises(IntegrityError, match="shape"):
        verify(obj[:-8], obj.numel(), FP, KEY, ObjectKind.FULL)
    with pytest.raises(IntegrityError, match="another key"):
        verify(obj, obj.numel(), FP, b"zzzzzzzz", ObjectKind.FULL)
    with pytest.raises(IntegrityError, match="another key"):
        verify(obj, obj.numel(), FP, KEY, ObjectKind.TAIL)
    blank = torch.zeros_like(obj)
    with pytest.raises(IntegrityError, match="trailer"):
        verify(blank, obj.numel(), FP, KEY, ObjectKind.FULL)
