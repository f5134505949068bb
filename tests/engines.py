"""Real vLLM engines (CPU build) for end-to-end tests, with or without the connector.

An engine start costs 20-35 s here: test modules share them with module-scoped
fixtures. Both sides of every comparison run with the same thread settings
(``VLLM_CPU_NUM_OF_RESERVED_CPU``): vLLM's CPU build reserves one more core when a KV connector
is configured (docs/design.md, "Where the threads run").
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

# The legacy VLLM_CPU_KVCACHE_SPACE would override kv_cache_memory_bytes on CPU.
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
KV_CACHE_BYTES = 2**30

LONG_PROMPT = "Hello, how are you?" * 1000 + "Tell me a very long story"  # 6007 tokens
MAX_TOKENS = 10


# Greedy tokens are compared with a run without the connector. The exactness tests run the
# tiny models in float32 (``DTYPE``): two runs that split the same prompt differently (a hit
# computes only the tail; a batch-mate changes the matmul shapes) then differ in the last
# bits of a logit, far below a nat. Where the reference's top-2 log-probabilities are closer
# than ``TIE_TOL``, the next token is decided by rounding: the comparison stops there. A
# wrong KV block moves logits by far more.
DTYPE = "float32"
TIE_TOL = 1e-3
# The recurrent-state (gated delta net) models run only in bf16 on vLLM's CPU build: their
# comparisons against a recompute (another compute split) keep this tolerance, about three
# bf16 steps of a logit near 10 (bf16 noise that depends on batch composition alone flips
# such ties, with or without a connector). Where the split is the same they compare
# exactly (``same_logprobs``). The vLLM servers of test_redis*.py run bf16 too (``same_answer``).
BF16_TIE_TOL = 0.2
# A tie is never accepted before this many tokens agreed: a comparison must compare ...
MIN_COMPARED = 2
# ... except an exact tie (the reference's top-2 log-probabilities equal: its own pick was
# the lower token id) after the first token: nothing can agree or disagree with it. Seen at
# the second token on an Intel Xeon (AMX) machine, test_faults' batch with preemption.
# How often the tie rule decided a comparison: printed at the end of the run, and a run
# where it decided too many fails (conftest.py, ``tie_verdict``).
TIE_STATS = {"comparisons": 0, "ended_at_a_tie": 0}
# A run is judged once it made this many comparisons; it fails when more than this share
# of them ended at a near-tie (an exactness test that mostly stops early decides nothing).
TIE_JUDGED_FROM, TIE_MAX_SHARE = 20, 0.05


def tie_verdict(stats: dict = TIE_STATS) -> Optional[str]:
    """Why the run's comparisons are not trustworthy (too many ended at a tie), or None."""
    n, ties = stats["comparisons"], stats["ended_at_a_tie"]
    if n < TIE_JUDGED_FROM or ties <= TIE_MAX_SHARE * n:
        return None
    return (f"{ties} of {n} greedy comparisons ({ties / n:.0%}) ended at a reference near-tie, more "
            f"than {TIE_MAX_SHARE:.0%}: these exactness tests compared too little to decide")


@dataclass
class Gen:
    tokens: list[int]
    cached: int  # num_cached_tokens: local prefix hit plus connector hit
    margins: list[float]  # top-1 minus top-2 log-probability at each position
    logprobs: list[float] = field(default_factory=list)  # of the chosen token at each position
    # speculative decoding with per_request_spec_decode_metrics="detailed": draft tokens accepted
    # at each verify step
    accepted: list[int] = field(default_factory=list)


def same_greedy(ref: Gen, out: Gen, tol: float = TIE_TOL) -> bool:
    """True if ``out`` follows ``ref`` up to the first position ``ref`` leaves to a near-tie.

    At least ``MIN_COMPARED`` tokens must agree before a tie may end the comparison (one
    before an exact tie).
    """
    TIE_STATS["comparisons"] += 1
    for i, (a, b) in enumerate(zip(ref.tokens, out.tokens)):
        if a != b:
            tie = ref.margins[i] < tol and (i >= MIN_COMPARED or (i >= 1 and ref.margins[i] == 0.0))
            TIE_STATS["ended_at_a_tie"] += tie
            return tie
    return len(ref.tokens) == len(out.tokens)


def same_logprobs(ref: Gen, out: Gen) -> bool:
    """Bit-identical output: the same tokens with the same log-probabilities (both runs
    computed the same positions in the same steps from the same KV and state bytes)."""
    TIE_STATS["comparisons"] += 1
    return ref.tokens == out.tokens and ref.logprobs == out.logprobs and ref.margins == out.margins


def same_answer(ref: tuple, out: tuple, tol: float = BF16_TIE_TOL) -> bool:
    """A server's answer ``out`` = (text, token ids) against a reference answer ``ref`` = (text,
    token ids, margins) computed with another split (cold, or another hit boundary):
    ``same_greedy`` on the tokens, and the same text where every token agrees. The servers of
    test_redis*.py run the tiny model in bf16, hence the default tolerance."""
    ref_text, ref_ids, ref_margins = ref
    text, ids = out
    return same_greedy(Gen(ref_ids, 0, ref_margins), Gen(ids, 0, []), tol) and (ids != ref_ids or text == ref_text)


def diff(ref: Gen, out: Gen) -> str:
    """Where and how ``out`` leaves ``ref`` (for assertion messages)."""
    for i, (a, b) in enumerate(zip(ref.tokens, out.tokens)):
        if a != b:
            return (f"position {i}: {a} vs {b}, ref margin {ref.margins[i]:.4g}, "
                    f"out margin {out.margins[i]:.4g}, cached {ref.cached} vs {out.cached}")
    for i, (a, b) in enumerate(zip(ref.logprobs, out.logprobs)):
        if a != b:
            return f"same tokens; position {i}: log-probability {a!r} vs {b!r}"
    return "same"


def greedy(max_tokens: int = MAX_TOKENS, kv_transfer_params: Optional[dict] = None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(temperature=0, top_p=0.95, max_tokens=max_tokens, logprobs=2, extra_args=extra)


def make_llm(model_dir, lmcache_yaml: Optional[Path] = None, extra: Optional[dict] = None,
             max_num_batched_tokens: int = 2048, dtype: str = DTYPE, **kwargs):
    """An ``LLM`` with the hybrid manager on; with the connector when a YAML is given.

    ``dtype`` is the compute (and KV cache) dtype; the tiny models' weights are stored in
    bf16 and are exact in float32.
    """
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if lmcache_yaml is not None:
        transfer = KVTransferConfig(
            kv_connector="LMCacheHMAConnector",
            kv_connector_module_path="lmcache_hma",
            kv_role="kv_both",
            kv_connector_extra_config={"lmcache_config_file": str(lmcache_yaml), **(extra or {})},
        )
    return LLM(
        model=str(model_dir), dtype=dtype, max_model_len=kwargs.pop("max_model_len", 8192),
        enforce_eager=True, disable_hybrid_kv_cache_manager=False,
        max_num_batched_tokens=max_num_batched_tokens, kv_transfer_config=transfer, seed=0,
        kv_cache_memory_bytes=kwargs.pop("kv_cache_memory_bytes", KV_CACHE_BYTES), **kwargs,
    )


def cached_by_source(llm) -> dict[str, int]:
    """vLLM's own ``vllm:prompt_tokens_cached_by_source`` of this process, by source (the engine
    must run with ``disable_log_stats=False``). Counters add up over the engines a process ran:
    compare before and after."""
    out: dict[str, int] = {}
    for metric in llm.get_metrics():
        if metric.name == "vllm:prompt_tokens_cached_by_source":
            source = metric.labels.get("source", "")
            out[source] = out.get(source, 0) + int(metric.value)
    return out


def source_delta(before: dict, after: dict) -> dict:
    """The tokens each source gained between two ``cached_by_source`` snapshots (non-zero ones)."""
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def shutdown(llm) -> None:
    """Stop an engine's processes now (the connector closes its store)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()


def generate(llm, prompts, max_tokens: int = MAX_TOKENS, kv_transfer_params: Optional[dict] = None) -> list[Gen]:
    """Greedy generation of each prompt, with the margins ``same_greedy`` needs."""
    outs = llm.generate(prompts if isinstance(prompts, list) else [prompts], greedy(max_tokens, kv_transfer_params),
                        use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        margins, chosen = [], []
        for token, lp in zip(c.token_ids, c.logprobs):
            top = sorted((v.logprob for v in lp.values()), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
            chosen.append(lp[token].logprob)
        spec = getattr(c, "spec_decode_metrics", None)
        accepted = list(spec.per_step_accepted) if spec is not None else []
        result.append(Gen(list(c.token_ids), o.num_cached_tokens, margins, chosen, accepted))
    return result


def write_yaml(path: Path, **keys) -> Path:
    """An LMCache YAML with ``keys`` (nested dicts allowed)."""
    import yaml

    path.write_text(yaml.safe_dump(keys))
    return path


def read_stats(path: Path) -> dict:
    return json.loads(Path(path).read_text()) if Path(path).exists() else {}
