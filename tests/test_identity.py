"""Chunk keys name what produced the KV: adapter, images, salt, embeddings, weights, secret.

Real vLLM ``Request`` objects and vLLM's own extra-key function; no engine.
"""

import os
import shutil

import pytest
import torch

from lmcache_hma.core.identity import UncacheableRequest, chunk_extra_keys, files_digest
from lmcache_hma.core.keys import ChunkHasher, Namespace
from tests.fakes import layout

CHUNK = 8  # fakes.layout's chunk size
TOKENS = list(range(100, 140))  # 5 chunks


def namespace(**kw):
    base = dict(model="tiny", kv_dtype=torch.bfloat16, layout=layout(), kv_layout="LBHNC/test",
                world_size=1, rank=0)
    return Namespace(**{**base, **kw})


def request(tokens=TOKENS, **kw):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request("r", list(tokens), SamplingParams(max_tokens=1), None, **kw)


def hashes(req, ns=None):
    n = req.num_prompt_tokens // CHUNK
    return ChunkHasher(ns or namespace()).chunk_hashes(
        req.all_token_ids[:req.num_prompt_tokens], n, chunk_extra_keys(req, n, CHUNK))


def adapter(path, weights: bytes):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return str(path)


def lora(name, path, int_id=1):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, int_id, path)


def image(identifier, offset, length=12):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def test_lora_adapter_is_named_by_its_files(tmp_path):
    base = hashes(request())
    a1 = hashes(request(lora_request=lora("a", adapter(tmp_path / "a1", b"weights one"))))
    a2 = hashes(request(lora_request=lora("b", adapter(tmp_path / "a2", b"weights two"), 2)))
    assert len({base[0], a1[0], a2[0]}) == 3 and all(x != y for x, y in zip(a1, base))
    # the same adapter copied elsewhere: same keys (deployments share it)
    copy = shutil.copytree(tmp_path / "a1", tmp_path / "elsewhere")
    assert hashes(request(lora_request=lora("a", str(copy)))) == a1
    # the same name and path, other weights behind it: other keys
    os.remove(tmp_path / "a1" / "adapter_model.safetensors")
    adapter(tmp_path / "a1", b"weights three")
    assert hashes(request(lora_request=lora("a", str(tmp_path / "a1"))))[0] != a1[0]


def test_unreadable_adapter_is_never_cached(tmp_path):
    with pytest.raises(UncacheableRequest, match="no readable adapter files"):
        chunk_extra_keys(request(lora_request=lora("gone", str(tmp_path / "missing"))), 5, CHUNK)


def test_cache_salt_separates_every_chunk():
    none, a, a2, b = (hashes(request(cache_salt=s)) for s in (None, "a", "a", "b"))
    assert a == a2
    for other in (none, b):
        assert all(x != y for x, y in zip(a, other))  # the salt is in chunk 0: the chain carries it


def test_images_separate_the_chunks_they_cover_and_after():
    a = hashes(request(mm_features=[image("img-A", offset=10)]))
    b = hashes(request(mm_features=[image("img-B", offset=10)]))
    moved = hashes(request(mm_features=[image("img-A", offset=12)]))
    plain = hashes(request())
    assert a[0] == b[0] == plain[0]  # the chunk before the image is shared
    assert all(x != y for x, y in zip(a[1:], b[1:]))  # tokens 10..21: chunks 1 and 2, then the chain
    assert a[1] != moved[1] and a[1] != plain[1]
    assert hashes(request(mm_features=[image("img-A", offset=10)])) == a


def test_prompt_embeddings_are_in_the_key():
    from vllm import SamplingParams
    from vllm.v1.request import Request

    def embeds_request(seed):
        e = torch.randn(len(TOKENS), 4, generator=torch.Generator().manual_seed(seed))
        return Request("e", None, SamplingParams(max_tokens=1), None, prompt_embeds=e)

    assert hashes(embeds_request(0)) == hashes(embeds_request(0))
    assert all(x != y for x, y in zip(hashes(embeds_request(0)), hashes(embeds_request(1))))


def test_weights_and_secret_change_the_namespace(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\1" * 4096)
    before = files_digest(str(model))
    (model / "model.safetensors").write_bytes(b"\2" * 4096)  # same size, new weights
    after = files_digest(str(model))
    assert before and after and before != after
    seeds = {namespace(identity={"files": d}).seed for d in (before, after)}
    secret = namespace(secret=b"0123456789abcdef-fleet")
    other_secret = namespace(secret=b"0123456789abcdef-other")
    seeds |= {secret.seed, other_secret.seed, namespace().seed}
    assert len(seeds) == 5
    assert len({namespace().fingerprint, secret.fingerprint, other_secret.fingerprint}) == 3
    assert "0123456789abcdef" not in repr(secret)  # never printed


def test_large_weight_files_are_sampled_not_read_whole(tmp_path):
    from lmcache_hma.core import identity

    model = tmp_path / "big"
    model.mkdir()
    size = identity._FULL_READ_BYTES + (8 << 20)
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(size)
    a = files_digest(str(model))
    with open(model / "model.safetensors", "r+b") as f:  # a change in the header ...
        f.write(b"x")
    b = files_digest(str(model))
    with open(model / "model.safetensors", "r+b") as f:  # ... or in the middle (a sampled block)
        f.seek((size - identity._SAMPLE_BYTES) * 16 // (identity._SAMPLES + 1))
        f.write(b"y")
    c = files_digest(str(model))
    assert len({a, b, c}) == 3


def test_callable_hf_overrides_are_named_by_what_they_are_in_every_process():
    """A callable ``hf_overrides`` (vLLM gives a speculative draft one, often a ``partial`` over the
    target's) is named the same in every process, and two that differ never share a key: another
    body under the same name, another function inside the same ``partial``."""
    import functools
    import subprocess
    import sys

    from vllm.config.speculative import SpeculativeConfig

    from lmcache_hma.core.identity import _overrides_key

    def shrink(cfg):
        return cfg

    def grow(cfg):
        cfg.num_hidden_layers += 1
        return cfg

    base = SpeculativeConfig.hf_config_override
    key = _overrides_key(base)
    code = ("from vllm.config.speculative import SpeculativeConfig; "
            "from lmcache_hma.core.identity import _overrides_key; "
            "print(_overrides_key(SpeculativeConfig.hf_config_override))")
    other_process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                   check=True, env={**os.environ, "PYTHONHASHSEED": "7"}).stdout.strip().splitlines()[-1]
    assert other_process == key and "0x" not in key
    composed = SpeculativeConfig._apply_composed_hf_override
    partials = {_overrides_key(functools.partial(composed, f)) for f in (shrink, grow)}
    assert len(partials) == 2  # a partial names what it binds
    same_name = grow.__code__.replace(co_name="shrink", co_qualname=shrink.__qualname__)
    impostor = type(shrink)(same_name, globals())
    impostor.__qualname__ = shrink.__qualname__
    assert _overrides_key(impostor) != _overrides_key(shrink)  # same name, other body


# A user's ``hf_overrides`` module, defined from source text so that it can be defined again in
# another place or another process: each function's behaviour depends on ``THETA``.
OVERRIDES_SOURCE = '''
import functools
THETA = {theta!r}
SCALE = {{"factor": {theta!r}, "kinds": {{"yarn", "linear"}}}}

def closure(theta):
    def override(cfg):
        cfg.rope_theta = theta
        return cfg
    return override

def default(cfg, theta={theta!r}):
    cfg.rope_theta = theta
    return cfg

def keyword_default(cfg, *, theta={theta!r}):
    cfg.rope_theta = theta
    return cfg

def reads_global(cfg):
    cfg.rope_theta = THETA
    return cfg

def reads_helper(cfg):  # through another function, which reads a global and calls itself
    return helper(cfg, 2)

def helper(cfg, n):
    if n:
        return helper(cfg, n - 1)
    cfg.rope_scaling = SCALE
    return cfg

def bound(cfg, theta):
    cfg.rope_theta = theta
    return cfg

def overrides():
    return {{"closure": closure(THETA), "default": default, "keyword_default": keyword_default,
            "reads_global": reads_global, "reads_helper": reads_helper,
            "partial": functools.partial(bound, theta=THETA)}}
'''


def user_module(theta):
    """The user's module, defined afresh under the same name."""
    import types

    module = types.ModuleType("my_hf_overrides")
    exec(OVERRIDES_SOURCE.format(theta=theta), module.__dict__)
    return module


def user_overrides(theta) -> dict:
    return user_module(theta).overrides()


def override_keys(theta) -> dict:
    from lmcache_hma.core.identity import _overrides_key

    return {name: _overrides_key(fn) for name, fn in user_overrides(theta).items()}


def keys_in_another_process(theta, over_an_object=False) -> dict:
    """``override_keys(theta)`` (or the key of ``closure(object())``) in a fresh light process
    with another hash seed."""
    import json
    import subprocess
    import sys

    code = ("import json, sys, types; from lmcache_hma.core.identity import _overrides_key; "
            "m = types.ModuleType('my_hf_overrides'); exec(sys.argv[1], m.__dict__); "
            "fns = {'object': m.closure(object())} if sys.argv[2] == '1' else m.overrides(); "
            "print(json.dumps({k: _overrides_key(f) for k, f in fns.items()}))")
    out = subprocess.run([sys.executable, "-c", code, OVERRIDES_SOURCE.format(theta=theta),
                          str(int(over_an_object))], capture_output=True, text=True, timeout=60,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         env={**os.environ, "PYTHONHASHSEED": "11"})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["closure", "default", "keyword_default", "reads_global",
                                  "reads_helper", "partial"])
def test_callable_hf_overrides_differ_by_the_values_their_code_reads(name):
    """Two deployments whose functions differ only in a closure cell, a default, a keyword-only
    default, a global they read (directly or through another function) or what a ``partial``
    binds never share a key: they build other models, and one would load the other's KV."""
    a, b = override_keys(1e6), override_keys(5e5)
    assert a[name] != b[name]
    assert len(set(a.values())) == len(a)  # and no two of the functions share one


def test_the_same_callable_hf_overrides_get_one_key_in_two_places_and_two_processes():
    """Defined again (another module object, or another process with another hash seed), the same
    code over the same values gets the same key: deployments keep sharing their KV."""
    here = override_keys(1e6)
    assert override_keys(1e6) == here and not any("0x" in k for k in here.values())
    assert keys_in_another_process(1e6) == here


def test_callable_hf_overrides_over_an_undescribable_value_are_keyed_per_process():
    """A closure over an object with no stable description (its repr holds an address) gets a key
    of its own process: never the key of another process, whose object may behave otherwise."""
    from lmcache_hma.core.identity import _overrides_key

    module, one, other = user_module(1e6), object(), object()
    key = _overrides_key(module.closure(one))
    assert _overrides_key(module.closure(one)) == key  # one key in this process
    assert _overrides_key(module.closure(other)) != key
    assert keys_in_another_process(1e6, True) != keys_in_another_process(1e6, True)
