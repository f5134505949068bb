"""The value policy simulated on the capacity traces: what a bounded tier under
``hma_eviction: value`` and ``hma_tail_admission: branch`` keeps and serves, beside the oracle at
the same budget, in seconds instead of ``bench_capacity.py``'s server runs.

The policy is the connector's own class (``store/value_policy.py``), told of puts and reads as
LMCache's tiers tell it; admission, object names, sizes and the hit rule are
``_capacity_oracle``'s (``admit`` with a ``ValueTier``); answers are stand-ins
(``stand_in_answers``), as when the benchmark plans its sizes. What it leaves out: a request's
stores land at once (the connector's land step by step), and nothing is in flight. On the figures
of ``bench_capacity.py`` it reads high by a few hundredths (see benchmarks/RESULTS.md); it is for
comparing policies, the benchmark for the figures.

    python benchmarks/sim_capacity.py [--budgets 19398656,16000000] [--trace chat] [--spare-fill 0]

``--spare-fill``: the tails on speculation (``hma_spare_tail_fill``, by default the connector's
0.5; 0: ``branch`` admission alone).

Prints per trace the stored bytes no exact format can go under (``format_floor``), per trace and
budget the hit tokens of the policy, of the same admission unbounded, and of the oracle, and a
last line ``SIM {json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _capacity_oracle import Realized, Sizes, ValueTier, admit, format_floor, gemma_layout, oracle  # noqa: E402
from _capacity_traces import stand_in_answers, traces  # noqa: E402

from lmcache_hma.config.adapter_keys import ADAPTER_KEYS  # noqa: E402

CHUNK = 256
GOAL = 19398656  # bench_capacity.py's goal size: a third of the RAG trace's chunks and tails


def simulate(budgets: list[int], names: list[str], spare_fill=None) -> dict:
    sizes = Sizes(gemma_layout(chunk=CHUNK))
    out: dict = {}
    for trace in traces():
        if names and trace.name not in names:
            continue
        real = Realized(*trace.realize(stand_in_answers(trace)), CHUNK)
        unbounded = admit(real, sizes, "branch", spare_fill=spare_fill).hit_tokens
        floor = format_floor(real, sizes)
        out[f"{trace.name}@floor"] = round(floor, 3)
        print(f"{trace.name:6} stored bytes / all-layers: any exact format at least {floor:.3f}", flush=True)
        for budget in budgets:
            kept = admit(real, sizes, "branch", tier=ValueTier(sizes, budget), spare_fill=spare_fill)
            best = oracle(real, sizes, budget).hit_tokens
            row = {"policy": kept.hit_tokens, "unbounded": unbounded, "oracle": best,
                   "vs_unbounded": round(kept.hit_tokens / unbounded, 3), "vs_oracle": round(kept.hit_tokens / best, 3),
                   "evictions": kept.evictions}
            out[f"{trace.name}@{budget}"] = row
            print(f"{trace.name:6} {budget / 1e6:6.1f} MB  policy {kept.hit_tokens:7d}  unbounded {unbounded:7d}  "
                  f"oracle {best:7d}  vs unbounded {row['vs_unbounded']:.3f}  vs oracle {row['vs_oracle']:.3f}", flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default=f"{GOAL},16000000", help="tier sizes in bytes, comma-separated")
    ap.add_argument("--trace", default="", help="rag, chat or agent (default: all three)")
    ap.add_argument("--spare-fill", type=float, default=ADAPTER_KEYS["hma_spare_tail_fill"][1],
                    help="also store interval tails while the tier is below this fraction of its budget "
                         "(hma_spare_tail_fill, the connector's default; 0: branch admission alone)")
    args = ap.parse_args(argv)
    res = simulate([int(b) for b in args.budgets.split(",")], [t for t in args.trace.split(",") if t],
                   args.spare_fill or None)
    print("SIM " + json.dumps(res))


if __name__ == "__main__":
    main()
