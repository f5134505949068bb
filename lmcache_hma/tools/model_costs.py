"""What one stored token costs for a model, read from its config.json (``lmcache-hma check --model``).

Contract: ``find_model_file`` finds a model's file in a directory or, for a Hugging Face id, in
the local Hugging Face cache only (``hub_cache_dir``; nothing is downloaded, no weights are
read); ``read_model`` reads config.json into a ``ModelShape`` (each layer FULL, SLIDING, GDN or
the config's own name of a kind the connector does not serve) or raises ``ModelError`` with what
to do; ``costs`` estimates the bytes stored per prompt token by what they are (``Costs``) against
an all-layers connector; ``model_lines`` writes that, and the tokens each tier holds, as
``check_lines.Line`` verdicts.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from lmcache_hma.tools.check_lines import OK, WARN, Line, bytes_text, size_text, tokens_text

if TYPE_CHECKING:
    from lmcache_hma.tools.redis_probe import RemoteResult

TRAILER_BYTES = 128  # every stored object's trailer (core/objects.py)


class ModelError(Exception):
    """The model's config.json cannot be found or read (one line, with what to do)."""


DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1}
GDN_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
FULL, SLIDING, GDN = "full attention", "sliding window", "gated delta net"
_KINDS = {"full_attention": FULL, "sliding_attention": SLIDING}


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it (read now, not at import)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def find_model_file(model: str, filename: str = "config.json") -> Path:
    """``filename`` of ``model``: a directory, or a Hugging Face id already in the local cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        found = path / filename
        if not found.is_file():
            raise ModelError(f"{model}: the directory has no {filename}")
        return found
    if path.is_file() and filename == "config.json" and path.suffix == ".json":
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelError(f"{model}: not a model directory")
    from huggingface_hub import try_to_load_from_cache

    cache = hub_cache_dir()
    try:
        found = try_to_load_from_cache(model, filename, cache_dir=str(cache))
    except Exception as exc:  # e.g. an id that is not one
        raise ModelError(f"{model}: not a model directory, nor a Hugging Face id ({exc})") from None
    if not isinstance(found, str):
        raise ModelError(f"{model}: not a model directory, and its {filename} is not in the Hugging Face cache "
                         f"({cache}); nothing is downloaded here: pass the model's directory, or fetch the file "
                         f"first (huggingface-cli download {model} {filename})")
    return Path(found)


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model's config.json (its text model's)."""

    name: str
    architecture: str
    model_type: str
    layers: tuple  # per layer: FULL, SLIDING, GDN or the config's own name of an unknown kind
    sliding_window: int
    kv_heads: int
    head_dim: int
    dtype: str
    gdn_state_bytes: int = 0  # per gated-delta-net layer: conv state + recurrent state
    max_position_embeddings: Optional[int] = None
    notes: tuple = ()

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def count(self, kind: str) -> int:
        return sum(1 for k in self.layers if k == kind)

    @property
    def unknown(self) -> dict:
        out: dict = {}
        for k in self.layers:
            if k not in (FULL, SLIDING, GDN):
                out[k] = out.get(k, 0) + 1
        return out


def _config_dicts(config_path: Path) -> tuple[dict, dict, str]:
    """(the text model's settings, the whole config.json, how they were read): through
    transformers' config class when it knows the model (it fills in the defaults a config.json
    leaves out, e.g. Gemma-3's head_dim and layer pattern), else the file's own keys."""
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{config_path}: cannot read it as JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{config_path}: not a JSON object")
    try:
        from transformers import AutoConfig  # a local directory: nothing is downloaded

        conf = AutoConfig.from_pretrained(str(config_path.parent), local_files_only=True)
        text = conf.get_text_config().to_dict()
        return text, raw, "transformers"
    except Exception:
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        return text, raw, "config.json"


def _layer_kinds(text: dict, model_type: str) -> tuple[tuple, list]:
    """(the kind of each layer, notes on what was assumed)."""
    n = text.get("num_hidden_layers")
    if not isinstance(n, int) or n <= 0:
        raise ModelError("config.json gives no num_hidden_layers")
    notes: list = []
    types = text.get("layer_types")
    gdn = model_type in GDN_MODEL_TYPES
    if isinstance(types, list) and types:
        if len(types) != n:
            notes.append(f"layer_types names {len(types)} layers, num_hidden_layers {n}: the first {n} counted")
        kinds = []
        for t in types[:n]:
            if t == "linear_attention" and gdn:
                kinds.append(GDN)
            else:
                kinds.append(_KINDS.get(t, str(t)))
        return tuple(kinds), notes
    if model_type.startswith("gemma3"):
        pattern = text.get("sliding_window_pattern") or text.get("_sliding_window_pattern") or 6
        notes.append(f"no layer_types: every {pattern}th layer full attention (sliding_window_pattern)")
        return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)), notes
    if model_type in ("gemma2", "gpt_oss"):
        notes.append("no layer_types: sliding and full attention alternate")
        return tuple(FULL if (i + 1) % 2 == 0 else SLIDING for i in range(n)), notes
    if gdn:
        interval = text.get("full_attention_interval") or 4
        notes.append(f"no layer_types: every {interval}th layer full attention (full_attention_interval)")
        return tuple(FULL if (i + 1) % interval == 0 else GDN for i in range(n)), notes
    if text.get("sliding_window") and text.get("use_sliding_window", True) is not False:
        notes.append("no layer_types: every layer assumed a sliding-window layer (sliding_window is set)")
        return (SLIDING,) * n, notes
    return (FULL,) * n, notes


def read_model(model: str, kv_dtype: Optional[str] = None) -> ModelShape:
    """The shape of ``model`` (a directory or a cached Hugging Face id) from its config.json."""
    config_path = find_model_file(model)
    text, raw, how = _config_dicts(config_path)
    model_type = str(text.get("model_type") or raw.get("model_type") or "")
    kinds, notes = _layer_kinds(text, model_type)
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (text.get("hidden_size") // heads if heads and text.get("hidden_size") else None)
    if not kv_heads or not head_dim:
        raise ModelError(f"{config_path}: no num_key_value_heads / head_dim (nor hidden_size and "
                         f"num_attention_heads) to size the KV cache from")
    given = kv_dtype or str(raw.get("torch_dtype") or raw.get("dtype") or text.get("torch_dtype")
                            or text.get("dtype") or "").replace("torch.", "")
    if kv_dtype:
        if kv_dtype not in DTYPE_BYTES:
            raise ModelError(f"--kv-dtype {kv_dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        dtype = kv_dtype
    elif given in ("bfloat16", "float16"):
        dtype = given
    else:
        dtype = "bfloat16"
        notes.append(f"KV in bfloat16 (the model's dtype is {given or 'not given'}; vLLM serves float32 "
                     f"weights in 16 bits by default; --kv-dtype to change)")
    window = int(text.get("sliding_window") or 0) if SLIDING in kinds else 0
    state = 0
    if GDN in kinds:
        kernel = text.get("linear_conv_kernel_dim") or 4
        kd, vd = text.get("linear_key_head_dim") or 128, text.get("linear_value_head_dim") or 128
        nk, nv = text.get("linear_num_key_heads") or 16, text.get("linear_num_value_heads") or 32
        conv = (kernel - 1) * (kd * nk * 2 + vd * nv) * DTYPE_BYTES[dtype]
        state = conv + nv * kd * vd * 4
        notes.append("recurrent states counted in float32 (vLLM's CPU build keeps them so; a GPU engine keeps "
                     "them in the model's dtype unless --mamba-ssm-cache-dtype float32: about half)")
    if how == "config.json":
        notes.append("read from config.json alone (transformers does not know this model): keys it leaves out "
                     "were not filled in")
    arch = (raw.get("architectures") or [model_type or "?"])[0]
    name = Path(model).name if Path(model).expanduser().is_dir() else model
    return ModelShape(name=name, architecture=str(arch), model_type=model_type, layers=kinds,
                      sliding_window=window, kv_heads=int(kv_heads), head_dim=int(head_dim), dtype=dtype,
                      gdn_state_bytes=state, max_position_embeddings=text.get("max_position_embeddings"),
                      notes=tuple(notes))


def default_interval(shape: ModelShape, chunk: int) -> int:
    """``hma_checkpoint_interval``'s default (``core.layout.checkpoint_interval``): the largest
    window rounded up to whole chunks; one chunk without windows."""
    return max(chunk, -(-shape.sliding_window // chunk) * chunk)


PREFILL_STEP = 2048  # --max-num-batched-tokens assumed for where vLLM hands recurrent states over


@dataclass(frozen=True)
class Costs:
    """Estimated bytes stored per prompt token of long prompts, by what they are, and what each
    prompt adds at its end."""

    full: float
    tails: float
    states: float
    trailers: float
    all_layers: float
    interval: int  # tokens between stored tails
    state_every: int  # tokens between stored states
    tail_bytes: int  # one tail object
    state_bytes: int  # one state object

    @property
    def total(self) -> float:
        return self.full + self.tails + self.states + self.trailers


def costs(shape: ModelShape, chunk: int = 256, interval: int = 0, prefill_step: int = PREFILL_STEP) -> Costs:
    """Per stored token: the full-attention KV of every chunk; a tail (a window of every sliding
    layer's KV) every ``interval`` tokens; a state (every gated-delta-net layer's) where vLLM
    hands one over on a multiple of the interval, which it does only where a prefill step of
    ``prefill_step`` tokens ends; a 128-byte trailer per object. An all-layers connector stores
    every layer's blocks: a sliding layer's as a full one's, and a gated-delta-net layer's state
    page per block, which vLLM sizes to an attention layer's page (about one attention layer's
    KV per token)."""
    interval = interval or default_interval(shape, chunk)
    kv = shape.kv_bytes_per_token_layer
    tail = shape.count(SLIDING) * kv * shape.sliding_window
    state = shape.count(GDN) * shape.gdn_state_bytes
    state_every = math.lcm(interval, max(1, prefill_step)) if state else interval
    full = shape.count(FULL) * kv
    objects = (1 if full else 0) / chunk + (1 if tail else 0) / interval + (1 if state else 0) / state_every
    all_layers = (shape.count(FULL) + shape.count(SLIDING) + shape.count(GDN)) * kv
    return Costs(full, tail / interval, state / state_every, objects * TRAILER_BYTES, all_layers, interval,
                 state_every, tail, state)


def model_lines(shape: ModelShape, cfg, remote: Optional[RemoteResult], prefill_step: int = PREFILL_STEP) -> list:
    lm = cfg.lmcache if cfg is not None else None
    chunk = lm.chunk_size if lm is not None else 256
    c = costs(shape, chunk, cfg.checkpoint_interval if cfg is not None else 0, prefill_step)
    kinds = [f"{shape.count(FULL)} full attention"]
    if shape.count(SLIDING):
        kinds.append(f"{shape.count(SLIDING)} sliding window {shape.sliding_window}")
    if shape.count(GDN):
        kinds.append(f"{shape.count(GDN)} gated delta net ({size_text(shape.gdn_state_bytes)} of state each)")
    kinds += [f"{n} {k}" for k, n in shape.unknown.items()]
    kv = shape.kv_bytes_per_token_layer
    head = (f"{shape.name} ({shape.architecture}): {len(shape.layers)} layers: {', '.join(kinds)}; KV "
            f"{bytes_text(kv)} per token per layer ({shape.kv_heads} KV head{'s' if shape.kv_heads != 1 else ''} x "
            f"{shape.head_dim} x {shape.dtype})")
    parts = [f"full attention {bytes_text(c.full)}"]
    if c.tails:
        parts.append(f"sliding tails {bytes_text(c.tails)} ({shape.count(SLIDING)} layers' {shape.sliding_window}-token "
                     f"window every {c.interval} tokens)")
    if c.states:
        parts.append(f"recurrent states {bytes_text(c.states)} ({shape.count(GDN)} layers' states every "
                     f"{c.state_every} tokens: where {prefill_step}-token prefill steps end, on the "
                     f"{c.interval}-token interval)")
    parts.append(f"object trailers {bytes_text(c.trailers)}")
    ratio = f" ({c.total / c.all_layers:.2f}x)" if c.all_layers else ""
    details = [f"per stored token (an estimate; chunk_size {chunk}): " + " + ".join(parts)
               + f" = {bytes_text(c.total)}; an all-layers connector: {bytes_text(c.all_layers)}{ratio}"]
    ends = []
    if c.tail_bytes:
        ends.append(f"up to 2 more tails ({size_text(c.tail_bytes)} each) at its last chunk boundaries")
    if c.state_bytes:
        ends.append(f"a state ({size_text(c.state_bytes)}) at its last block boundary")
    if ends:
        details.append("each prompt adds " + " and ".join(ends) + "; short prompts cost more per token")
    if lm is not None:
        tiers = []
        if lm.local_cpu:
            size = float(lm.max_local_cpu_size) * 2**30
            tiers.append(f"cpu {size_text(size)}: ~{tokens_text(size / c.total)} tokens")
        if lm.local_disk:
            size = float(lm.max_local_disk_size) * 2**30
            tiers.append(f"disk {size_text(size)}: ~{tokens_text(size / c.total)} tokens")
        if lm.remote_url:
            if remote is not None and remote.maxmemory:
                tiers.append(f"redis (maxmemory {size_text(remote.maxmemory)}): ~{tokens_text(remote.maxmemory / c.total)} "
                             f"tokens")
            else:
                tiers.append("redis: maxmemory unknown or unlimited")
        if tiers:
            details.append("capacity (an estimate for long prompts of this model; every object goes to every "
                           "tier): " + "; ".join(tiers))
    details += [f"note: {n}" for n in shape.notes]
    lines = [Line(OK, "model", head, details=details)]
    if shape.unknown:
        lines.append(Line(WARN, "model", f"layer kinds {', '.join(shape.unknown)} are not counted: the connector "
                                         f"serves full-attention, sliding-window and gated-delta-net layers "
                                         f"(Qwen3-Next, Qwen3.5) only and refuses others at start "
                                         f"(docs/models.md)"))
    if not shape.count(SLIDING) and not shape.count(GDN) and not shape.unknown:
        lines.append(Line(WARN, "model", "not a hybrid model: every layer is full attention, so the connector "
                                         "stores what an all-layers connector stores"))
    return lines

