#!/usr/bin/env python3
"""Peer transfer engines, measured the way `kvstash-bench p2p` measures kvstash.

`kvstash-bench peers` runs this with the python of the venv that scripts/peers-setup makes; it is
never part of the build. As the initiator it spawns itself as the target (a second process on
this host, loopback), and per request size: writes random bytes into the target's buffer, reads
them back into the zeroed local buffer and compares (the row's "verified"), then repeats one
synchronous WRITE, then READ, of that many bytes for --seconds (one thread, batch depth 1, like
`p2p --threads 1 --depth 1`). Both buffers are private DRAM of the largest size.

Prints one JSON object per row on stdout:
  {"engine", "op", "size", "gbps", "p50_us", "p99_us", "verified", "compare_with", "cpu_us_per_op"}
("cpu_us_per_op": both processes' CPU, every thread, per request).
or {"engine", "error"} (one line why) when the engine cannot be imported, started or run here.
"compare_with" names the kvstash transport that moves bytes the same way.

Engines:
  mooncake-tcp  Mooncake's transfer engine, tcp protocol, P2P handshake (no metadata server)
  nixl-ucx      NIXL's UCX backend as UCX chooses (on one host: cma, a kernel copy between the
                two processes, so it is compared with kvstash's shm)
  nixl-ucx-tcp  the same with UCX_TLS=tcp
  mooncake-rdma Mooncake's transfer engine, rdma protocol (verbs), each process on its own RDMA
                device: for the Soft-RoCE lane, whose guest has rxe0 and rxe1 on a veth pair
                (KVSTASH_PEER_RDMA: "ADDR/DEVICE,ADDR/DEVICE" for the initiator and the target)
  nixl-ucx-rc   NIXL's UCX backend with UCX_TLS=rc_verbs on those devices
"""

import argparse
import ctypes
import json
import math
import mmap
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

STEP_SECONDS = 60  # longest any one step (start, connect, one transfer) may take

# The rows go to a copy of stdout; the engines' own chatter (some log to stdout) goes to stderr.
_rows = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
_rows_lock = threading.Lock()


def emit(row):
    with _rows_lock:
        _rows.write(json.dumps(row) + "\n")
        _rows.flush()


class PeerError(Exception):
    pass


class Mooncake:
    name, compare_with = "mooncake-tcp", "tcp"

    def __init__(self, role):
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        # "P2PHANDSHAKE": peers find each other by host:port, no etcd or metadata server.
        if self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise PeerError("TransferEngine.initialize(tcp, P2PHANDSHAKE) failed")

    def register(self, addr, length):
        if self.te.register_memory(addr, length) != 0:
            raise PeerError(f"register_memory of {length} bytes failed")

    def describe(self):
        return {"session": f"127.0.0.1:{self.te.get_rpc_port()}"}

    def connect(self, target):
        self.session = target["session"]

    def close(self):
        pass

    def prepare(self, op, local, remote, size):
        call = self.te.transfer_sync_write if op == "write" else self.te.transfer_sync_read
        session = self.session

        def once():
            if call(session, local, remote, size) != 0:
                raise PeerError(f"transfer_sync_{op} of {size} bytes failed")

        return once


def rdma_endpoint(role):
    """The (address, device) this process of the pair uses in the RDMA rows."""
    pairs = os.environ.get("KVSTASH_PEER_RDMA", "192.168.77.1/rxe0,192.168.77.2/rxe1").split(",")
    addr, _, device = pairs[0 if role == "initiator" else 1].partition("/")
    return addr, device


class MooncakeRdma(Mooncake):
    name, compare_with = "mooncake-rdma", "verbs"

    def __init__(self, role):
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        self.addr, device = rdma_endpoint(role)
        if self.te.initialize(self.addr, "P2PHANDSHAKE", "rdma", device) != 0:
            raise PeerError(f"TransferEngine.initialize(rdma, {device}, P2PHANDSHAKE) failed")

    def describe(self):
        return {"session": f"{self.addr}:{self.te.get_rpc_port()}"}


class Nixl:
    name, compare_with, ucx_tls = "nixl-ucx", "shm", None

    def __init__(self, role):
        if self.ucx_tls:
            os.environ["UCX_TLS"] = self.ucx_tls  # read when the UCX backend starts
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(f"kvstash-peer-{role}", nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self.agent.backends:
            raise PeerError("NIXL has no UCX backend here")

    def register(self, addr, length):
        self.registered = self.agent.register_memory([(addr, length, 0, "")], "DRAM")
        self.handles = []

    def describe(self):
        # Taken after register(): the metadata carries the registered memory's keys.
        return {"metadata": self.agent.get_agent_metadata().hex()}

    def connect(self, target):
        self.remote = self.agent.add_remote_agent(bytes.fromhex(target["metadata"]))

    def prepare(self, op, local, remote, size):
        agent = self.agent
        handle = agent.initialize_xfer(
            op.upper(),
            agent.get_xfer_descs([(local, size, 0)], "DRAM"),
            agent.get_xfer_descs([(remote, size, 0)], "DRAM"),
            self.remote,
        )
        self.handles.append(handle)

        def once():
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise PeerError(f"{op} of {size} bytes: {state}")

        return once

    def close(self):
        for handle in self.handles:
            handle.release()
        self.agent.deregister_memory(self.registered)
        self.agent.remove_remote_agent(self.remote)


class NixlTcp(Nixl):
    name, compare_with, ucx_tls = "nixl-ucx-tcp", "tcp", "tcp"


class NixlRc(Nixl):
    name, compare_with, ucx_tls = "nixl-ucx-rc", "verbs", "rc_verbs"

    def __init__(self, role):
        os.environ["UCX_NET_DEVICES"] = rdma_endpoint(role)[1] + ":1"
        super().__init__(role)


ENGINES = {e.name: e for e in (Mooncake, Nixl, NixlTcp, MooncakeRdma, NixlRc)}


class Buffer:
    """Private anonymous memory and its address, for the engines' C APIs."""

    def __init__(self, size):
        self.map = mmap.mmap(-1, size)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))


class Watchdog:
    """Ends the run with an error row when a step overruns: a call blocked inside an engine's C
    code cannot be interrupted from Python, so this thread kills the target and exits."""

    def __init__(self, engine):
        self.engine, self.what, self.seconds, self.deadline = engine, None, 0, None
        self.target, self.target_log = None, None
        threading.Thread(target=self._watch, daemon=True).start()

    def step(self, what, seconds=STEP_SECONDS):
        self.what, self.seconds, self.deadline = what, seconds, time.monotonic() + seconds

    def _watch(self):
        while True:
            time.sleep(0.2)
            if self.deadline is not None and time.monotonic() > self.deadline:
                emit({"engine": self.engine, "error": f"{self.what}: no answer within {self.seconds:g} s"})
                if self.target:
                    self.target.kill()
                    os.unlink(self.target_log)
                os._exit(1)


def parse_size(text):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * scale
    return int(text)


def percentile(values, p):
    """Nearest rank, as kvstash-bench's percentile: with few samples p99 is the slowest one."""
    v = sorted(values)
    return v[min(max(math.ceil(p * len(v)), 1), len(v)) - 1] if v else 0.0


def measure(once, size, seconds):
    lat = []
    start = time.perf_counter()
    end = start + seconds
    while True:
        t0 = time.perf_counter()
        once()
        t1 = time.perf_counter()
        lat.append((t1 - t0) * 1e6)
        if t1 >= end and len(lat) >= 3:
            break
    gbps = len(lat) * size / (t1 - start) / 1e9
    return gbps, round(percentile(lat, 0.5), 1), round(percentile(lat, 0.99), 1), len(lat)


def cpu_seconds(pid="self"):
    """User + system CPU seconds a process (every thread) has used, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def last_line(path):
    with open(path, errors="replace") as f:
        lines = [l.strip() for l in f if l.strip()]
    return lines[-1][:200] if lines else "no output"


def run_target(engine_class, region):
    engine = engine_class("target")
    buf = Buffer(region)
    engine.register(buf.addr, region)
    emit({**engine.describe(), "addr": buf.addr, "length": region})
    sys.stdin.read()  # serve until the initiator closes our stdin (or dies)


def run_initiator(engine_class, sizes, seconds):
    dog = Watchdog(engine_class.name)
    region = max(sizes)
    dog.step("starting the initiator")
    engine = engine_class("initiator")  # first: an engine that cannot load here says so itself
    local = Buffer(region)
    engine.register(local.addr, region)
    log = tempfile.NamedTemporaryFile(prefix="kvstash-peer-target-", suffix=".log", delete=False)
    cmd = [sys.executable, os.path.abspath(__file__), "--engine", engine_class.name, "--target",
           "--region", str(region)]
    dog.step("starting the target")
    target = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
    dog.target, dog.target_log = target, log.name
    try:
        line = target.stdout.readline()
        if not line:
            target.wait()
            raise PeerError(f"the target exited ({target.returncode}): {last_line(log.name)}")
        remote = json.loads(line)
        if remote.get("error"):
            raise PeerError(f"the target: {remote['error']}")
        dog.step("connecting")
        engine.connect(remote)
        for size in sizes:
            dog.step(f"preparing {size}-byte transfers")
            ops = {op: engine.prepare(op, local.addr, remote["addr"], size) for op in ("write", "read")}
            dog.step(f"verifying {size} bytes")
            data = random.randbytes(size)
            local.map[:size] = data
            ops["write"]()
            local.map[:size] = bytes(size)
            ops["read"]()
            verified = local.map[:size] == data
            for op in ("write", "read"):
                row = {"engine": engine_class.name, "op": op, "size": size,
                       "compare_with": engine_class.compare_with, "verified": verified}
                if not verified:
                    row["error"] = "read back differs from what was written"
                else:
                    dog.step(f"{op} of {size} bytes", STEP_SECONDS + seconds)
                    cpu0 = cpu_seconds() + cpu_seconds(target.pid)
                    row["gbps"], row["p50_us"], row["p99_us"], n_ops = measure(ops[op], size, seconds)
                    cpu = cpu_seconds() + cpu_seconds(target.pid) - cpu0
                    if cpu > 0:
                        row["cpu_us_per_op"] = round(cpu * 1e6 / n_ops, 1)
                emit(row)
        dog.step("closing")
        engine.close()
        return 0
    finally:
        dog.step("stopping the target")
        target.stdin.close()
        try:
            target.wait(timeout=10)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()
        os.unlink(log.name)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, choices=sorted(ENGINES))
    p.add_argument("--sizes", default="64KiB,1MiB,16MiB,64MiB", help="bytes, or with KiB/MiB/GiB")
    p.add_argument("--seconds", type=float, default=0.5, help="measuring time per row")
    p.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--region", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    engine_class = ENGINES[args.engine]
    try:
        if args.target:
            run_target(engine_class, args.region)
            return 0
        return run_initiator(engine_class, [parse_size(s) for s in args.sizes.split(",") if s], args.seconds)
    except ImportError as e:
        emit({"engine": args.engine, "error": f"not installed in {sys.prefix} ({e}): run scripts/peers-setup"})
    except Exception as e:  # one line why, whatever the engine raised
        text = " ".join(str(e).split()) or type(e).__name__
        emit({"engine": args.engine, "error": f"{type(e).__name__}: {text}"[:300]})
    return 1


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    # Skip the libraries' destructors: NIXL 1.5.1's wheel crashes in libnl-route's at exit
    # (rtnl_tc_unregister, loaded with UCX's ib module) after all the work is done.
    os._exit(code)
