"""What Redis keyspace notifications would cost a fleet that announced Redis's own deletes to
its router (docs/fleet.md: Dynamo's index ignores REMOTE entries; for an index that keeps them,
what an instance never sees stays a hint: other instances' deletes, Redis's evictions, expiry).

    python benchmarks/bench_redis_notifications.py [--quick] [--subscribers N]

One throw-away ``redis-server`` per mode, ``maxmemory`` below what is written (``allkeys-lfu``,
as docs/redis.md configures it, so Redis evicts while it is written), objects written as the
connector writes them (a metadata key and a value key of a chunk's bytes, pipelined in batches),
``--subscribers`` clients (one per instance of a fleet) each ``PSUBSCRIBE``\\d to every key event
and counting what reaches it. Modes: notifications off (the baseline); ``Exe`` (evictions and
expiry: what an instance cannot see otherwise); ``KEA`` (every event, the writes included).
Per mode (the run of median speed of three, modes interleaved): objects written per second against the
baseline, events delivered per object written, and the eviction events each subscriber received
against the evictions Redis counted.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import OUT_DIR, RedisServer, bench_main, fmt, table  # noqa: E402

VALUE_BYTES = 64 * 1024  # a chunk's bytes (the tiny models' chunks are smaller; a real one's larger)
META_BYTES = 64
BATCH = 16  # objects per pipeline
MODES = (("off", ""), ("evictions, expiry (Exe)", "Exe"), ("every event (KEA)", "KEA"))


def subscribe(port: int, ready, stop, counts) -> None:
    """A client in its own process (as each instance of a fleet would be), subscribed to every key
    event: ``counts`` gets (events, evictions among them) once ``stop`` is set."""
    import redis

    pubsub = redis.Redis(host="127.0.0.1", port=port).pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe("__keyevent@0__:*")
    while pubsub.get_message(timeout=0.1) is not None:
        pass
    ready.set()
    events = evicted = 0
    while not stop.is_set():
        msg = pubsub.get_message(timeout=0.1)
        if msg is not None:
            events += 1
            evicted += msg["channel"].endswith(b":evicted")
    counts.put((events, evicted))


def one_mode(flags: str, objects: int, subscribers: int, log: Path) -> dict:
    server = RedisServer(log)
    try:
        client = server.client()
        client.config_set("maxmemory", str(objects * VALUE_BYTES // 4))  # a quarter fits: evictions
        client.config_set("maxmemory-policy", "allkeys-lfu")
        client.config_set("notify-keyspace-events", flags)
        ctx = multiprocessing.get_context("spawn")
        stop, counts = ctx.Event(), ctx.Queue()
        readies = [ctx.Event() for _ in range(subscribers)]
        procs = [ctx.Process(target=subscribe, args=(server.port, r, stop, counts), daemon=True) for r in readies]
        for p in procs:
            p.start()
        for r in readies:
            r.wait(30)
        value, meta = b"\x5a" * VALUE_BYTES, b"\x01" * META_BYTES
        t0 = time.perf_counter()
        for start in range(0, objects, BATCH):
            pipe = client.pipeline(transaction=False)
            for n in range(start, min(objects, start + BATCH)):
                pipe.set(f"obj{n}metadata", meta)
                pipe.set(f"obj{n}kv_bytes", value)
            pipe.execute()
        seconds = time.perf_counter() - t0
        time.sleep(1.0)  # what is in flight reaches the subscribers
        stop.set()
        got = [counts.get(timeout=30) for _ in procs]
        for p in procs:
            p.join(10)
        evicted = int(client.info("stats")["evicted_keys"])
        return {"objects_per_s": objects / seconds, "events_per_object": sum(e for e, _ in got) / objects,
                "evictions": evicted, "evictions_heard": min((v for _, v in got), default=0),
                "notify": flags or "(none)"}
    finally:
        server.stop()


def run(quick: bool = False, subscribers: int = 3) -> dict:
    objects = 1000 if quick else 4000
    work = OUT_DIR / "redis_notifications"
    work.mkdir(parents=True, exist_ok=True)
    runs: dict = {name: [] for name, _ in MODES}
    for _ in range(1 if quick else 3):  # modes interleaved: a disturbance spreads over all of them
        for name, flags in MODES:
            runs[name].append(one_mode(flags, objects, subscribers, work / f"redis-{flags or 'off'}.log"))
    results = {name: sorted(rs, key=lambda r: r["objects_per_s"])[len(rs) // 2] for name, rs in runs.items()}
    base = results["off"]["objects_per_s"]
    rows = [[name, r["notify"], r["objects_per_s"], fmt(r["objects_per_s"] / base), r["events_per_object"],
             r["evictions"], r["evictions_heard"]] for name, r in results.items()]
    out = {"table": table(["mode", "notify-keyspace-events", "objects/s", "x off", "events per object",
                           "keys evicted", "evictions heard (each subscriber)"], rows),
           "notes": [f"median of {len(runs['off'])}; {objects} objects of {VALUE_BYTES // 1024} KiB (+ {META_BYTES} B metadata), {subscribers} "
                     f"subscribers, maxmemory a quarter of what is written; loopback, 2 shared cores"]}
    for name, key in (("evictions, expiry (Exe)", "exe"), ("every event (KEA)", "all")):
        out[f"notify_{key}_writes_vs_off"] = round(results[name]["objects_per_s"] / base, 3)
        out[f"notify_{key}_events_per_object"] = round(results[name]["events_per_object"], 2)
    return out


if __name__ == "__main__":
    raise SystemExit(bench_main(__doc__, run, "BENCH_REDIS_NOTIFICATIONS", options=(
        ("--subscribers", {"type": int, "default": 3, "help": "clients subscribed (one per instance)"}),)))
