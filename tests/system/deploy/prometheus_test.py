"""The dashboard and the alerts of docs/monitoring/, checked by a real Prometheus (Debian's).

A private redis-server and a kvstashd with an NVMe tier (a file beside the build) on loopback,
and an engine-side store in this process under load (puts, gets, misses, a KvCache saving and
loading chunks layer by layer) serving its Store.metrics_text on /metrics. Prometheus scrapes
both every second with docs/monitoring/kvstash-rules.yml loaded. Then, through Prometheus' HTTP
API: every query of every panel of kvstash-cell.dashboard.json returns series, every recording
rule returns series, and every rule evaluates without error. `promtool check rules` and
`promtool test rules docs/monitoring/kvstash-rules.test.yml` pass (when each alert fires).

    python3 tests/system/deploy/prometheus_test.py BUILD_DIR

Exit 77 (skipped) when prometheus or promtool is not installed (scripts/setup installs them).
"""

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BUILD = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else "build"
REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
MONITORING = os.path.join(REPO, "docs", "monitoring")
sys.path.insert(0, os.path.join(BUILD, "src", "python"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, check, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {seconds} s")


class Exporter(BaseHTTPRequestHandler):
    """An engine's /metrics: its store's Store.metrics_text."""

    store = None

    def do_GET(self):
        body = self.store.metrics_text().encode() if self.path == "/metrics" else b""
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class DashboardsAndAlerts(unittest.TestCase):
    procs: list = []
    logs: list = []

    @classmethod
    def setUpClass(cls):
        import kvstash

        cls.dir = tempfile.mkdtemp(prefix="kvstash-prometheus-")
        cls.procs, cls.logs = [], []
        redis_port = free_port()
        cls.start(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                   "no", "--dir", cls.dir], "redis.log")
        url = f"redis://127.0.0.1:{redis_port}"
        wait_for("redis", lambda: subprocess.run(["redis-cli", "-u", url, "PING"], capture_output=True,
                                                 text=True).stdout.strip() == "PONG")
        # A node with an NVMe tier beside the build (O_DIRECT works on its file system; a tmpfs
        # /tmp would not), so that the tier's panels have series.
        cls.tier = os.path.join(BUILD, f"prometheus-test-{os.getpid()}.tier")
        node = cls.start([os.path.join(BUILD, "tools", "kvstashd", "kvstashd"), "--redis", url, "--capacity", "32MiB",
                          "--page-size", "1MiB", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0",
                          "--huge-pages", "off", "--transports", "tcp", "--ssd", cls.tier, "--ssd-capacity",
                          "64MiB"], "node.log", stdout=subprocess.PIPE)
        line = node.stdout.readline()
        m = re.search(r"admin=(\S+)", line)
        if not m:
            raise AssertionError(f"kvstashd did not say it was ready: {line!r}\n{cls.log('node.log')}")
        cls.node_admin = m.group(1)
        # The engine's side: a store under load, its metrics served here.
        cls.store = kvstash.Store(url, transports="tcp")
        Exporter.store = cls.store
        cls.exporter = ThreadingHTTPServer(("127.0.0.1", 0), Exporter)
        threading.Thread(target=cls.exporter.serve_forever, daemon=True).start()
        cls.stop_load = threading.Event()
        cls.loader = threading.Thread(target=cls.load, daemon=True)
        cls.loader.start()
        # Prometheus, scraping both every second, the rules evaluated every second.
        cls.prom_port = free_port()
        config = os.path.join(cls.dir, "prometheus.yml")
        with open(config, "w") as f:
            f.write(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - {os.path.join(MONITORING, 'kvstash-rules.yml')}
scrape_configs:
  - job_name: kvstash_nodes
    static_configs: [{{targets: ['{cls.node_admin}']}}]
  - job_name: kvstash_engines
    static_configs: [{{targets: ['127.0.0.1:{cls.exporter.server_address[1]}']}}]
""")
        cls.start(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={cls.dir}/tsdb",
                   f"--web.listen-address=127.0.0.1:{cls.prom_port}"], "prometheus.log")
        wait_for("prometheus ready", lambda: cls.api("/-/ready", raw=True))
        # Both targets up, and a few scrapes of load (rates need two samples in their window).
        wait_for("both targets scraped", lambda: len([t for t in cls.api("/api/v1/targets")["activeTargets"]
                                                      if t["health"] == "up"]) == 2)
        time.sleep(8)

    @classmethod
    def start(cls, argv, log, stdout=None):
        f = open(os.path.join(cls.dir, log), "w")
        cls.logs.append(f)
        p = subprocess.Popen(argv, stdout=stdout or f, stderr=f, text=True, start_new_session=True)
        cls.procs.append(p)
        return p

    @classmethod
    def log(cls, name):
        with open(os.path.join(cls.dir, name)) as f:
            return f.read()[-3000:]

    @classmethod
    def api(cls, path, params=None, raw=False):
        q = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{cls.prom_port}{path}{q}", timeout=10) as r:
                body = r.read().decode()
        except OSError:
            return None
        if raw:
            return body
        doc = json.loads(body)
        assert doc["status"] == "success", doc
        return doc["data"]

    @classmethod
    def load(cls):
        """Puts, gets and misses, and a KvCache saving and loading chunks layer by layer."""
        import kvstash

        rng = random.Random(3)
        layers, blocks, block_size, heads, head_dim = 4, 64, 16, 2, 64
        block_bytes = block_size * heads * head_dim * 2
        a = [bytearray(rng.randbytes(2 * blocks * block_bytes)) for _ in range(layers)]
        b = [bytearray(2 * blocks * block_bytes) for _ in range(layers)]
        common = dict(num_blocks=blocks, block_size=block_size, num_kv_heads=heads, head_dim=head_dim, dtype="fp16",
                      model="prometheus-test", chunk_tokens=16)
        kva, kvb = kvstash.KvCache(cls.store, a, **common), kvstash.KvCache(cls.store, b, **common)
        i = 0
        while not cls.stop_load.is_set():
            i += 1
            try:
                cls.store.put(f"prom:{i % 50}", rng.randbytes(256 << 10))
                cls.store.get(f"prom:{rng.randrange(60)}")  # some miss
            except kvstash.Error:
                pass
            tokens = [rng.randrange(1000) for _ in range(4 * 16)]
            ids = rng.sample(range(blocks), 4)
            try:
                save = kva.begin_save(tokens, ids, 0, 4)
                for layer in range(layers):
                    save.save_layer(layer)
                save.wait()
                load = kvb.begin_load(tokens, rng.sample(range(blocks), 4), 4)
                for layer in range(layers):
                    load.wait_layer(layer)
                load.wait()
            except kvstash.Error:
                pass
            time.sleep(0.02)

    @classmethod
    def tearDownClass(cls):
        cls.stop_load.set()
        if getattr(cls, "loader", None):
            cls.loader.join(timeout=30)
        if getattr(cls, "exporter", None):
            cls.exporter.shutdown()
        for p in reversed(cls.procs):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()
        for f in cls.logs:
            f.close()
        if getattr(cls, "exporter", None):
            cls.exporter.server_close()
        if os.path.exists(getattr(cls, "tier", "")):
            os.unlink(cls.tier)
        shutil.rmtree(cls.dir, ignore_errors=True)

    def query(self, expr):
        return self.api("/api/v1/query", {"query": expr})["result"]

    def test_every_panel_query_returns_series(self):
        with open(os.path.join(MONITORING, "kvstash-cell.dashboard.json")) as f:
            dashboard = json.load(f)
        exprs = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
        self.assertGreaterEqual(len(dashboard["panels"]), 12)
        empty = [f"{title}: {expr}" for title, expr in exprs if not self.query(expr)]
        self.assertEqual(empty, [], "panel queries without series")

    def test_every_rule_evaluates_and_every_signal_returns_series(self):
        groups = self.api("/api/v1/rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        with open(os.path.join(MONITORING, "kvstash-rules.yml")) as f:
            written = len(re.findall(r"^\s+- (record|alert):", f.read(), re.M))
        self.assertEqual(len(rules), written, "Prometheus loaded every rule of the file")
        self.assertEqual([r["name"] for r in rules if r["health"] != "ok"], [],
                         f"rules that failed to evaluate: {[(r['name'], r.get('lastError')) for r in rules]}")
        for r in rules:
            if r["type"] == "recording":
                self.assertTrue(self.query(r["name"]), f"recording rule {r['name']} has no series")
            else:
                # An alert's expression is a threshold over a signal (or `up`): the signal has
                # series here, and the alert is inactive in this healthy cell.
                signal = re.split(r"\s*(?:==|>=|>)\s*", r["query"])[0]
                self.assertTrue(self.query(signal), f"alert {r['name']}: {signal} has no series")
                self.assertEqual(r["state"], "inactive", f"alert {r['name']} fires in a healthy cell")
        # The engine's hit ratio reflects its misses: neither 0 nor 1.
        hit = float(self.query("kvstash:get_hit:ratio_rate5m")[0]["value"][1])
        self.assertGreater(hit, 0.5)
        self.assertLess(hit, 1.0)

    def test_promtool_checks_and_tests_the_rules(self):
        check = subprocess.run(["promtool", "check", "rules", "kvstash-rules.yml"], cwd=MONITORING,
                               capture_output=True, text=True)
        self.assertEqual(check.returncode, 0, check.stdout + check.stderr)
        tested = subprocess.run(["promtool", "test", "rules", "kvstash-rules.test.yml"], cwd=MONITORING,
                                capture_output=True, text=True)
        self.assertEqual(tested.returncode, 0, tested.stdout + tested.stderr)
        self.assertIn("SUCCESS", tested.stdout)


if __name__ == "__main__":
    missing = [b for b in ("prometheus", "promtool", "redis-server") if shutil.which(b) is None]
    if missing:
        print(f"SKIP: {', '.join(missing)} not installed (scripts/setup installs them)")
        sys.exit(77)
    unittest.main(argv=sys.argv[:1] + sys.argv[2:], verbosity=2)
