"""A real ``redis-server`` on 127.0.0.1 for tests: free port, no persistence.

``RedisServer`` starts Debian's ``redis-server`` (installed by ``make setup``) with
``--save "" --appendonly no`` in a private directory, waits until it answers
PING, and stops it afterwards. For fault tests it can be killed with SIGKILL,
paused (SIGSTOP, a hung server) and restarted on the same port (empty again).

``LocalRedisCluster`` starts a Redis Cluster of such servers (``--cluster-enabled yes``,
then ``redis-cli --cluster create``), masters with optional replicas, and says which
node holds which slot, for shard-level fault tests.

``write_redis_yaml`` writes a copy of one of the repository's YAMLs
(``configs/redis.yaml``, ``configs/cpu_disk_redis.yaml``) with the fixture's URL.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
MISSING = "redis-server not found (Debian package redis-server); run make setup"


def redis_server_binary() -> Optional[str]:
    return shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/local/bin/redis-server") if os.access(p, os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all bound at once while choosing)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 (see module docstring)."""

    def __init__(self, password: Optional[str] = None, port: Optional[int] = None,
                 workdir: Optional[Path] = None, extra_args: Sequence[str] = ()):
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError(MISSING)
        self.binary = binary
        self.password = password
        self.port = port or free_port()
        self._placeholder: Optional[socket.socket] = None
        self._reserve_port()
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="lmcache_hma_redis_"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.extra_args = list(extra_args)
        self.proc: Optional[subprocess.Popen] = None
        self.paused = False

    # URLs --------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``redis://`` URL, with the password when there is one."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    @property
    def plain_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self, **kwargs):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=kwargs.pop("socket_timeout", 5), **kwargs)

    # life cycle ----------------------------------------------------------------
    def _reserve_port(self) -> None:
        """Keep the port while no server listens on it: a socket bound to it, not listening
        (connections to it are still refused, as to a Redis that is down).

        Without it, a test that starts vLLM servers while its Redis is down saw the port taken
        in the meantime (redis-server then exits: "Address already in use"): other processes
        bind to free ports too.
        """
        if self._placeholder is not None:
            return
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", self.port))
        except OSError:  # in use (by a server of ours still going away): nothing to hold
            sock.close()
            return
        self._placeholder = sock

    def _free_port(self) -> None:
        if self._placeholder is not None:
            self._placeholder.close()
            self._placeholder = None

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self._free_port()
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "no",
               "--logfile", str(self.dir / "redis.log")]
        if self.password:
            cmd += ["--requirepass", self.password]
        cmd += self.extra_args
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client(socket_timeout=0.5).ping():
                    return self
            except Exception:
                pass
            if self.proc.poll() is not None:
                log = (self.dir / "redis.log").read_text()[-2000:] if (self.dir / "redis.log").exists() else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout} s")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the server vanishes, with everything it held."""
        if self.alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)
        self._reserve_port()

    def pause(self) -> None:
        """SIGSTOP: a hung server (connections accepted by the kernel, no answers)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def restart(self) -> "RedisServer":
        """Kill (if running) and start again on the same port: an empty Redis."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        if self.alive():
            try:
                self.resume()
            except OSError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._free_port()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalRedisCluster:
    """A Redis Cluster on 127.0.0.1: ``masters`` masters, each with ``replicas`` replicas.

    Every node is a ``RedisServer`` (``nodes[i]``) with its own directory, port and cluster
    bus port (``cluster-port``). ``cluster-require-full-coverage no`` unless ``full_coverage``:
    a shard without an answering master leaves the others serving (with ``yes`` every node
    refuses every command while a shard is lost). ``node_timeout_ms`` is how long a silent
    master takes to be declared failed (its replica then takes over within about a second).
    """

    def __init__(self, workdir: Path, masters: int = 3, replicas: int = 0, password: Optional[str] = None,
                 node_timeout_ms: int = 2000, full_coverage: bool = False):
        self.masters_count, self.replicas = masters, replicas
        self.password = password
        ports = free_ports(2 * masters * (1 + replicas))
        self.nodes: list[RedisServer] = []
        for i in range(masters * (1 + replicas)):
            port, bus = ports[2 * i], ports[2 * i + 1]
            args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-port", str(bus), "--cluster-node-timeout", str(node_timeout_ms),
                    "--cluster-require-full-coverage", "yes" if full_coverage else "no",
                    "--cluster-replica-validity-factor", "0"]
            if password:
                args += ["--masterauth", password]
            self.nodes.append(RedisServer(password=password, port=port, workdir=Path(workdir) / f"node-{port}",
                                          extra_args=args))

    @property
    def url(self) -> str:
        """``redis-cluster://`` URL naming every node as a seed, with the password when there is one."""
        auth = f":{self.password}@" if self.password else ""
        return "redis-cluster://" + auth + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def plain_url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 60.0) -> "LocalRedisCluster":
        cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
        if not os.access(cli, os.X_OK):
            raise RuntimeError("redis-cli not found (Debian package redis-tools, installed with redis-server)")
        for node in self.nodes:
            node.start()
        cmd = [cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
               "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        env = {**os.environ, **({"REDISCLI_AUTH": self.password} if self.password else {})}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if out.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}")
        if not self.wait_healthy(timeout):
            self.stop()
            raise RuntimeError(f"cluster not healthy after {timeout} s: {self.describe()}")
        return self

    # what the cluster looks like ------------------------------------------------
    def alive_nodes(self) -> list[RedisServer]:
        """Nodes running and not paused."""
        return [n for n in self.nodes if n.alive() and not n.paused]

    def cluster_nodes(self) -> dict:
        """``CLUSTER NODES`` as seen by the first live node that answers: {port: redis-py's entry}.

        An entry has ``flags`` (a set here: master, slave, fail, fail?, ...), ``slots`` (a list
        of [first, last]), ``node_id`` and ``master_id``.
        """
        for node in self.alive_nodes():
            try:
                table = node.client(socket_timeout=1).execute_command("CLUSTER NODES")
            except Exception:
                continue
            return {int(addr.rsplit(":", 1)[1].split("@")[0]): {**e, "flags": set(e["flags"].split(","))}
                    for addr, e in table.items()}
        return {}

    def masters(self) -> list[RedisServer]:
        """Nodes that are masters holding slots and not flagged failed."""
        table = self.cluster_nodes()
        return [n for n in self.nodes if n.port in table and "master" in table[n.port]["flags"]
                and table[n.port]["slots"] and not table[n.port]["flags"] & {"fail", "fail?"}]

    def replicas_of(self, master: RedisServer) -> list[RedisServer]:
        table = self.cluster_nodes()
        mid = table[master.port]["node_id"]
        return [n for n in self.nodes if n.port in table and table[n.port]["master_id"] == mid]

    def keyslot(self, key) -> int:
        return int(self.alive_nodes()[0].client().execute_command("CLUSTER KEYSLOT", key))

    def node_for_slot(self, slot: int) -> Optional[RedisServer]:
        """The master serving ``slot`` (None when none is)."""
        table = self.cluster_nodes()
        for node in self.masters():
            if any(int(lo) <= slot <= int(hi) for lo, hi in table[node.port]["slots"]):
                return node
        return None

    def keys_by_node(self) -> dict[int, list[bytes]]:
        """Every key on every live master: {port: keys}."""
        return {n.port: n.client().keys("*") for n in self.masters() if n in self.alive_nodes()}

    def dbsize(self) -> int:
        return sum(len(keys) for keys in self.keys_by_node().values())

    def describe(self) -> str:
        return "; ".join(f"{p}: {','.join(sorted(e['flags']))} {e['slots']}"
                         for p, e in sorted(self.cluster_nodes().items()))

    def healthy(self) -> bool:
        """Every live node says cluster_state:ok and the live masters cover all 16384 slots."""
        masters = self.masters()
        if len(masters) != self.masters_count or not all(m.alive() for m in masters):
            return False
        if not all(_state_ok(node) for node in self.alive_nodes()):
            return False
        if self.replicas:
            for m in masters:
                linked = [r for r in self.replicas_of(m) if r.alive()]
                if len(linked) < self.replicas:
                    return False
                for r in linked:
                    info = r.client(socket_timeout=1).info("replication")
                    if info.get("master_link_status") != "up":
                        return False
        return True

    def wait_healthy(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.healthy():
                    return True
            except Exception:
                pass
            time.sleep(0.2)
        return False

    def wait_settled(self, quiet_s: float, timeout: float = 60.0) -> bool:
        """Until the cluster is healthy and its topology (roles, slots, flags) has not changed for
        ``quiet_s``: a replica may still take over a master that was unreachable for longer than
        the node timeout some seconds after that master answers again."""
        deadline, last, since = time.monotonic() + timeout, None, time.monotonic()
        while time.monotonic() < deadline:
            try:
                now = self.describe() if self.healthy() else None
            except Exception:
                now = None
            if now is None or now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return True
            time.sleep(0.2)
        return False

    def wait_failover(self, dead: RedisServer, timeout: float = 30.0) -> bool:
        """After ``dead`` (a master) stopped answering: wait until live masters serve every slot again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                masters = self.masters()
                if (len(masters) == self.masters_count and dead not in masters and all(m.alive() for m in masters)
                        and all(_state_ok(m) for m in masters)):
                    return True
            except Exception:
                pass
            time.sleep(0.2)
        return False

    def client(self):
        """A redis-py cluster client (decode_responses off)."""
        from redis.cluster import RedisCluster

        return RedisCluster(host="127.0.0.1", port=self.alive_nodes()[0].port, password=self.password,
                            socket_timeout=5)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "LocalRedisCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _state_ok(node: RedisServer) -> bool:
    info = node.client(socket_timeout=1).execute_command("CLUSTER INFO")
    if isinstance(info, bytes):
        info = info.decode()
    if isinstance(info, dict):
        return info.get("cluster_state") == "ok"
    return "cluster_state:ok" in info


def write_redis_yaml(dest: Path, url: str, template: str = "redis.yaml", **overrides) -> Path:
    """A copy of ``configs/<template>`` with ``remote_url`` set to ``url`` (and ``overrides``)."""
    keys = yaml.safe_load((CONFIGS / template).read_text())
    keys["remote_url"] = url
    for key, value in overrides.items():
        if key == "extra_config":
            keys["extra_config"] = {**(keys.get("extra_config") or {}), **value}
        else:
            keys[key] = value
    dest = Path(dest)
    dest.write_text(yaml.safe_dump(keys))
    return dest


# -- pytest fixtures (exposed in tests/conftest.py; test modules may import them too) -----

try:
    import pytest
except ImportError:  # used outside pytest (examples, benchmarks)
    pytest = None

if pytest is not None:

    @pytest.fixture
    def redis_server(tmp_path):
        """A fresh, empty ``RedisServer`` for one test (fails, not skips, without redis-server)."""
        if redis_server_binary() is None:
            pytest.fail(MISSING)
        server = RedisServer(workdir=tmp_path / "redis").start()
        yield server
        server.stop()

    @pytest.fixture(scope="module")
    def module_redis(tmp_path_factory):
        """One ``RedisServer`` for a module's engines (fails, not skips, without redis-server)."""
        if redis_server_binary() is None:
            pytest.fail(MISSING)
        server = RedisServer(workdir=tmp_path_factory.mktemp("redis")).start()
        yield server
        server.stop()

    @pytest.fixture
    def redis_yaml(tmp_path):
        """``redis_yaml(url, template="redis.yaml", **overrides)``: a YAML copy with that URL."""
        count = iter(range(10**6))

        def make(url: str, template: str = "redis.yaml", **overrides) -> Path:
            return write_redis_yaml(tmp_path / f"redis-{next(count)}.yaml", url, template, **overrides)

        return make
