#include "common/pci_topology.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <system_error>

namespace kvstash::pci {
namespace {

namespace fs = std::filesystem;

bool hex_digits(std::string_view s, std::size_t min, std::size_t max) {
  return s.size() >= min && s.size() <= max &&
         std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

std::uint32_t hex(std::string_view s) {
  return static_cast<std::uint32_t>(std::strtoul(std::string(s).c_str(), nullptr, 16));
}

// The first line of a small sysfs file, or "" when it cannot be read.
std::string read_line(const fs::path& p) {
  std::ifstream in(p);
  std::string line;
  std::getline(in, line);
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r' || line.back() == ' ')) line.pop_back();
  return line;
}

// A name that stays one directory entry: nothing in it can walk out of its directory.
bool plain_name(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string_view::npos;
}

std::optional<fs::path> resolve(const fs::path& p) {
  std::error_code ec;
  fs::path c = fs::canonical(p, ec);
  if (ec) return std::nullopt;
  return c;
}

// Whether a path component names a PCI host bridge: "pci0000:3a" (pci<domain>:<bus>).
bool host_bridge(std::string_view c) {
  if (c.size() < 6 || c.substr(0, 3) != "pci") return false;
  c.remove_prefix(3);
  const auto colon = c.find(':');
  return colon != std::string_view::npos && hex_digits(c.substr(0, colon), 4, 8) &&
         hex_digits(c.substr(colon + 1), 2, 2);
}

// Whether a path component is a PCI function as sysfs names it ("0000:3b:00.0").
bool function_name(const std::string& c) {
  return std::count(c.begin(), c.end(), ':') == 2 && parse_address(c).has_value();
}

}  // namespace

std::optional<Address> parse_address(std::string_view text) {
  const auto dot = text.rfind('.');
  if (dot == std::string_view::npos || !hex_digits(text.substr(dot + 1), 1, 1)) return std::nullopt;
  std::string_view rest = text.substr(0, dot);
  Address a;
  a.function = static_cast<std::uint8_t>(hex(text.substr(dot + 1)));
  const auto last = rest.rfind(':');
  if (last == std::string_view::npos) return std::nullopt;
  const std::string_view device = rest.substr(last + 1);
  rest = rest.substr(0, last);
  const auto first = rest.rfind(':');
  const std::string_view bus = first == std::string_view::npos ? rest : rest.substr(first + 1);
  if (first != std::string_view::npos) {
    const std::string_view domain = rest.substr(0, first);
    if (!hex_digits(domain, 4, 8)) return std::nullopt;
    a.domain = hex(domain);
  }
  if (!hex_digits(bus, 2, 2) || !hex_digits(device, 2, 2)) return std::nullopt;
  a.bus = static_cast<std::uint8_t>(hex(bus));
  const std::uint32_t dev = hex(device);
  if (a.function > 7 || dev > 31) return std::nullopt;
  a.device = static_cast<std::uint8_t>(dev);
  return a;
}

std::string to_string(const Address& a) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%04x:%02x:%02x.%x", a.domain, a.bus, a.device, a.function);
  return buf;
}

std::string_view to_string(Distance d) {
  switch (d) {
    case Distance::kSelf: return "X";
    case Distance::kPix: return "PIX";
    case Distance::kPxb: return "PXB";
    case Distance::kPhb: return "PHB";
    case Distance::kNode: return "NODE";
    case Distance::kSys: return "SYS";
    case Distance::kUnknown: return "?";
  }
  return "?";
}

std::optional<fs::path> device_path(const Address& a, const fs::path& sysfs) {
  return resolve(sysfs / "bus/pci/devices" / to_string(a));
}

std::optional<fs::path> rdma_device_path(std::string_view name, const fs::path& sysfs) {
  if (!plain_name(name)) return std::nullopt;
  const fs::path dev = sysfs / "class/infiniband" / name;
  std::optional<fs::path> p = resolve(dev / "device");
  if (!p) {
    // rxe and siw have no device of their own; they run on a network interface.
    const std::string parent = read_line(dev / "parent");
    if (plain_name(parent)) p = resolve(sysfs / "class/net" / parent / "device");
  }
  if (!p) return std::nullopt;
  // Up to the deepest PCI function on the path (a virtio NIC is virtioN below its function).
  fs::path out;
  std::optional<fs::path> last;
  for (const auto& c : *p) {
    out /= c;
    if (function_name(c.string())) last = out;
  }
  return last;
}

int numa_node(const fs::path& device) {
  const std::string s = read_line(device / "numa_node");
  if (s.empty()) return -1;
  char* end = nullptr;
  const long n = std::strtol(s.c_str(), &end, 10);
  return end != s.c_str() && *end == '\0' && n >= -1 && n < 1 << 20 ? static_cast<int>(n) : -1;
}

Distance distance(const fs::path& a, const fs::path& b) {
  if (a == b) return Distance::kSelf;
  // Each path as its host bridge (everything up to /sys/devices/pciDDDD:BB) and the chain of
  // bridges and devices below it.
  struct Split {
    fs::path bridge;
    std::vector<std::string> chain;
    bool found = false;
  };
  auto split = [](const fs::path& p) {
    Split s;
    for (const auto& c : p) {
      if (s.found) {
        s.chain.push_back(c.string());
      } else {
        s.bridge /= c;
        s.found = host_bridge(c.string());
      }
    }
    return s;
  };
  const Split sa = split(a), sb = split(b);
  if (!sa.found || !sb.found || sa.chain.empty() || sb.chain.empty()) return Distance::kUnknown;
  if (sa.bridge != sb.bridge) {
    const int na = numa_node(a), nb = numa_node(b);
    return na == nb ? Distance::kNode : Distance::kSys;
  }
  std::size_t shared = 0;
  while (shared < sa.chain.size() && shared < sb.chain.size() && sa.chain[shared] == sb.chain[shared])
    ++shared;
  if (shared == 0) return Distance::kPhb;  // different root ports of one host bridge
  // Bridges strictly between the deepest shared one and each device (a switch's downstream
  // port is the one bridge of PIX; one device above the other counts as none).
  auto below = [&](const Split& s) { return s.chain.size() > shared ? s.chain.size() - shared - 1 : 0; };
  return below(sa) <= 1 && below(sb) <= 1 ? Distance::kPix : Distance::kPxb;
}

std::vector<Address> gpus(const fs::path& sysfs) {
  std::vector<Address> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(sysfs / "bus/pci/devices", ec)) {
    const auto a = parse_address(e.path().filename().string());
    if (!a) continue;
    const std::string vendor = read_line(e.path() / "vendor");
    const std::string cls = read_line(e.path() / "class");
    if (vendor.empty() || cls.empty() || hex(vendor) != 0x10de) continue;
    const std::uint32_t base = hex(cls) >> 8;  // class and subclass; the low byte is the interface
    if (base == 0x0302 || base == 0x0300) out.push_back(*a);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> rdma_devices(const fs::path& sysfs) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(sysfs / "class/infiniband", ec)) {
    out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<Distance> distances(const Address& gpu, std::span<const std::string> nics,
                                const fs::path& sysfs) {
  std::vector<Distance> out(nics.size(), Distance::kUnknown);
  const auto g = device_path(gpu, sysfs);
  if (!g) return out;
  for (std::size_t i = 0; i < nics.size(); ++i) {
    if (auto n = rdma_device_path(nics[i], sysfs)) out[i] = distance(*g, *n);
  }
  return out;
}

std::vector<Ranked> rank_nics(const Address& gpu, std::span<const std::string> nics, const fs::path& sysfs) {
  const std::vector<Distance> d = distances(gpu, nics, sysfs);
  std::vector<Ranked> out;
  out.reserve(nics.size());
  for (std::size_t i = 0; i < nics.size(); ++i) out.push_back({nics[i], d[i]});
  std::stable_sort(out.begin(), out.end(),
                   [](const Ranked& x, const Ranked& y) { return x.distance < y.distance; });
  return out;
}

std::vector<std::size_t> nearest(std::span<const Distance> d) {
  if (d.empty()) return {};
  const Distance best = *std::min_element(d.begin(), d.end());
  if (best == Distance::kUnknown || std::all_of(d.begin(), d.end(), [&](Distance x) { return x == best; })) {
    return {};
  }
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < d.size(); ++i) {
    if (d[i] == best) out.push_back(i);
  }
  return out;
}

}  // namespace kvstash::pci
