"""The self-contained wheel in a fresh root file system (meson test `wheel`).

scripts/wheel builds the wheel (`pip wheel .`, then auditwheel). A minimal Debian made by
mmdebstrap, with nothing but python3 and python3-venv added (no compiler, no -dev package, no
hiredis, OpenSSL 3 only as Python's own, no rdma-core, no UCX, no CUDA), takes it with `pip install
--no-index` into a venv, in a chroot of a mount namespace of its own. There:

- `import kvstash` works, and a Store puts and gets bytes over tcp and over shm through a
  kvstashd of the build tree running outside the chroot (its socket directory mounted in);
- the wheel's own kvstashd (its console script) joins the same cell as a second memory node and
  holds objects; the wheel's CLI reads the cell and moves a file through the data path;
- `kvstash doctor` says the verbs and ucx transports are unavailable and what to install, since
  the root file system has neither library: their absence is not an import error.

Negative control: the same wheel before auditwheel's repair does not import in that root file
system (its shared libraries are missing there), so the check can tell a wheel that carries
what it needs from one that does not.

The root file system is made once and kept as a tar in KVSTASH_ROOTFS_DIR (default
~/.cache/kvstash/rootfs). Exit 77 (skipped), saying why, where the test cannot run: not root (chroot and
mount namespaces), no mmdebstrap or no Debian mirror to make the root file system, or no
packaging tools (scripts/deploy-tools-setup).

Usage: python3 tests/system/deploy/wheel_test.py BUILD_DIR
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
BUILD = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "build"))
ROOTFS_DIR = os.environ.get("KVSTASH_ROOTFS_DIR", os.path.expanduser("~/.cache/kvstash/rootfs"))
ROOTFS_TAR = os.path.join(ROOTFS_DIR, "bookworm-python3.tar")
KVSTASHD = os.path.join(BUILD, "tools", "kvstashd", "kvstashd")
CLI = os.path.join(BUILD, "tools", "kvstash", "kvstash")


def skip(why):
    print(f"wheel_test: skipped: {why}")
    sys.exit(77)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_rootfs():
    """The minimal Debian as a tar, made once (about 40 s and 220 MB)."""
    if os.path.exists(ROOTFS_TAR):
        return
    if shutil.which("mmdebstrap") is None:
        skip("mmdebstrap is not installed (scripts/setup installs it)")
    os.makedirs(ROOTFS_DIR, exist_ok=True)
    part = ROOTFS_TAR + ".part"
    out = subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--include=python3,python3-venv", "bookworm",
                          part], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        skip(f"mmdebstrap could not make a root file system (no Debian mirror?): {out.stderr.strip()[-400:]}")
    os.replace(part, ROOTFS_TAR)


def build_wheels():
    """scripts/wheel: the repaired wheel, and the wheel it repaired (the control)."""
    out = subprocess.run([os.path.join(REPO, "scripts", "wheel")], capture_output=True, text=True, timeout=2400)
    if out.returncode != 0:
        if "deploy-tools-setup" in out.stderr and "did not install" in out.stderr:
            skip(f"the packaging tools did not install: {out.stderr.strip()[-400:]}")
        raise AssertionError(f"scripts/wheel failed:\n{out.stderr[-4000:]}")
    repaired = out.stdout.strip().splitlines()[-1]
    dist = os.path.join(REPO, "build-wheel", "dist")
    (unrepaired,) = [os.path.join(dist, f) for f in os.listdir(dist) if f.endswith(".whl")]
    return os.path.join(REPO, repaired), unrepaired


def check_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for want in ("kvstash/bin/kvstashd", "kvstash/bin/kvstash", "kvstash/__init__.py", "kvstash/vllm_tier.py",
                 "kvstash/lmcache.py"):
        assert want in names, f"{want} is not in {wheel}"
    assert any(n.startswith("kvstash/_native.") for n in names), names
    carried = [os.path.basename(n) for n in names if n.startswith("kvstash.libs/") and not n.endswith("/")]
    for lib in ("libhiredis", "libfmt", "libspdlog", "libxxhash", "libssl", "libcrypto"):
        assert any(c.startswith(lib) for c in carried), f"{lib} is not carried: {carried}"
    for lib in ("libibverbs", "libucp", "libucs", "libcudart", "libcuda."):
        assert not any(c.startswith(lib) for c in carried), f"{lib} is carried, but must be loaded at run time"
    assert "manylinux" in os.path.basename(wheel), wheel
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "kvstashd = kvstash._programs:kvstashd" in entry_points, entry_points
    return carried


class Cell:
    """A redis-server and a kvstashd of the build tree, on loopback, outside the chroot; the
    node's shm socket directory under `shared`, mounted at the same path inside."""

    def __init__(self, shared):
        self.dir = shared
        port = free_port()
        self.url = f"redis://127.0.0.1:{port}/0"
        self.redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait(lambda: subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).returncode == 0)
        self.log = open(os.path.join(shared, "outside.log"), "w")
        self.node = subprocess.Popen([KVSTASHD, "--redis", self.url, "--capacity", "64MiB", "--node-id", "outside",
                                      "--transports", "shm,tcp", "--shm-socket-dir", os.path.join(shared, "shm"),
                                      "--admin", "127.0.0.1:0"], stdout=self.log, stderr=subprocess.STDOUT)
        self.wait(lambda: self.nodes_up() >= 1)

    def nodes(self):
        out = subprocess.run([CLI, "--redis", self.url, "--json", "nodes"], capture_output=True, text=True, timeout=30)
        return json.loads(out.stdout) if out.returncode == 0 else []

    def nodes_up(self):
        nodes = self.nodes()
        nodes = nodes.get("nodes", nodes) if isinstance(nodes, dict) else nodes
        return sum(1 for n in nodes if n.get("state") == "up")

    @staticmethod
    def wait(ready, seconds=30):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.1)
        raise AssertionError("the cell did not come up")

    def stop(self):
        for p in (self.node, self.redis):
            p.kill()
            p.wait(timeout=30)
        self.log.close()


# What runs in the chroot, as /check.py: a Store over each transport, puts and gets.
CHECK = r'''
import json, os, sys
import kvstash
url, transport, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
store = kvstash.Store(url, transports=transport, timeout_ms=10000)
moved = 0
for i in range(16):
    data = os.urandom(256 * 1024 + i)
    store.put(f"{prefix}:{i}", data, ttl_ms=600000)
    assert store.get(f"{prefix}:{i}") == data, f"{prefix}:{i} came back different"
    moved += len(data)
print(json.dumps({"transport": transport, "bytes": moved}))
'''

# The chroot's steps: a venv, the wheel, the checks; the wheel's kvstashd as a second node.
INSIDE = r'''
set -eu
python3 -m venv /venv
/venv/bin/pip install --no-index --no-cache-dir --disable-pip-version-check -q /wheel/{wheel}
/venv/bin/python /check.py {url} tcp before-tcp
/venv/bin/python /check.py {url} shm before-shm
/venv/bin/kvstashd --redis {url} --capacity 64MiB --node-id inside --transports tcp --admin 127.0.0.1:0 \
  >/tmp/inside.log 2>&1 &
node=$!
for i in $(seq 100); do
  [ "$(/venv/bin/kvstash --redis {url} --json nodes | grep -c '"state": "up"')" -ge 2 ] && break
  sleep 0.1
done
/venv/bin/kvstash --redis {url} --json nodes >/out/nodes-before.json
/venv/bin/kvstash --redis {url} drain outside >/dev/null
/venv/bin/python /check.py {url} tcp after-drain
/venv/bin/kvstash --redis {url} --json nodes >/out/nodes-after.json
head -c 1000000 /dev/urandom >/tmp/file
/venv/bin/kvstash --redis {url} put cli:file /tmp/file >/dev/null
/venv/bin/kvstash --redis {url} get cli:file --output /tmp/back >/dev/null
cmp /tmp/file /tmp/back
/venv/bin/kvstash --redis {url} doctor >/out/doctor.txt 2>&1 || true
kill $node
wait $node || true
cp /tmp/inside.log /out/
'''


def chroot(root, script, binds):
    """`script` under /bin/sh in `root`, in a mount namespace of its own (its mounts vanish
    with it): /dev, /proc and each of `binds` (a host directory, at the same path)."""
    mounts = [f"mount --rbind /dev {root}/dev", f"mount -t proc proc {root}/proc"]
    for b in binds:
        os.makedirs(root + b, exist_ok=True)
        mounts.append(f"mount --bind {b} {root}{b}")
    outer = " && ".join(mounts) + f" && exec chroot {root} /bin/sh -c \"$0\""
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", outer, script],
                          capture_output=True, text=True, timeout=600, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})


def main():
    if os.geteuid() != 0:
        skip("chroot and mount namespaces need root")
    for tool in ("unshare", "chroot", "tar"):
        if shutil.which(tool) is None:
            skip(f"{tool} is not installed")
    make_rootfs()
    repaired, unrepaired = build_wheels()
    carried = check_contents(repaired)
    print(f"wheel_test: {os.path.basename(repaired)} carries {', '.join(sorted(carried))}")

    work = tempfile.mkdtemp(prefix="kvstash-wheel-test-")
    root = os.path.join(work, "root")
    shared = os.path.join(work, "shared")
    os.makedirs(root)
    os.makedirs(os.path.join(shared, "shm"))
    cell = None
    try:
        subprocess.run(["tar", "-xf", ROOTFS_TAR, "-C", root], check=True, timeout=300)
        for build_only in ("usr/include/hiredis", "usr/bin/g++", "usr/bin/cc"):
            assert not os.path.exists(os.path.join(root, build_only)), f"the root file system has {build_only}"
        libdirs = [os.path.join(root, d) for d in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu")]
        present = {f for d in libdirs if os.path.isdir(d) for f in os.listdir(d)}
        # (libxxhash is there: apt links it.)
        for lib in ("libhiredis", "libfmt", "libspdlog", "liburing", "libzmq", "libibverbs", "libucp", "libcudart"):
            assert not any(f.startswith(lib) for f in present), f"the root file system has {lib}"
        os.makedirs(os.path.join(root, "wheel", "dist"))
        os.makedirs(os.path.join(root, "out"))
        shutil.copy(repaired, os.path.join(root, "wheel"))
        shutil.copy(unrepaired, os.path.join(root, "wheel", "dist"))
        with open(os.path.join(root, "check.py"), "w") as f:
            f.write(CHECK)

        # The control: the wheel as pip built it, before auditwheel, cannot load there.
        control = chroot(root, "python3 -m venv /control && /control/bin/pip install --no-index -q "
                               f"/wheel/dist/{os.path.basename(unrepaired)} && /control/bin/python -c 'import kvstash'",
                         [])
        assert control.returncode != 0 and "cannot open shared object file" in control.stderr, (
            f"the unrepaired wheel imported in the fresh root file system:\n{control.stdout}\n{control.stderr}")

        cell = Cell(shared)
        started = time.monotonic()
        out = chroot(root, INSIDE.format(wheel=os.path.basename(repaired), url=cell.url), [shared])
        elapsed = time.monotonic() - started
        assert out.returncode == 0, f"in the fresh root file system:\n{out.stdout}\n{out.stderr}\n" + \
            open(os.path.join(shared, "outside.log")).read()[-2000:]
        moved = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        assert [m["transport"] for m in moved] == ["tcp", "shm", "tcp"], out.stdout
        assert all(m["bytes"] >= 16 * 256 * 1024 for m in moved), moved

        def used(path, node_id):
            doc = json.load(open(os.path.join(root, "out", path)))
            nodes = doc.get("nodes", doc) if isinstance(doc, dict) else doc
            (node,) = [n for n in nodes if n.get("id", n.get("node_id")) == node_id]
            return node

        inside_before = used("nodes-before.json", "inside")
        inside_after = used("nodes-after.json", "inside")
        assert inside_before.get("state") == "up", inside_before
        assert inside_after.get("objects", 0) >= 16, (
            f"the wheel's kvstashd took no objects while the other node drained: {inside_after}")
        doctor = open(os.path.join(root, "out", "doctor.txt")).read()
        for transport in ("verbs", "ucx"):
            assert f"{transport} transport unavailable" in doctor, doctor
        assert "install rdma-core" in doctor and "install UCX" in doctor, doctor
        print(f"wheel_test: in a fresh bookworm (python3 and python3-venv only): installed, 3 x 16 objects over "
              f"tcp and shm bit-exact, the wheel's kvstashd took {inside_after.get('objects')} objects, the CLI "
              f"moved a file; {elapsed:.1f} s")
    finally:
        if cell is not None:
            cell.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
