"""The kvstashd container image (deploy/container/build-image), run by podman (meson test
`container`).

The image is built from Debian packages by the recipe (mmdebstrap, then `podman import`), and a
container of it joins a private cell on loopback (host network) as its only memory node:

- it runs as the kvstash user, entry point /usr/bin/kvstashd, as deploy/kubernetes expects;
- a file put through the build tree's CLI comes back byte for byte, and the image's own CLI sees
  the node up;
- `podman stop` (SIGTERM) drains the node and it exits 0; the object it held is gone with it,
  which is the control that the bytes went through the container and nowhere else.

Exit 77 (skipped), saying why, where it cannot run: not root, no podman or mmdebstrap, or no
Debian mirror reachable. On hosts with hybrid cgroups (v1 controllers and a v2 hierarchy, where
crun refuses to start) podman runs with runc and cgroupfs, as an operator there would.

Usage: python3 tests/system/deploy/container_test.py BUILD_DIR
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
BUILD = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "build"))
CLI = os.path.join(BUILD, "tools", "kvstash", "kvstash")
TAG = "localhost/kvstash/kvstashd:test"
NAME = f"kvstash-container-test-{os.getpid()}"


def skip(why):
    print(f"container_test: skipped: {why}")
    sys.exit(77)


def podman():
    """podman, with the runtime and cgroup manager this host can start containers with."""
    hybrid = os.path.ismount("/sys/fs/cgroup/unified")
    if hybrid and shutil.which("runc") is None:
        skip("this host has hybrid cgroups, where crun cannot start containers, and no runc (apt-get install runc)")
    return ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"] if hybrid else ["podman"]


def run(args, timeout=120, check=True):
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_states(url):
    out = run([CLI, "--redis", url, "--json", "nodes"], check=False)
    return {n["id"]: n["state"] for n in json.loads(out.stdout)} if out.returncode == 0 else {}


def wait(ready, what, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def main():
    if os.geteuid() != 0:
        skip("podman needs root here (rootless podman needs subordinate ids this machine may not have)")
    for tool in ("podman", "mmdebstrap"):
        if shutil.which(tool) is None:
            skip(f"{tool} is not installed (scripts/setup installs it)")
    pm = podman()
    built = run([os.path.join(REPO, "deploy", "container", "build-image"), TAG], timeout=900, check=False)
    if built.returncode != 0:
        if any(s in built.stderr for s in ("Failed to fetch", "Temporary failure resolving", "Could not resolve")):
            skip(f"no Debian mirror to build the image from: {built.stderr.strip()[-300:]}")
        raise AssertionError(f"build-image failed:\n{built.stderr[-4000:]}")
    config = json.loads(run(pm + ["image", "inspect", TAG]).stdout)[0]["Config"]
    assert config.get("User") == "kvstash", config
    assert config.get("Entrypoint") == ["/usr/bin/kvstashd"], config

    work = tempfile.mkdtemp(prefix="kvstash-container-test-")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait(lambda: run(["redis-cli", "-p", str(port), "ping"], check=False).returncode == 0, "redis")
        # Lower limits than the host's: this machine may not let the runtime raise them.
        run(pm + ["run", "-d", "--name", NAME, "--network", "host", "--ulimit", "nofile=16384:16384", "--ulimit",
                  "nproc=4096:4096", TAG, "--redis", url, "--capacity", "32MiB", "--node-id", "image", "--transports",
                  "tcp", "--admin", "127.0.0.1:0"])
        wait(lambda: node_states(url).get("image") == "up", "the container's kvstashd to join the cell")
        assert run(pm + ["exec", NAME, "id", "-un"]).stdout.strip() == "kvstash"

        src, back = os.path.join(work, "src"), os.path.join(work, "back")
        with open(src, "wb") as f:
            f.write(os.urandom(3_000_000))
        run([CLI, "--redis", url, "put", "image:file", src])
        run([CLI, "--redis", url, "get", "image:file", "--output", back])
        assert open(src, "rb").read() == open(back, "rb").read(), "the file came back different"
        seen = run(pm + ["run", "--rm", "--network", "host", "--ulimit", "nofile=1024:1024", "--ulimit",
                         "nproc=1024:1024", "--entrypoint", "/usr/bin/kvstash", TAG, "--redis", url, "--json",
                         "nodes"])
        (node,) = json.loads(seen.stdout)
        assert node["id"] == "image" and node["state"] == "up" and node["objects"] == 1, node

        started = time.monotonic()
        run(pm + ["stop", "-t", "30", NAME], timeout=60)
        stopped = time.monotonic() - started
        code = run(pm + ["inspect", NAME, "--format", "{{.State.ExitCode}}"]).stdout.strip()
        assert code == "0", f"kvstashd exited {code} on SIGTERM:\n{run(pm + ['logs', NAME]).stderr[-2000:]}"
        assert node_states(url).get("image") != "up", node_states(url)
        gone = run([CLI, "--redis", url, "get", "image:file", "--output", back], check=False)
        assert gone.returncode != 0, "the object outlived the only node that held it"
        print(f"container_test: {TAG} ({config.get('Labels', {}).get('org.opencontainers.image.version')}): "
              f"joined, 3 MB put and got back, stopped and drained in {stopped:.1f} s")
    finally:
        subprocess.run(pm + ["rm", "-f", NAME], capture_output=True, timeout=60)
        subprocess.run(pm + ["rmi", "-f", TAG], capture_output=True, timeout=60)
        redis.kill()
        redis.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
