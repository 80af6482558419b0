"""deploy/systemd checked by the real tools, and kvstashd's side of the unit's Type=notify.

- `systemd-analyze verify` finds nothing to say of deploy/systemd/kvstashd.service (its
  ExecStart pointed at the built kvstashd: verify looks for the binary); the same unit with a
  misspelt value is caught (the check can fail).
- `systemd-analyze security --offline=yes` scores its sandbox at most 2.0 ("OK"); the unit
  without its hardening section scores above (the threshold can fail).
- deploy/kubernetes: every core object valid against Kubernetes' schemas (kubernetes-validate
  --strict; a misspelt field is caught), the PrometheusRule's groups those of
  docs/monitoring/kvstash-rules.yml, every option the DaemonSet gives kvstashd and its preStop
  gives the CLI known to them, the Redis ACL user the operations guide's. No cluster runs here:
  the manifests were never applied.
- kvstashd started from deploy/systemd/kvstashd.conf.example (its cell, addresses and sizes
  replaced by a private Redis and loopback) sends READY=1 to $NOTIFY_SOCKET once it prints
  `ready`, STOPPING=1 on SIGTERM, and exits 0 after its drain.

No systemd runs here (no PID 1 of it): what the service manager does with the unit is not
exercised, only the unit's text and what kvstashd says to it.

    python3 tests/system/deploy/deploy_test.py BUILD_DIR

Exit 77 (skipped) when systemd-analyze is not installed (scripts/setup installs it).
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

BUILD = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else "build"
REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
DEPLOY = os.path.join(REPO, "deploy", "systemd")
KVSTASHD = os.path.join(BUILD, "tools", "kvstashd", "kvstashd")
THRESHOLD = 20  # systemd-analyze security --threshold: exposure 2.0 of 10


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unit_text():
    with open(os.path.join(DEPLOY, "kvstashd.service")) as f:
        return f.read().replace("/usr/bin/kvstashd", KVSTASHD)


class Unit(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvstash-deploy-")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def write(self, text):
        path = os.path.join(self.dir, "kvstashd.service")
        with open(path, "w") as f:
            f.write(text)
        return path

    def analyze(self, *args):
        return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=60,
                              cwd=self.dir)

    def test_verify_finds_nothing_to_say(self):
        r = self.analyze("verify", self.write(unit_text()))
        self.assertEqual((r.returncode, r.stdout + r.stderr), (0, ""))
        # The check can fail: a value systemd cannot parse is reported (and ignored by it).
        bad = self.analyze("verify", self.write(unit_text().replace("ProtectSystem=strict", "ProtectSystem=strickt")))
        self.assertIn("strickt", bad.stdout + bad.stderr)

    def test_sandbox_scores_ok(self):
        r = self.analyze("security", "--offline=yes", f"--threshold={THRESHOLD}", self.write(unit_text()))
        overall = re.search(r"Overall exposure level for kvstashd.service: ([0-9.]+)", r.stdout + r.stderr)
        self.assertIsNotNone(overall, r.stdout + r.stderr)
        self.assertEqual(r.returncode, 0, f"exposure {overall.group(1)} above {THRESHOLD / 10}")
        self.assertLessEqual(float(overall.group(1)), THRESHOLD / 10)
        # The threshold can fail: the unit without its hardening section scores above it.
        bare = unit_text().split("# Hardening.")[0] + "\n[Install]\nWantedBy=multi-user.target\n"
        r = self.analyze("security", "--offline=yes", f"--threshold={THRESHOLD}", self.write(bare))
        self.assertNotEqual(r.returncode, 0, r.stdout[-400:])


K8S = os.path.join(REPO, "deploy", "kubernetes")
VENV = os.environ.get("KVSTASH_DEPLOY_VENV", os.path.expanduser("~/.cache/kvstash/deploy-venv"))
VALIDATOR = os.path.join(VENV, "bin", "kubernetes-validate")
K8S_VERSION = "1.31.0"  # what the manifests are written for (apps/v1, HugePages-2Mi volumes)


def documents(name):
    import yaml  # Debian's python3-yaml, or the validator's venv
    with open(os.path.join(K8S, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


@unittest.skipUnless(os.access(VALIDATOR, os.X_OK), f"no {VALIDATOR} (scripts/deploy-tools-setup installs it)")
class Kubernetes(unittest.TestCase):
    """deploy/kubernetes against Kubernetes' schemas, and against what kvstash itself accepts."""

    def validate(self, path):
        return subprocess.run([VALIDATOR, "--strict", "--no-warn", "-k", K8S_VERSION, path], capture_output=True,
                              text=True, timeout=120)

    def test_core_objects_match_the_schemas(self):
        names = sorted(n for n in os.listdir(K8S) if n.endswith(".yaml"))
        self.assertEqual(names, ["kvstashd.yaml", "monitoring.yaml", "redis-sentinel.yaml", "secrets.example.yaml"])
        for name in names:
            r = self.validate(os.path.join(K8S, name))
            self.assertEqual(r.returncode, 0, f"{name}:\n{r.stdout}{r.stderr}")
        # The check can fail: a misspelt field under --strict.
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            with open(os.path.join(K8S, "kvstashd.yaml")) as src:
                f.write(src.read().replace("hostNetwork: true", "hostNetwrk: true"))
            f.flush()
            self.assertNotEqual(self.validate(f.name).returncode, 0)

    def test_the_rules_are_the_monitoring_rules(self):
        import yaml
        with open(os.path.join(REPO, "docs", "monitoring", "kvstash-rules.yml")) as f:
            groups = yaml.safe_load(f)["groups"]
        kinds = {d["kind"]: d for d in documents("monitoring.yaml")}
        self.assertEqual(kinds["PrometheusRule"]["spec"]["groups"], groups,
                         "monitoring.yaml's PrometheusRule drifted from docs/monitoring/kvstash-rules.yml")
        endpoint = kinds["ServiceMonitor"]["spec"]["endpoints"][0]
        self.assertEqual(endpoint["relabelings"][0]["replacement"], "kvstash_nodes", "the rules' job")
        service = [d for d in documents("kvstashd.yaml") if d["kind"] == "Service"][0]
        self.assertIn(endpoint["port"], [p["name"] for p in service["spec"]["ports"]])

    def test_kvstashd_and_the_cli_know_every_option_given(self):
        daemonset = [d for d in documents("kvstashd.yaml") if d["kind"] == "DaemonSet"][0]
        container = daemonset["spec"]["template"]["spec"]["containers"][0]
        kvstash = os.path.join(BUILD, "tools", "kvstash", "kvstash")

        def options(*argv):
            return set(re.findall(r"(--[a-z][a-z0-9-]*)", subprocess.run(argv, capture_output=True, text=True).stdout))

        for arg in container["args"]:
            self.assertIn(arg.split("=")[0], options(KVSTASHD, "--help"), arg)
        drain = container["lifecycle"]["preStop"]["exec"]["command"]
        self.assertEqual(drain[0], "/usr/bin/kvstash")
        known = options(kvstash, "--help") | options(kvstash, "drain", "--help")
        for arg in drain[1:]:
            if arg.startswith("--"):
                self.assertIn(arg.split("=")[0], known, arg)
        self.assertIn("--move", drain)
        # The Redis URL the node and the drain use is one the sentinels' Service serves.
        url = [a for a in container["args"] if a.startswith("--redis=")][0]
        self.assertIn(url, drain)
        self.assertRegex(url, r"^--redis=redis\+sentinel://kvstash@redis-sentinel\.kvstash\.svc:26379/kvstash/0$")

    def test_the_redis_user_may_run_what_the_operations_guide_lists(self):
        script = [d for d in documents("redis-sentinel.yaml") if d["kind"] == "ConfigMap"][0]["data"]["start-redis.sh"]
        acl = re.search(r"user kvstash on .*", script).group(0).rstrip('"')  # an echo's line
        with open(os.path.join(REPO, "docs", "operations.md")) as f:
            recipe = re.search(r"ACL SETUSER kvstash reset on \S+ \S+ (.*)", f.read()).group(1)
        self.assertEqual(set(re.findall(r"[+-]\S+", acl)) - {"-@all"}, set(re.findall(r"[+-]\S+", recipe)) - {"-@all"})
        self.assertIn("~kvs:{kvs:default}*", acl)


class Notify(unittest.TestCase):
    """kvstashd under a stand-in service manager: a datagram socket named by $NOTIFY_SOCKET."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvstash-notify-")
        self.procs = []
        port = free_port()
        self.start(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        deadline = time.monotonic() + 20
        while subprocess.run(["redis-cli", "-p", str(port), "PING"], capture_output=True).stdout.strip() != b"PONG":
            self.assertLess(time.monotonic(), deadline, "redis-server did not start")
            time.sleep(0.1)
        self.redis = f"redis://127.0.0.1:{port}/0"

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def start(self, argv, **kw):
        p = subprocess.Popen(argv, stdout=kw.pop("stdout", subprocess.DEVNULL), stderr=subprocess.DEVNULL,
                             start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def config(self):
        """The example configuration, pointed at this test's Redis and loopback."""
        with open(os.path.join(DEPLOY, "kvstashd.conf.example")) as f:
            text = f.read()
        token = os.path.join(self.dir, "cluster-token")
        with open(token, "w") as f:
            f.write("a cluster token of the notify test\n")
        os.chmod(token, 0o600)
        replace = {"redis": self.redis, "redis-password-file": None, "capacity": "16MiB", "page-size": "1MiB",
                   "huge-pages": "off", "transports": "shm,tcp", "listen": "127.0.0.1:0",
                   "cluster-token-file": token, "admin": "127.0.0.1:0"}
        lines = []
        for line in text.splitlines():
            key = line.split("=")[0].strip()
            if key in replace:
                if replace[key] is None:
                    continue
                line = f'{key} = "{replace[key]}"'
            lines.append(line)
        self.assertTrue(all(f"\n{k} =" in "\n" + "\n".join(lines) for k, v in replace.items() if v),
                        "the example lost an option this test sets")
        path = os.path.join(self.dir, "kvstashd.conf")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def test_ready_then_stopping(self):
        manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        path = os.path.join(self.dir, "notify")
        manager.bind(path)
        manager.settimeout(30)
        env = dict(os.environ, NOTIFY_SOCKET=path, XDG_RUNTIME_DIR=self.dir)
        node = self.start([KVSTASHD, "--config", self.config(), "--node-id", "notified"], env=env,
                          stdout=subprocess.PIPE, text=True)
        ready = manager.recv(4096).decode()
        self.assertTrue(ready.startswith("READY=1\n"), ready)
        self.assertIn("STATUS=serving node notified, 16 pages over", ready)
        line = node.stdout.readline()
        self.assertTrue(line.startswith("ready node=notified "), f"READY=1 came before `ready`? {line!r}")
        node.send_signal(signal.SIGTERM)
        stopping = manager.recv(4096).decode()
        self.assertEqual(stopping, "STOPPING=1\nSTATUS=draining")
        self.assertEqual(node.wait(timeout=30), 0)
        manager.close()

    def test_no_socket_no_message_and_a_bad_one_is_said_once(self):
        # Without $NOTIFY_SOCKET kvstashd serves as ever (every other test runs it so); with one
        # nobody listens on, it serves too.
        env = dict(os.environ, NOTIFY_SOCKET=os.path.join(self.dir, "nobody"), XDG_RUNTIME_DIR=self.dir)
        node = self.start([KVSTASHD, "--config", self.config(), "--node-id", "unheard"], env=env,
                          stdout=subprocess.PIPE, text=True)
        self.assertTrue(node.stdout.readline().startswith("ready node=unheard "))
        node.send_signal(signal.SIGTERM)
        self.assertEqual(node.wait(timeout=30), 0)


if __name__ == "__main__":
    if not shutil.which("systemd-analyze"):
        print("SKIP: systemd-analyze is not installed (scripts/setup installs systemd)")
        sys.exit(77)
    if not os.path.exists(KVSTASHD):
        print(f"kvstashd not built: {KVSTASHD}")
        sys.exit(1)
    unittest.main(argv=sys.argv[:1], verbosity=2)
