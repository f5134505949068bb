"""What produced the KV: the inputs besides token ids that go into chunk keys.

Runs in the scheduler (per request) and in both halves at start (the model).

The same token ids give different KV under another LoRA adapter, another image
over the placeholder tokens, other prompt embeddings, or other weights. A key
must therefore name all of them, or one request is served another's KV:

* Per chunk (``chunk_extra_keys``): vLLM's own prefix-cache extra keys for the
  chunk's token range (``generate_block_hash_extra_keys``: multimodal content
  hashes with their offsets, the LoRA adapter, ``cache_salt`` on the first
  chunk, prompt-embedding digests), with the LoRA adapter named by a digest of
  its files instead of its path: a name or path reused for other weights never
  hits, and the same adapter under another path still does. A request whose
  adapter files cannot be read gets no key at all (never cached).
* Per deployment (``model_identity``): revision, quantization, dtype,
  ``hf_overrides`` (a function by what it does: ``callable_identity``), KV
  cache dtype and a digest of the model directory's files, so weights replaced
  behind the same path or id never hit the old KV.

``files_digest`` reads small files whole and large ones by sampling (size, first
and last MiB, 32 spread blocks): a few MiB per weight file, so start-up stays
fast for large models while any realistic change of weights changes the digest.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from typing import Optional

from lmcache_hma.core.callable_identity import callable_key
from lmcache_hma.log import get_logger

logger = get_logger(__name__)

_FULL_READ_BYTES = 64 << 20  # files up to this size are hashed whole
_EDGE_BYTES = 1 << 20
_SAMPLES, _SAMPLE_BYTES = 32, 64 << 10
# Files of a model or adapter directory that decide its KV: weights and configs.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json")


def _file_digest(path: str, size: int) -> bytes:
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= _FULL_READ_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return h.digest()
        offsets = [0, size - _EDGE_BYTES]
        offsets += [(size - _SAMPLE_BYTES) * (i + 1) // (_SAMPLES + 1) for i in range(_SAMPLES)]
        for off in offsets:
            f.seek(off)
            h.update(f.read(_EDGE_BYTES if off in (0, size - _EDGE_BYTES) else _SAMPLE_BYTES))
    return h.digest()


@lru_cache(maxsize=256)
def _dir_digest(directory: str, stamp: tuple) -> str:
    h = hashlib.sha256()
    for name, size, _ in stamp:
        h.update(name.encode() + b"\0" + _file_digest(os.path.join(directory, name), size))
    return h.hexdigest()


def files_digest(directory: str) -> Optional[str]:
    """Digest of the weight and config files directly in ``directory``; None if unreadable.

    Cached per directory while no file's size or modification time changes.
    """
    try:
        stamp = []
        for name in sorted(os.listdir(directory)):
            full = os.path.join(directory, name)
            if name.endswith(_WEIGHT_SUFFIXES) and os.path.isfile(full):
                st = os.stat(full)
                stamp.append((name, st.st_size, st.st_mtime_ns))
        if not stamp:
            return None
        return _dir_digest(directory, tuple(stamp))
    except OSError as exc:
        logger.warning("LMCacheHMA: cannot read %s to identify it: %s", directory, exc)
        return None


def _local_model_dir(model: str, revision: Optional[str]) -> Optional[str]:
    """The directory holding ``model``'s files: the path itself, or its hub cache snapshot."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(model, "config.json", revision=revision)
    except Exception:
        return None
    return os.path.dirname(config) if isinstance(config, str) else None


def model_identity(model_config, cache_config) -> dict:
    """What identifies the weights and the KV format beyond the model's name."""
    model = model_config.model
    directory = _local_model_dir(model, model_config.revision)
    files = files_digest(directory) if directory else None
    if files is None:
        logger.warning("LMCacheHMA: the files of model %s were not found; its keys name it by "
                       "id and revision only", model)
    return {
        "revision": model_config.revision,
        "code_revision": getattr(model_config, "code_revision", None),
        "quantization": model_config.quantization,
        "dtype": str(model_config.dtype),
        "hf_overrides": _overrides_key(model_config.hf_overrides),
        "cache_dtype": str(cache_config.cache_dtype),
        "files": files,
    }


def _overrides_key(overrides) -> Optional[str]:
    """``hf_overrides`` as the same text in every process: a dict as JSON, a function by what it
    does (``callable_identity``: code, defaults, closure, globals; vLLM gives speculative draft
    models one, often a ``partial`` over the target's), per process where that has no stable
    description."""
    if not overrides:
        return None
    if isinstance(overrides, dict):
        return json.dumps(overrides, sort_keys=True, default=repr)
    if callable(overrides):
        return "callable:" + callable_key(overrides)
    return repr(overrides)


class UncacheableRequest(Exception):
    """The request's inputs cannot be identified (e.g. unreadable LoRA files)."""


def _lora_key(lora_request) -> tuple:
    digest = files_digest(lora_request.lora_path) if lora_request.lora_path else None
    if digest is None:
        raise UncacheableRequest(
            f"LoRA adapter {lora_request.lora_name!r}: no readable adapter files at "
            f"{lora_request.lora_path!r}")
    return ("lora", lora_request.lora_name, digest)


def chunk_extra_keys(request, num_chunks: int, chunk_size: int) -> list[Optional[tuple]]:
    """Per chunk, what besides its tokens changes its KV (None: nothing).

    Raises ``UncacheableRequest`` when an input cannot be identified.
    """
    return chunk_extra_keys_from(request, 0, num_chunks, chunk_size, request_lora_key(request), 0)[0]


def request_lora_key(request) -> Optional[tuple]:
    """The request's LoRA adapter as it goes into extra keys (None: no adapter).

    Raises ``UncacheableRequest`` when its files cannot be read."""
    return _lora_key(request.lora_request) if request.lora_request else None


def chunk_extra_keys_from(request, first: int, end: int, chunk_size: int, lora: Optional[tuple],
                          mm_index: int) -> tuple[list[Optional[tuple]], int]:
    """``chunk_extra_keys`` of chunks ``[first, end)`` only, and the multimodal index to continue
    from at chunk ``end``: a request's keys extend as its tokens grow. ``mm_index`` is the one
    returned for chunk ``first`` (0 at chunk 0); ``lora`` is ``request_lora_key(request)``."""
    out: list[Optional[tuple]] = []
    for c in range(first, end):
        keys, mm_index = range_extra_keys(request, c * chunk_size, (c + 1) * chunk_size, lora, mm_index)
        out.append(keys)
    return out, mm_index


def range_extra_keys(request, start: int, end: int, lora: Optional[tuple],
                     mm_index: int = 0) -> tuple[Optional[tuple], int]:
    """The extra keys of tokens ``[start, end)`` (vLLM's, with the LoRA adapter named by
    ``lora``, ``request_lora_key``), and the multimodal index to continue from at ``end``
    (``mm_index``: the one for ``start``; 0 always works, it only scans further)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    keys, mm_index = generate_block_hash_extra_keys(request, start, end, mm_index)
    if keys is not None and lora is not None:
        keys = tuple(lora if isinstance(k, tuple) and k and k[0] == "lora" else k for k in keys)
    return keys, mm_index
