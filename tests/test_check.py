"""``lmcache-hma check`` (lmcache_hma/tools/check.py): one line per check, against real tiers.

Real ``redis-server`` processes on loopback (tests/redis_server.py): a running Redis, one with
limits set, one with CONFIG renamed, a Redis Cluster, a stopped one, a hung one (SIGSTOP), one
with a password given wrong or not at all. The disk tier's directory: a path under a file, a
new path (created and removed again), an existing private one. A model's bytes per token: the
tiny Gemma-3 built by ``build_tiny_model`` and config.json files of the served families (read
through transformers' config classes, as real checkpoints leave keys out). No vLLM engine.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from lmcache_hma.tools import check
from tests.redis_server import CONFIGS, MISSING, LocalRedisCluster, RedisServer, free_port, redis_server_binary

TIMEOUT = 0.5  # hma_remote_timeout_s where a test times the check


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """Import LMCache and torch once (load_config's first call), so that timings below are the checks'."""
    check.load(str(CONFIGS / "cpu.yaml"))


def run(capsys, *args) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    rc = check.main([str(a) for a in args])
    elapsed = time.monotonic() - t0
    out, err = capsys.readouterr()
    return rc, out, err, elapsed


def lines_of(out: str, verdict: str, what: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith(f"{verdict:<4} {what}: ")]


def write_yaml(path: Path, **keys) -> Path:
    path.write_text(yaml.safe_dump(keys))
    return path


def need_redis():
    if redis_server_binary() is None:
        pytest.fail(MISSING)


# -- Redis ------------------------------------------------------------------------------------
def test_running_redis_passes_with_maxmemory_and_policy_read_back(redis_server, redis_yaml, tmp_path, capsys):
    rc, out, _, _ = run(capsys, "--config", redis_yaml(redis_server.url))
    assert rc == 0, out
    assert lines_of(out, "OK", "config") and lines_of(out, "OK", "cpu")
    assert any(f"Redis at 127.0.0.1:{redis_server.port} answered PING" in ln and "deadline 2 s" in ln
               for ln in lines_of(out, "OK", "redis")), out
    # a default redis-server: no limit, noeviction: a warning with the fix, not a failure
    (warn,) = lines_of(out, "WARN", "redis")
    assert "maxmemory 0 (no limit), maxmemory-policy noeviction" in warn and "allkeys-lru" in warn
    assert out.splitlines()[-1] == "0 FAIL, 1 WARN"

    limited = RedisServer(workdir=tmp_path / "limited",
                          extra_args=["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lfu"]).start()
    try:
        rc, out, _, _ = run(capsys, "--config", redis_yaml(limited.url))
    finally:
        limited.stop()
    assert rc == 0 and not lines_of(out, "WARN", "redis"), out
    assert "OK   redis: maxmemory 64 MiB, maxmemory-policy allkeys-lfu" in out.splitlines()


def test_config_command_renamed_is_a_warning_and_info_memory_answers(redis_yaml, tmp_path, capsys):
    need_redis()
    server = RedisServer(workdir=tmp_path / "r", extra_args=["--rename-command", "CONFIG", "",
                                                             "--maxmemory", "32mb", "--maxmemory-policy",
                                                             "allkeys-lfu"]).start()
    try:
        rc, out, _, _ = run(capsys, "--config", redis_yaml(server.url))
    finally:
        server.stop()
    assert rc == 0, out
    (warn,) = lines_of(out, "WARN", "redis")
    assert "not read back with CONFIG GET" in warn and "CONFIG is disabled or renamed" in warn
    assert "OK   redis: maxmemory 32 MiB, maxmemory-policy allkeys-lfu (read from INFO memory)" in out.splitlines()


def test_redis_cluster_passes_and_a_missing_password_fails(redis_yaml, tmp_path, capsys):
    need_redis()
    cluster = LocalRedisCluster(tmp_path / "cluster", masters=3, replicas=0, password="cluster-pw-123").start()
    try:
        rc, out, _, _ = run(capsys, "--config", redis_yaml(cluster.url))
        assert rc == 0, out
        (ok,) = [ln for ln in lines_of(out, "OK", "redis") if "Redis Cluster" in ln]
        assert "cluster_state ok, 3 masters answered PING" in ok and "authenticated" in ok
        assert any("on each master" in ln for ln in lines_of(out, "WARN", "redis")), out  # maxmemory of each

        rc, out, _, elapsed = run(capsys, "--config", redis_yaml(cluster.plain_url,
                                                                extra_config={"hma_remote_timeout_s": TIMEOUT}))
        assert rc == 1
        (fail,) = lines_of(out, "FAIL", "redis")
        assert "authentication failed at Redis Cluster" in fail and "redis-cluster://" in fail
    finally:
        cluster.stop()


def test_stopped_redis_fails_at_once_with_a_clear_line(redis_server, redis_yaml, capsys):
    redis_server.stop()  # its port stays reserved: nothing listens there
    rc, out, _, elapsed = run(capsys, "--config", redis_yaml(redis_server.url,
                                                            extra_config={"hma_remote_timeout_s": TIMEOUT}))
    assert rc == 1
    (fail,) = lines_of(out, "FAIL", "redis")
    assert f"Redis at 127.0.0.1:{redis_server.port} is unreachable" in fail and "start it" in fail
    assert elapsed < TIMEOUT + 1.0, elapsed
    assert out.splitlines()[-1].startswith("1 FAIL")


def test_hung_redis_fails_within_the_deadline(redis_server, redis_yaml, capsys):
    redis_server.pause()  # SIGSTOP: the kernel accepts connections, nothing answers
    try:
        rc, out, _, elapsed = run(capsys, "--config", redis_yaml(redis_server.url,
                                                                extra_config={"hma_remote_timeout_s": TIMEOUT}))
    finally:
        redis_server.resume()
    assert rc == 1
    (fail,) = lines_of(out, "FAIL", "redis")
    assert f"did not answer within {TIMEOUT:g} s (hma_remote_timeout_s)" in fail
    assert TIMEOUT * 0.9 < elapsed < TIMEOUT + 1.5, elapsed


def test_bad_or_missing_password_says_authentication_failed(redis_yaml, tmp_path, capsys):
    need_redis()
    server = RedisServer(password="the-right-one", workdir=tmp_path / "r").start()
    try:
        rc, out, _, _ = run(capsys, "--config", redis_yaml(server.url))
        assert rc == 0, out
        assert any("authenticated" in ln for ln in lines_of(out, "OK", "redis")), out
        for url in (f"redis://:wrong@127.0.0.1:{server.port}", server.plain_url):
            rc, out, _, _ = run(capsys, "--config", redis_yaml(url))
            assert rc == 1
            (fail,) = lines_of(out, "FAIL", "redis")
            assert "authentication failed" in fail and "password" in fail.split(": ", 2)[2]
            assert "the-right-one" not in out and "wrong" not in fail.split("(")[0]
    finally:
        server.stop()


# -- the configuration, CPU and disk -------------------------------------------------------------
def test_a_bad_configuration_is_one_fail_line(tmp_path, capsys):
    bad = write_yaml(tmp_path / "bad.yaml", chunk_size=256, local_cpu=True, max_local_cpu_size=1, chunk_sise=3)
    rc, out, _, _ = run(capsys, "--config", bad)
    assert rc == 1
    (fail,) = lines_of(out, "FAIL", "config")
    assert "chunk_sise" in fail and str(bad) in fail
    rc, out, _, _ = run(capsys, "--config", CONFIGS / "cpu.yaml", "--extra-config", '{"hma_remote_timeout_s": -1}')
    assert rc == 1 and "kv_connector_extra_config" in lines_of(out, "FAIL", "config")[0]
    rc, out, err, _ = run(capsys, "--config", CONFIGS / "cpu.yaml", "--extra-config", "{not json")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--extra-config" in err


def test_cpu_size_against_the_machine(tmp_path, capsys):
    rc, out, _, _ = run(capsys, "--config", CONFIGS / "cpu.yaml")
    assert rc == 0
    (ok,) = lines_of(out, "OK", "cpu")
    assert "max_local_cpu_size 2 GiB is the CPU tier" in ok and "available" in ok
    huge = write_yaml(tmp_path / "huge.yaml", chunk_size=256, local_cpu=True, max_local_cpu_size=1 << 20)
    rc, out, _, _ = run(capsys, "--config", huge)
    assert rc == 1
    (fail,) = lines_of(out, "FAIL", "cpu")
    assert "max_local_cpu_size 1048576 GiB" in fail and "lower max_local_cpu_size" in fail


def disk_yaml(path: Path, disk: Path) -> Path:
    return write_yaml(path, chunk_size=256, local_cpu=False, max_local_cpu_size=0.5,
                      local_disk=f"file://{disk}/", max_local_disk_size=1)


def test_disk_directory_under_a_file_fails(tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a directory")
    target = tmp_path / "a_file" / "disk"
    rc, out, _, _ = run(capsys, "--config", disk_yaml(tmp_path / "d.yaml", target))
    assert rc == 1
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1 and str(target) in fails[0] and "a_file" in fails[0], out


def test_disk_directory_is_probed_with_its_mode(tmp_path, capsys):
    new = tmp_path / "new" / "disk"
    rc, out, _, _ = run(capsys, "--config", disk_yaml(tmp_path / "d.yaml", new))
    assert rc == 0, out
    (ok,) = lines_of(out, "OK", "disk")
    assert "not there yet: created with mode 0700" in ok and "probe file was written and removed" in ok
    assert not (tmp_path / "new").exists()  # what the check created is gone again

    there = tmp_path / "there"
    there.mkdir(mode=0o700)
    (there / "kept.pt").write_bytes(b"x")
    rc, out, _, _ = run(capsys, "--config", disk_yaml(tmp_path / "d.yaml", there))
    assert rc == 0, out
    (ok,) = lines_of(out, "OK", "disk")
    assert "mode 0700" in ok and "this user" in ok
    assert sorted(os.listdir(there)) == ["kept.pt"]  # the probe file is gone, nothing else touched


# -- a model's bytes per token ------------------------------------------------------------------
def test_tiny_model_bytes_per_token_on_a_cpu_yaml(capsys):
    from lmcache_hma.testing.tiny_model import build_tiny_model

    model = build_tiny_model("tiny-gemma3")  # S,S,F,S,S,F; window 128; 1 KV head of 64; bf16
    rc, out, _, _ = run(capsys, "--config", CONFIGS / "cpu.yaml", "--model", model)
    assert rc == 0, out
    (head,) = lines_of(out, "OK", "model")
    assert "6 layers: 2 full attention, 4 sliding window 128" in head and "256 B per token per layer" in head
    per_token = next(ln for ln in out.splitlines() if "per stored token" in ln)
    # 2 full layers x 256 B; 4 layers' 128-token tails every 256 tokens (the default interval): 512 B;
    # trailers (128 B per object, 2 objects per 256 tokens): 1 B; all-layers: 6 x 256 B
    assert "an estimate" in per_token
    assert "full attention 512 B + sliding tails 512 B" in per_token and "= 1,025 B" in per_token
    assert "an all-layers connector: 1,536 B (0.67x)" in per_token
    capacity = next(ln for ln in out.splitlines() if "capacity" in ln)
    assert "cpu 2 GiB: ~2.10M tokens" in capacity  # 2 GiB / 1,025 B


def write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_layer_kinds_of_the_served_families(tmp_path):
    # Gemma-3 as google/gemma-3-4b-it ships it: the text config leaves out heads, head_dim and the
    # pattern; transformers' defaults fill them in (34 layers, every 6th full attention)
    g3 = check.read_model(str(write_config(tmp_path / "g3", {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
        "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34,
                        "sliding_window": 1024}})))
    assert (g3.count(check.FULL), g3.count(check.SLIDING), g3.sliding_window) == (5, 29, 1024)
    assert (g3.kv_heads, g3.head_dim, g3.dtype) == (4, 256, "bfloat16")
    c = check.costs(g3, 256)
    assert c.interval == 1024 and c.full == 5 * 4096 and c.tails == 29 * 4096  # a window every window
    assert c.all_layers == 34 * 4096

    pattern = ["sliding_attention", "full_attention"] * 12  # gpt-oss: alternating, window 128
    gpt = check.read_model(str(write_config(tmp_path / "gptoss", {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2880,
        "sliding_window": 128, "layer_types": pattern, "torch_dtype": "bfloat16"})))
    assert (gpt.count(check.FULL), gpt.count(check.SLIDING)) == (12, 12)
    c = check.costs(gpt, 256)
    assert c.full == 12 * 2048 and c.tails == 12 * 2048 * 128 / 256 and c.all_layers == 24 * 2048

    # Qwen3-Next without layer_types: every 4th layer full attention, the rest gated delta net
    qn = check.read_model(str(write_config(tmp_path / "qn", {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "hidden_size": 256,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 2, "linear_num_value_heads": 2, "full_attention_interval": 4,
        "torch_dtype": "bfloat16"})))
    assert qn.layers == (check.GDN,) * 3 + (check.FULL,) + (check.GDN,) * 3 + (check.FULL,)
    # conv (3, 768) bf16 + recurrent (2, 128, 128) float32, as tiny_model's Qwen3-Next notes
    assert qn.gdn_state_bytes == 3 * 768 * 2 + 2 * 128 * 128 * 4
    c = check.costs(qn, 256, prefill_step=2048)
    assert c.state_every == 2048 and c.states == 6 * qn.gdn_state_bytes / 2048 and c.tails == 0

    # Qwen3.5 as shipped: the text model under text_config, layer_types with linear_attention
    q35 = check.read_model(str(write_config(tmp_path / "q35", {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 4, "hidden_size": 256,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
                        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "dtype": "bfloat16"}})))
    assert (q35.count(check.GDN), q35.count(check.FULL)) == (3, 1)


def test_model_from_the_hugging_face_cache_never_downloads(tmp_path, monkeypatch, capsys):
    hub = tmp_path / "hub"
    repo = hub / "models--acme--tiny-hybrid"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abc")
    write_config(repo / "snapshots" / "0123abc", {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "hidden_size": 256,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "torch_dtype": "bfloat16"})
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, out, _, _ = run(capsys, "--config", CONFIGS / "cpu.yaml", "--model", "acme/tiny-hybrid")
    assert rc == 0, out
    assert "acme/tiny-hybrid (GptOssForCausalLM): 4 layers: 2 full attention, 2 sliding window 128" in out
    rc, out, _, _ = run(capsys, "--config", CONFIGS / "cpu.yaml", "--model", "acme/not-here")
    assert rc == 1
    (fail,) = lines_of(out, "FAIL", "model")
    assert "not in the Hugging Face cache" in fail and "nothing is downloaded" in fail


def test_unserved_layer_kinds_are_named(tmp_path, capsys):
    model = write_config(tmp_path / "llama4ish", {
        "architectures": ["X"], "model_type": "not_a_known_type", "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
        "layer_types": ["chunked_attention", "full_attention"] * 2, "torch_dtype": "bfloat16"})
    rc, out, _, _ = run(capsys, "--config", CONFIGS / "cpu.yaml", "--model", model)
    assert rc == 0
    (warn,) = lines_of(out, "WARN", "model")
    assert "chunked_attention" in warn and "refuses others at start" in warn


# -- what a configuration leaves to LMCache, and LMCache's environment variables ------------------
@pytest.fixture
def no_lmcache_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("LMCACHE_") and not n.startswith("LMCACHE_HMA_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_an_empty_yaml_says_once_what_lmcaches_defaults_give(tmp_path, capsys, no_lmcache_env):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    rc, out, _, _ = run(capsys, "--config", empty)
    assert rc == 0, out
    (ok,) = lines_of(out, "OK", "config")
    assert f"{empty} is valid (chunk_size 256; tiers: cpu (no tier named: a 5 GiB CPU tier per vLLM worker" in ok
    assert not lines_of(out, "WARN", "config") and out.count("no tier named") == 1, out


def test_lmcaches_environment_variables_are_read_and_named(tmp_path, capsys, no_lmcache_env):
    for name, value in (("LMCACHE_CHUNK_SIZE", "512"), ("LMCACHE_LOCAL_CPU", "True"),
                        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "1")):
        no_lmcache_env.setenv(name, value)
    rc, out, _, _ = run(capsys)
    assert rc == 0 and not lines_of(out, "WARN", "config"), out
    (ok,) = lines_of(out, "OK", "config")
    assert ("LMCACHE_CHUNK_SIZE, LMCACHE_LOCAL_CPU, LMCACHE_MAX_LOCAL_CPU_SIZE from the environment (no YAML) is "
            "valid (chunk_size 512; tiers: cpu)") in ok
    assert "max_local_cpu_size 1 GiB is the CPU tier" in lines_of(out, "OK", "cpu")[0]

    rc, out, _, _ = run(capsys, "--config", CONFIGS / "cpu.yaml")  # over a file: the variables win, said so
    assert rc == 0
    assert f"{CONFIGS / 'cpu.yaml'} with LMCACHE_CHUNK_SIZE, LMCACHE_LOCAL_CPU, LMCACHE_MAX_LOCAL_CPU_SIZE from " \
           f"the environment is valid (chunk_size 512" in lines_of(out, "OK", "config")[0]
    (warn,) = [w for w in lines_of(out, "WARN", "config") if "LMCACHE_CHUNK_SIZE" in w]
    assert "overrides chunk_size: 256 of" in warn
    no_lmcache_env.setenv("LMCACHE_CHUNK_SIZE", "5GB")
    rc, out, _, _ = run(capsys, "--config", CONFIGS / "cpu.yaml")
    assert rc == 1
    (fail,) = lines_of(out, "FAIL", "config")
    assert "the environment variable LMCACHE_CHUNK_SIZE='5GB': chunk_size must be an integer" in fail


def test_a_chunk_size_vllms_default_block_size_does_not_divide_is_a_warning(tmp_path, capsys, no_lmcache_env):
    config = write_yaml(tmp_path / "c.yaml", chunk_size=200, local_cpu=True, max_local_cpu_size=1)
    rc, out, _, _ = run(capsys, "--config", config)
    assert rc == 0
    (warn,) = lines_of(out, "WARN", "config")
    assert "chunk_size 200 is not a multiple of 16, vLLM's default block size" in warn and "e.g. 208" in warn


def test_a_password_with_an_unescaped_hash_is_said_to_need_encoding_not_sent_to_a_wrong_host(tmp_path, capsys):
    config = write_yaml(tmp_path / "c.yaml", chunk_size=256, local_cpu=True, max_local_cpu_size=1,
                        remote_url="redis://:p@ss#word@127.0.0.1:6399", remote_serde="naive")
    rc, out, _, _ = run(capsys, "--config", config)
    assert rc == 1
    (fail,) = lines_of(out, "FAIL", "config")
    assert "percent-encode them as %40 and %23" in fail and "unreachable" not in out and "ss#word" not in out
