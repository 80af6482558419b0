// kvstash doctor: checks the cell and this host, explains every finding and says how to fix
// what is wrong. Exit 1 when a check failed; warnings (a missing RDMA device on a host that
// has none) do not fail it. It also prints the GPU x NIC matrix (PCIe distance from each GPU to
// each RDMA device) that the verbs transport chooses the NICs for each GPU's memory by.
#include <dlfcn.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <linux/magic.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli.h"
#include "common/cuda_floor.h"
#include "common/pci_topology.h"
#include "common/units.h"
#include "kvstash/engine.h"
#include "kvstash/memory.h"
#include "kvstash_config.h"
#include "metadata/cell.h"
#include "metadata/redis_client.h"
#include "metadata/scripts.h"
#include "node/ssd_device.h"

namespace kvstash::cli {
namespace {

using nlohmann::json;

struct Check {
  std::string name;
  std::string status;  // ok, warn, fail, info
  std::string detail;
  std::string fix;
};

// The PCIe distance from each GPU to each RDMA device, from sysfs (common/pci_topology.h), and
// the devices the verbs transport moves each GPU's memory through (pci::nearest; all of them
// when none is nearer than another).
struct Affinity {
  std::string sysfs;
  std::vector<pci::Address> gpus;  // by PCI address: CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID
  std::vector<std::string> nics;
  std::vector<std::vector<pci::Distance>> distance;  // [gpu][nic]
  std::vector<std::vector<bool>> chosen;             // [gpu][nic]
};

// The sysfs root: /sys, or KVSTASH_SYSFS_ROOT (for tests, which pass a synthetic tree).
std::string sysfs_root() {
  const char* env = std::getenv("KVSTASH_SYSFS_ROOT");
  return env != nullptr && *env != '\0' ? env : std::string(pci::kSysfs);
}

Affinity read_affinity() {
  Affinity a;
  a.sysfs = sysfs_root();
  a.gpus = pci::gpus(a.sysfs);
  a.nics = pci::rdma_devices(a.sysfs);
  for (const auto& g : a.gpus) {
    a.distance.push_back(pci::distances(g, a.nics, a.sysfs));
    const std::vector<std::size_t> near = pci::nearest(a.distance.back());
    std::vector<bool> chosen(a.nics.size(), near.empty());
    for (std::size_t i : near) chosen[i] = true;
    a.chosen.push_back(std::move(chosen));
  }
  return a;
}

// "PIX*" for a chosen NIC, "SYS" for another.
std::string cell(const Affinity& a, std::size_t g, std::size_t n) {
  return std::string(pci::to_string(a.distance[g][n])) + (a.chosen[g][n] ? "*" : "");
}

// The file system type of `statfs`'s f_type, by name where it matters to O_DIRECT.
std::string fs_name(long type) {
  switch (static_cast<unsigned long>(type)) {
    case EXT4_SUPER_MAGIC: return "ext4";  // also ext2/ext3
    case XFS_SUPER_MAGIC: return "xfs";
    case BTRFS_SUPER_MAGIC: return "btrfs";
    case TMPFS_MAGIC: return "tmpfs";
    case OVERLAYFS_SUPER_MAGIC: return "overlayfs";
    case NFS_SUPER_MAGIC: return "nfs";
    default: {
      char hex[32];
      std::snprintf(hex, sizeof hex, "0x%lx", static_cast<unsigned long>(type));
      return hex;
    }
  }
}

// The first line of a sysfs file, or "" when there is none.
std::string sysfs_line(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::string line;
  std::getline(in, line);
  return line;
}

class Doctor {
 public:
  Doctor(Session& s, std::string ssd) : s_(s), ssd_(std::move(ssd)) {}

  std::vector<Check> run() {
    redis_checks();
    host_checks();
    if (!ssd_.empty()) ssd_check();
    return std::move(checks_);
  }
  const Affinity& affinity() const { return affinity_; }

 private:
  void add(std::string name, std::string status, std::string detail, std::string fix = {}) {
    checks_.push_back({std::move(name), std::move(status), std::move(detail), std::move(fix)});
  }

  void redis_checks() {
    const auto t0 = std::chrono::steady_clock::now();
    auto cell = s_.cell();
    if (!cell.is_ok()) {
      const bool auth = cell.status().code() == StatusCode::kPermissionDenied;
      add("redis", "fail", s_.redis_display() + ": " + cell.status().message(),
          auth ? "give the ACL user and password in the URL (redis://user:password@host:port/db), "
                 "KVSTASH_REDIS_PASSWORD or --redis-password-file"
               : "start redis-server there, or point --redis / KVSTASH_REDIS_URL at the cell's Redis");
      return;
    }
    metadata::RedisClient& redis = (*cell)->redis();
    auto pong = redis.command({"PING"});
    const auto rtt = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (!pong.is_ok()) {
      add("redis", "fail", "connected but PING failed: " + pong.status().message(),
          "check the ACL user's permissions");
      return;
    }
    const std::string version = redis_version(redis);
    std::string policy = "?";
    if (auto mem = redis.command({"CONFIG", "GET", "maxmemory-policy"}); mem.is_ok() && mem->size() == 2) {
      policy = mem->raw()->element[1]->str;
    }
    char ms[32];
    std::snprintf(ms, sizeof ms, "%.1f ms", rtt);
    add("redis", "ok", s_.redis_display() + ", Redis " + version + ", connected and authenticated in " + ms);
    if (policy != "?" && policy != "noeviction") {
      add("redis eviction policy", "fail",
          "maxmemory-policy is " + policy +
              ": Redis may drop kvstash records on its own, leaking their pages",
          "redis-cli CONFIG SET maxmemory-policy noeviction (and in redis.conf)");
    }

    if (Status st = (*cell)->check_schema(); !st.is_ok()) {
      add("cell schema", "fail", st.message(), "run the same kvstash release everywhere in the cell");
    }
    metadata::CellAdmin& c = (*cell)->admin();
    auto sum = c.summary();  // also proves that scripting works for this user
    if (!sum.is_ok()) {
      add("lua scripts", "fail", "running a kvstash script failed: " + sum.status().message(),
          "the ACL user needs FCALL and FUNCTION LOAD, or EVALSHA and SCRIPT LOAD (e.g. +@scripting), on the "
          "cell's keys");
      return;
    }
    // The summary ran as a function of this build's library where Redis has Functions and the
    // user may call and load them; else every script runs by EVALSHA.
    const metadata::FunctionLibrary& lib = metadata::scripts::library();
    auto listed = redis.command({"FUNCTION", "LIST", "LIBRARYNAME", lib.name});
    if (listed.is_ok() && listed->size() > 0) {
      add("lua scripts", "ok", "kvstash's scripts run as functions of library " + lib.name + " in Redis");
    } else {
      add("lua scripts", "warn",
          "kvstash's scripts run by EVALSHA: each call runs their prelude again (about five times the Redis "
          "time of a function call)",
          "Redis 7.0 or later, and an ACL user with +fcall and +function|load (e.g. +@scripting)");
    }

    if (auto t = redis.command({"TIME"}); t.is_ok() && t->size() == 2) {
      const double redis_ms =
          std::stod(t->raw()->element[0]->str) * 1000 + std::stod(t->raw()->element[1]->str) / 1000;
      const double local_ms =
          std::chrono::duration<double, std::milli>(std::chrono::system_clock::now().time_since_epoch())
              .count();
      const double skew = local_ms - redis_ms;
      char d[64];
      std::snprintf(d, sizeof d, "this host is %+.0f ms from Redis's clock", skew);
      const bool bad = std::abs(skew) > 1000;
      add("clock skew", bad ? "warn" : "ok",
          std::string(d) + " (leases and TTLs use Redis's clock; only the display of ages uses this one)",
          bad ? "run NTP (chrony, systemd-timesyncd) on this host and the Redis host" : "");
    }

    auto ids = c.known_nodes();
    if (!ids.is_ok()) return;
    int up = 0;
    for (const auto& id : *ids) {
      auto st = c.node_status(id);
      if (!st.is_ok()) continue;
      if (st->state == "gone") continue;
      if (st->heartbeat_in_ms < 0 || st->state == "dead") {
        add("node " + id, "warn", "missed its heartbeat: dead (its objects are released)",
            "restart its kvstashd, or forget it: kvstash node rm " + id + " --yes");
      } else if (st->state == "draining") {
        add("node " + id, "ok", "draining (takes no new objects), heartbeat current");
      } else {
        ++up;
        add("node " + id, "ok",
            "up, " + units::format_size(st->page_size * std::min(st->free_pages, st->page_count)) +
                " free of " + units::format_size(st->page_size * st->page_count));
      }
    }
    if (up == 0) {
      add("memory nodes", "fail",
          "no memory node is up in cell " + s_.globals().cell + ": puts fail with no_space",
          "start kvstashd --redis " + s_.redis_display() + " --capacity 8GiB on the memory hosts");
    }
  }

  void host_checks() {
    // Each transport looks at this host itself (its library, devices and ports); doctor
    // only words the levels.
    for (TransportFinding& f : probe_transports()) {
      add(std::move(f.check), std::string(level_name(f.level)), std::move(f.detail), std::move(f.fix));
    }
    gpu_checks();
    affinity_check();
    hugepage_check();
    memlock_check();
  }

  static std::string_view level_name(TransportFinding::Level level) {
    switch (level) {
      case TransportFinding::Level::kOk: return "ok";
      case TransportFinding::Level::kInfo: return "info";
      case TransportFinding::Level::kWarn: return "warn";
      case TransportFinding::Level::kFail: return "fail";
    }
    return "info";
  }

  void gpu_checks() {
    const bool peermem = std::filesystem::exists("/sys/module/nvidia_peermem");
    void* cuda = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (cuda == nullptr) {
      add("cuda", "info", "no CUDA driver (libcuda.so.1) on this host: KV caches here live in host memory");
      add("gpudirect", "info", "not applicable without a GPU");
      return;
    }
    using InitFn = int (*)(unsigned);
    using CountFn = int (*)(int*);
    using VersionFn = int (*)(int*);
    auto init = reinterpret_cast<InitFn>(::dlsym(cuda, "cuInit"));
    auto count = reinterpret_cast<CountFn>(::dlsym(cuda, "cuDeviceGetCount"));
    auto version = reinterpret_cast<VersionFn>(::dlsym(cuda, "cuDriverGetVersion"));
    int n = 0, v = 0;
    const bool ok = init != nullptr && count != nullptr && init(0) == 0 && count(&n) == 0;
    if (version != nullptr) version(&v);
    const bool dmabuf_api = ::dlsym(cuda, "cuMemGetHandleForAddressRange") != nullptr;
    ::dlclose(cuda);
    if (!ok || n == 0) {
      add("cuda", "warn", "the CUDA driver is installed but no GPU answers",
          "check nvidia-smi and the driver");
      return;
    }
    add("cuda", "ok",
        std::to_string(n) + " GPU(s), driver API " + std::to_string(v / 1000) + "." +
            std::to_string(v % 1000 / 10));
    driver_floor_check(v);
    utsname u{};
    uname(&u);
    const bool kernel_dmabuf =
        std::stoi(u.release) > 5 ||
        (std::stoi(u.release) == 5 && std::stoi(std::string(u.release).substr(2)) >= 12);
    std::string detail =
        std::string("nvidia-peermem ") + (peermem ? "loaded" : "not loaded") + "; dma-buf " +
        (dmabuf_api && kernel_dmabuf ? "possible (driver and kernel " + std::string(u.release) + ")"
                                     : "not available");
#if KVSTASH_HAVE_CUDA_KERNELS
    const std::string staged = "staged through pinned host buffers by the CUDA device";
#else
    const std::string staged =
        "nowhere where no NIC reaches the GPU: this build has no CUDA kernels to stage them";
#endif
    const bool direct = peermem || (dmabuf_api && kernel_dmabuf);
    add("gpudirect", direct ? "ok" : "warn",
        detail + ". KV caches in GPU memory move " +
            (direct ? "zero-copy over verbs where the NIC reaches the GPU, else " : "") + staged,
        direct ? ""
               : "modprobe nvidia-peermem (or a kernel >= 5.12 with CUDA >= 11.7 for dma-buf) for zero-copy");
  }

  // The driver against the CUDA runtime this build links (a KvCache in GPU memory cannot open
  // on an older one: it says the same).
  void driver_floor_check(int driver) {
#if KVSTASH_HAVE_CUDA_KERNELS
    const int runtime = KVSTASH_CUDA_RUNTIME_VERSION;
    const auto text = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
    const std::string floor = cuda_driver_floor(runtime / 1000);
    if (driver / 1000 < runtime / 1000) {
      add("cuda driver", "fail",
          "the driver supports CUDA " + text(driver) + "; this kvstash links the CUDA " + text(runtime) +
              " runtime, which needs " + floor + ": KV caches in GPU memory cannot open",
          "update the NVIDIA driver to " + floor +
              ", or build kvstash with the CUDA toolkit your engine's torch uses (docs/operations.md, 'GPU "
              "drivers')");
    } else {
      add("cuda driver", "ok",
          "the driver supports CUDA " + text(driver) + "; this kvstash's CUDA " + text(runtime) +
              " runtime needs " + floor);
    }
#else
    (void)driver;
    add("cuda driver", "info", "this build has no CUDA kernels: KV caches in GPU memory need GPUDirect");
#endif
  }

  void affinity_check() {
    affinity_ = read_affinity();
    const Affinity& a = affinity_;
    if (a.gpus.empty() && a.nics.empty()) {
      add("gpu-nic affinity", "info",
          "no NVIDIA GPU and no RDMA device in " + a.sysfs + ": no GPU x NIC matrix");
    } else if (a.nics.empty()) {
      add("gpu-nic affinity", "info",
          std::to_string(a.gpus.size()) + " GPU(s) and no RDMA device: no GPU x NIC matrix");
    } else if (a.gpus.empty()) {
      add("gpu-nic affinity", "info",
          "no NVIDIA GPU; " + std::to_string(a.nics.size()) + " RDMA device(s): no GPU x NIC matrix");
    } else {
      std::string detail;
      for (std::size_t g = 0; g < a.gpus.size(); ++g) {
        detail.append(g == 0 ? "" : "; ").append(pci::to_string(a.gpus[g])).append(" -> ");
        bool first = true;
        for (std::size_t n = 0; n < a.nics.size(); ++n) {
          if (!a.chosen[g][n]) continue;
          detail.append(first ? "" : ", ").append(a.nics[n]);
          first = false;
        }
        const auto best = std::min_element(a.distance[g].begin(), a.distance[g].end());
        detail.append(" (").append(pci::to_string(*best)).append(")");
      }
      add("gpu-nic affinity", "ok", detail);
    }
  }

  void hugepage_check() {
    std::ifstream in("/proc/meminfo");
    std::string line;
    std::uint64_t total = 0, free = 0, size_kb = 0;
    while (std::getline(in, line)) {
      std::istringstream is(line);
      std::string key;
      std::uint64_t v = 0;
      is >> key >> v;
      if (key == "HugePages_Total:") total = v;
      if (key == "HugePages_Free:") free = v;
      if (key == "Hugepagesize:") size_kb = v;
    }
    if (total == 0) {
      add("hugepages", "warn",
          "none reserved: kvstashd --huge-pages auto backs its pool with 4 KiB pages (more TLB misses, "
          "more NIC translation entries)",
          "reserve them on memory nodes: sysctl vm.nr_hugepages=<capacity / 2 MiB>");
    } else {
      add("hugepages", "ok",
          std::to_string(free) + " of " + std::to_string(total) + " free, " +
              units::format_size(size_kb * 1024) + " each");
    }
  }

  void memlock_check() {
    rlimit rl{};
    getrlimit(RLIMIT_MEMLOCK, &rl);
    if (geteuid() == 0 || rl.rlim_cur == RLIM_INFINITY) {
      add("memlock", "ok",
          geteuid() == 0 ? "root (CAP_IPC_LOCK): RDMA registrations are not limited"
                         : "unlimited: RDMA registrations are not limited");
      return;
    }
    const bool low = rl.rlim_cur < (64u << 20);
    add("memlock", low ? "warn" : "ok",
        "ulimit -l is " + units::format_size(rl.rlim_cur) + ": RDMA can register at most that much memory",
        low ? "raise it: ulimit -l unlimited, LimitMEMLOCK=infinity (systemd), or /etc/security/limits.conf"
            : "");
  }

  // The NVMe tier's device (docs/nvme-tier.md): a block device is looked at without a write;
  // for a file, a probe file beside it takes a 64 KiB write and read through O_DIRECT and
  // io_uring, and goes.
  void ssd_check() {
    struct stat st {};
    const bool block = ::stat(ssd_.c_str(), &st) == 0 && S_ISBLK(st.st_mode);
    std::string where = block ? ssd_ : std::filesystem::path(ssd_).parent_path().string();
    if (where.empty()) where = ".";
    struct stat dir {};
    if (!block && ::stat(where.c_str(), &dir) != 0) {
      add("ssd", "fail", where + " does not exist", "name a file on the NVMe's file system, or the device");
      return;
    }
    // The queue behind it: the device's own, or the one holding the file system.
    const dev_t dev = block ? st.st_rdev : dir.st_dev;
    std::filesystem::path sys =
        "/sys/dev/block/" + std::to_string(major(dev)) + ":" + std::to_string(minor(dev));
    if (!std::filesystem::exists(sys / "queue") && std::filesystem::exists(sys / "..")) sys = sys / "..";
    const std::string depth = sysfs_line(sys / "queue" / "nr_requests");
    const std::string rotational = sysfs_line(sys / "queue" / "rotational");
    const std::string queue = depth.empty()
                                  ? "queue depth unknown (no block device behind it)"
                                  : "queue depth " + depth + (rotational == "1" ? ", rotational" : "");
    if (block) {
      const int fd = ::open(ssd_.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
      if (fd < 0) {
        add("ssd", "fail", ssd_ + ": " + std::strerror(errno), "run kvstashd as a user that may open it");
        return;
      }
      ::close(fd);
      add("ssd", rotational == "1" ? "warn" : "ok", ssd_ + ": a block device, O_DIRECT opens; " + queue,
          rotational == "1" ? "a rotational disk: the tier wants NVMe" : "");
      return;
    }
    struct statfs fs {};
    const std::string type = ::statfs(where.c_str(), &fs) == 0 ? fs_name(fs.f_type) : "unknown";
    const std::string probe =
        (std::filesystem::path(where) / ".kvstash-doctor-probe").string() + std::to_string(getpid());
    auto device = node::SsdDevice::open({.path = probe, .capacity = 1 << 20});
    Status io = device.status();
    double us = 0;
    if (io.is_ok()) {
      auto buffer = Buffer::allocate(64 << 10);
      io = buffer.status();
      if (io.is_ok()) {
        std::memset(buffer->data(), 0x6b, buffer->size());
        const auto t0 = std::chrono::steady_clock::now();
        io = (*device)->run(
            {{.write = true, .offset = 0, .buffer = buffer->data(), .length = buffer->size()},
             {.write = false, .offset = 65536, .buffer = buffer->data(), .length = buffer->size()}},
            deadline_after(std::chrono::seconds(5)));
        us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      }
      device->reset();
    }
    ::unlink(probe.c_str());
    if (!io.is_ok()) {
      add("ssd", "fail", where + " (" + type + "): " + io.message(),
          io.code() == StatusCode::kUnsupported
              ? "put the tier on ext4 or xfs on the NVMe, or give the device"
              : "");
      return;
    }
    const bool poor = type == "tmpfs" || type == "overlayfs" || type == "nfs" || rotational == "1";
    char took[64];
    std::snprintf(took, sizeof took, "%.0f us", us);
    add("ssd", poor ? "warn" : "ok",
        where + " (" + type + "): O_DIRECT and io_uring work (a 64 KiB write and read took " + took + "); " +
            queue,
        !poor ? ""
        : rotational == "1"
            ? "its disk says it is rotational: the tier wants NVMe (a VM's virtual disk may say so wrongly)"
            : "a " + type +
                  " file is not an NVMe tier: put it on ext4 or xfs on the NVMe, or give the device");
  }

  Session& s_;
  std::string ssd_;
  std::vector<Check> checks_;
  Affinity affinity_;
};

json affinity_json(const Affinity& a) {
  json j{{"sysfs", a.sysfs},
         {"gpus", json::array()},
         {"nics", a.nics},
         {"distance", json::array()},
         {"chosen", json::array()}};
  for (std::size_t g = 0; g < a.gpus.size(); ++g) {
    j["gpus"].push_back(pci::to_string(a.gpus[g]));
    json row = json::array(), chosen = json::array();
    for (std::size_t n = 0; n < a.nics.size(); ++n) {
      row.push_back(std::string(pci::to_string(a.distance[g][n])));
      if (a.chosen[g][n]) chosen.push_back(a.nics[n]);
    }
    j["distance"].push_back(std::move(row));
    j["chosen"].push_back(std::move(chosen));
  }
  return j;
}

// The matrix, when there are GPUs and NICs both; nothing otherwise (the check said why).
std::string affinity_table(const Affinity& a) {
  if (a.gpus.empty() || a.nics.empty()) return {};
  std::vector<std::string> header{"GPU"};
  header.insert(header.end(), a.nics.begin(), a.nics.end());
  Table t(std::move(header));
  for (std::size_t g = 0; g < a.gpus.size(); ++g) {
    std::vector<std::string> row{pci::to_string(a.gpus[g])};
    for (std::size_t n = 0; n < a.nics.size(); ++n) row.push_back(cell(a, g, n));
    t.row(std::move(row));
  }
  return "\nGPU x NIC, PCIe distance (* marks the NICs that move that GPU's memory over verbs; GPUs in "
         "CUDA_DEVICE_ORDER=PCI_BUS_ID order):\n" +
         t.str() +
         "X same device, PIX one PCIe switch, PXB several switches, PHB one host bridge, NODE one NUMA "
         "node, SYS across NUMA nodes, ? not in the PCI tree\n";
}

int doctor(Session& s, const std::string& ssd) {
  Doctor doc(s, ssd);
  const std::vector<Check> checks = doc.run();
  bool failed = false;
  for (const auto& c : checks) failed |= c.status == "fail";
  if (s.json()) {
    json j{{"ok", !failed}, {"checks", json::array()}, {"gpu_nic", affinity_json(doc.affinity())}};
    for (const auto& c : checks) {
      j["checks"].push_back({{"check", c.name}, {"status", c.status}, {"detail", c.detail}, {"fix", c.fix}});
    }
    std::cout << j.dump(2) << "\n";
  } else {
    Table t({"STATUS", "CHECK", "DETAIL"});
    for (const auto& c : checks) t.row({c.status, c.name, c.detail});
    std::cout << t.str() << affinity_table(doc.affinity());
    bool header = false;
    for (const auto& c : checks) {
      if (c.fix.empty()) continue;
      if (!header) std::cout << "\nHow to fix:\n";
      header = true;
      std::cout << "  " << c.name << ": " << c.fix << "\n";
    }
  }
  return failed ? kExitError : kExitOk;
}

}  // namespace

void add_doctor_command(Registry& r) {
  auto* d =
      r.app.add_subcommand("doctor", "Check the cell and this host; explain each finding and how to fix it");
  d->footer(
      "Checks: Redis reachable and authenticated, eviction policy, schema, Lua scripts, clock skew, memory "
      "nodes' heartbeats, transports (shm, tcp, UCX, RDMA devices and ports), CUDA and GPUDirect, the GPU x "
      "NIC matrix (PCIe distance, the NICs each GPU's memory moves through), hugepages, "
      "memlock; with --ssd, the NVMe tier's device (O_DIRECT, io_uring, its file system and queue depth)."
      "\n\nExamples:\n  kvstash doctor\n  kvstash doctor --ssd /mnt/nvme0/kvstash.tier\n"
      "  kvstash doctor --json | jq '.checks[] | select(.status != \"ok\")'");
  auto ssd = std::make_shared<std::string>();
  d->add_option(
      "--ssd", *ssd,
      "Check this NVMe tier: a block device (looked at, never written), or a file path (a probe file "
      "beside it takes a 64 KiB write and read)");
  Session& s = r.session;
  d->final_callback([&r, &s, ssd] {
    r.action = [&s, ssd] { return for_each_cell(s, [ssd](Session& one) { return doctor(one, *ssd); }); };
  });
}

}  // namespace kvstash::cli
