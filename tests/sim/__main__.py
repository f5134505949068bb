"""``python -m tests.sim [--seeds N] [--first S] [--steps K] [--redis] [--mutation NAME]``: run
schedules, print each violation with its history, and the figures (schedules per second, events
per schedule, the paths drawn). ``make sim SEEDS=N`` runs this. Exit status 1 on a violation."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

from tests.sim import mutations, simulator
from tests.sim.simulator import Violation, quiet, run


def main(argv=None) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":  # a schedule replays only under one hash seed
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "tests.sim", *(sys.argv[1:] if argv is None else argv)])
    ap = argparse.ArgumentParser(prog="python -m tests.sim")
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--redis", action="store_true", help="start a redis-server and draw Redis into setups")
    ap.add_argument("--mutation", default=None, choices=sorted(mutations.MUTATIONS))
    ap.add_argument("--stop", action="store_true", help="stop at the first violation")
    ap.add_argument("--step-limit", type=float, default=simulator.STEP_LIMIT_S,
                    help="seconds after which a step that still runs is a violation (a hang)")
    args = ap.parse_args(argv)
    simulator.STEP_LIMIT_S = args.step_limit
    quiet()
    paths, failed, events = Counter(), [], 0
    t0 = time.perf_counter()
    with mutations.redis_for_sim(args.redis) as redis, mutations.applied(args.mutation):
        for seed in range(args.first, args.first + args.seeds):
            try:
                r = run(seed, args.steps, redis)
                paths.update(r.paths)
                events += r.events
            except Violation as v:
                failed.append(seed)
                print(v, flush=True)
                if args.stop:
                    break
    dt = time.perf_counter() - t0
    n = args.seeds if not (args.stop and failed) else failed[-1] - args.first + 1
    print(f"{n} schedules in {dt:.1f} s ({n / dt:.2f}/s), {events / max(1, n - len(failed)):.0f} events per "
          f"schedule, {len(failed)} violations{': seeds ' + ' '.join(map(str, failed)) if failed else ''}")
    print("paths drawn: " + ", ".join(f"{k} {v}" for k, v in sorted(paths.items())))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
