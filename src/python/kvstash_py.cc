// Python bindings (pybind11) over the Store and the KV-cache layer: a translation of the C++
// API (include/kvstash/store.h, kvcache.h) name for name, as the C API (include/kvstash/c_api.h)
// is: keywords are the C++ fields and parameters (a std::chrono::milliseconds `x` is `x_ms`, a
// deadline is `timeout_ms` from now), defaults are read from the C++ structs, enums are their
// text forms ("fp16", "nhd", "host"). tests/unit/bindings/parity_test.py checks it. Blocking calls release
// the GIL. Failures raise kvstash.Error with .code (the status name) and the message.
//
//   import kvstash
//   store = kvstash.Store("redis://127.0.0.1:6379/0", transports="shm,tcp", cluster_token=token)
//   kv = kvstash.KvCache(store, [t.data_ptr() for t in kv_caches], num_blocks=..., block_size=16,
//                        num_kv_heads=8, head_dim=128, dtype="bf16", model="...")
//   load = kv.begin_load(tokens, block_ids, kv.contains_prefix(tokens))
//   for layer in range(num_layers): load.wait_layer(layer)
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/system.h"
#include "kvstash/kvcache.h"
#include "kvstash/kvpeer.h"
#include "kvstash/store.h"
#include "kvstash/types.h"

namespace py = pybind11;
using namespace kvstash;

namespace {

PyObject* g_error = nullptr;  // kvstash.Error

[[noreturn]] void raise(const Status& s) {
  py::object err = py::reinterpret_borrow<py::object>(g_error)(s.to_string());
  err.attr("code") = std::string(to_string(s.code()));
  err.attr("message") = std::string(s.message());
  PyErr_SetObject(g_error, err.ptr());
  throw py::error_already_set();
}

template <typename T>
T unwrap(Result<T> r) {
  if (!r.is_ok()) raise(r.status());
  return std::move(r).value();
}

void check(const Status& s) {
  if (!s.is_ok()) raise(s);
}

// Runs `f` without the GIL; what it returns is checked (and raised) once the GIL is back.
template <typename F>
auto nogil(F f) {
  py::gil_scoped_release release;
  return f();
}

// Per-chunk statuses as (code, message) pairs.
std::vector<std::pair<std::string, std::string>> statuses(const std::vector<Status>& all) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Status& s : all) out.emplace_back(std::string(to_string(s.code())), std::string(s.message()));
  return out;
}

// A memory address from a Python object: an int (torch's data_ptr(): the caller keeps that
// memory alive and in place) or a writable buffer (bytearray, numpy array, memoryview). A
// buffer's export is held in `exports` for as long as its address is in use: while it is
// held the exporter may not move or free the bytes (a bytearray refuses to resize with
// BufferError), and it keeps the object alive. Releasing an export needs the GIL.
void* address_of(const py::handle& h, std::size_t need, std::vector<py::buffer_info>& exports) {
  if (py::isinstance<py::int_>(h)) return reinterpret_cast<void*>(h.cast<std::uintptr_t>());
  py::buffer_info info = h.cast<py::buffer>().request(true);
  if (static_cast<std::size_t>(info.size * info.itemsize) < need) {
    raise(Status::invalid_argument("a tensor buffer holds " + std::to_string(info.size * info.itemsize) +
                                   " bytes, the layout needs " + std::to_string(need)));
  }
  void* addr = info.ptr;
  exports.push_back(std::move(info));
  return addr;
}

struct PyStore {
  std::unique_ptr<Store> store;
  // Memory registered once for the puts and gets that name buffers in it (register_memory):
  // each a region and its handle, kept at a stable address while the store lives. Destroyed
  // before the store (members go in reverse order).
  struct Registered {
    std::uintptr_t addr;
    std::size_t length;
    MemoryHandle handle;
  };
  std::mutex mu;
  std::vector<std::unique_ptr<Registered>> registered;

  // The registration covering [addr, addr+length), or null (the store registers it per call).
  const MemoryHandle* handle_for(std::uintptr_t addr, std::size_t length) {
    std::lock_guard lock(mu);
    for (const auto& r : registered) {
      // Without overflow: addr + length may wrap for a hostile length.
      if (addr >= r->addr && length <= r->length && addr - r->addr <= r->length - length) return &r->handle;
    }
    return nullptr;
  }
};

// The buffers of a put (read) or a get (written), as slices with their registrations, and
// the buffer exports that keep the objects' memory in place for the call.
struct Buffers {
  std::vector<Slice> slices;
  std::vector<py::buffer_info> exports;
};

// Each buffer is a Python buffer object (bytearray, memoryview, a C-contiguous numpy array;
// writable for a get), or an (address, bytes) pair (torch: t.data_ptr(), t.nbytes) inside
// memory registered with register_memory. A pair anywhere else is refused: an integer proves
// nothing about memory, and a wrong one would crash the interpreter in the copy (over shm,
// SIGSEGV) or hand another object's bytes to a put.
Buffers buffer_slices(PyStore& s, const py::sequence& buffers, bool writable) {
  Buffers out;
  out.exports.reserve(buffers.size());
  for (const auto& b : buffers) {
    if (py::isinstance<py::buffer>(b) && !py::isinstance<py::tuple>(b)) {
      py::buffer_info info = b.cast<py::buffer>().request(writable);
      // C-contiguous only: the bytes are moved as one range.
      py::ssize_t expect = info.itemsize;
      for (py::ssize_t d = info.ndim; d-- > 0;) {
        if (info.shape[d] > 1 && info.strides[d] != expect) {
          raise(Status::invalid_argument("a buffer that is not contiguous: pass a contiguous copy"));
        }
        expect *= info.shape[d];
      }
      const std::size_t length = static_cast<std::size_t>(info.size * info.itemsize);
      const auto addr = reinterpret_cast<std::uintptr_t>(info.ptr);
      out.slices.push_back({info.ptr, length, s.handle_for(addr, length)});
      out.exports.push_back(std::move(info));
      continue;
    }
    auto [addr, length] = b.cast<std::pair<std::uintptr_t, std::size_t>>();
    const MemoryHandle* handle = s.handle_for(addr, length);
    if (handle == nullptr) {
      char where[32];
      std::snprintf(where, sizeof where, "0x%llx", static_cast<unsigned long long>(addr));
      raise(Status::invalid_argument(
          std::string("buffer (") + where + ", " + std::to_string(length) +
          ") is not inside memory registered with Store.register_memory: register that memory first, or "
          "pass a buffer object (bytearray, memoryview, numpy array)"));
    }
    out.slices.push_back({reinterpret_cast<void*>(addr), length, handle});
  }
  return out;
}

// Destroyed by Python (the last KvCache, KvSave or KvLoad object referring to it goes), so
// with the GIL held. Members go in reverse order: the cache deregisters its memory before the
// buffer exports are released, and the store goes last.
struct PyKvCache {
  std::shared_ptr<PyStore> store;        // outlives the cache
  std::vector<py::buffer_info> buffers;  // exports of the buffers whose memory is registered
  std::unique_ptr<KvCache> kv;
};

// Handoff records over a store, which outlives them.
struct PyHandoffs {
  std::shared_ptr<PyStore> store;
  KvHandoffs records;
};

// An export or import over a KvCache's layout: the cache (its store and tensors) outlives it.
struct PyKvExport {
  std::shared_ptr<PyKvCache> kv;
  std::unique_ptr<KvExport> out;
};

struct PyKvImport {
  std::shared_ptr<PyKvCache> kv;
  std::unique_ptr<KvImport> in;
};

struct PyPeerRead {
  std::shared_ptr<PyKvImport> in;
  KvPeerRead read;
};

struct PySave {
  std::shared_ptr<PyKvCache> kv;
  KvSave save;
};

struct PyLoad {
  std::shared_ptr<PyKvCache> kv;
  KvLoad load;
};

// A call's timeout_ms, as the C API takes it: 0 is the store's default.
std::optional<Deadline> deadline_of(std::uint32_t timeout_ms) {
  if (timeout_ms == 0) return std::nullopt;
  return deadline_after(std::chrono::milliseconds(timeout_ms));
}

// Text forms of the enums the C++ API has no to_string for (the C enum names, lower case).
std::string_view order_name(KvBlockOrder o) { return o == KvBlockOrder::kHND ? "hnd" : "nhd"; }
std::string_view memory_kind_name(MemoryKind k) { return k == MemoryKind::kCuda ? "cuda" : "host"; }

// The defaults of the C++ option structs, so that a keyword left out means what the C++ field
// left out means.
const StoreOptions kStoreDefaults;
const KvCacheShape kShapeDefaults;
const PrefixKeyOptions kKeyDefaults;

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvstash: KV-cache offload to remote memory (Store, KvCache, layer-wise save and load)";
  g_error = PyErr_NewException("kvstash.Error", PyExc_RuntimeError, nullptr);
  m.attr("Error") = py::handle(g_error);

  py::class_<KeepHint>(m, "KeepHint")
      .def(py::init([](std::uint32_t turn, std::uint32_t chunks, std::uint32_t index, std::uint32_t tokens,
                       std::uint64_t key_hash, std::uint64_t split_hash, double looked_up) {
             return KeepHint{turn, chunks, index, tokens, key_hash, split_hash, looked_up};
           }),
           py::arg("turn") = 1, py::arg("chunks") = 0, py::arg("index") = 0, py::arg("tokens") = 0,
           py::arg("key_hash") = 0, py::arg("split_hash") = 0, py::arg("looked_up") = 0.0,
           "One use of a chunk, for a turn-ttl cell (KeepHint): the request's turn and clock from "
           "Store.lookup_prefix, the prompt's chunks, this chunk's index and tokens, keep_key_hash of its "
           "key and of the request's first missing chunk's.")
      .def_readwrite("turn", &KeepHint::turn)
      .def_readwrite("chunks", &KeepHint::chunks)
      .def_readwrite("index", &KeepHint::index)
      .def_readwrite("tokens", &KeepHint::tokens)
      .def_readwrite("key_hash", &KeepHint::key_hash)
      .def_readwrite("split_hash", &KeepHint::split_hash)
      .def_readwrite("looked_up", &KeepHint::looked_up);
  m.def(
      "keep_key_hash", [](const std::string& key) { return KeepHint::hash_key(key); }, py::arg("key"),
      "A key's hash for KeepHint's key_hash and split_hash, the same in every process.");
  py::class_<KvKeep>(m, "KvKeep")
      .def(py::init([](std::uint32_t turn, double looked_up, std::uint32_t chunks, std::uint64_t split_hash) {
             return KvKeep{turn, looked_up, chunks, split_hash};
           }),
           py::arg("turn") = 1, py::arg("looked_up") = 0.0, py::arg("chunks") = 0, py::arg("split_hash") = 0,
           "What a request's loads and saves tell a turn-ttl cell (KvKeep): KvCache.lookup_prefix's, or "
           "made from Store.lookup_prefix over one's own keys.")
      .def_readwrite("turn", &KvKeep::turn)
      .def_readwrite("looked_up", &KvKeep::looked_up)
      .def_readwrite("chunks", &KvKeep::chunks)
      .def_readwrite("split_hash", &KvKeep::split_hash);

  py::class_<PyStore, std::shared_ptr<PyStore>>(m, "Store")
      .def(py::init([](const std::string& redis_url, const std::string& redis_password,
                       const std::string& cell, const std::string& transports, std::uint32_t timeout_ms,
                       const std::optional<std::string>& cluster_token, const std::string& listen) {
             StoreOptions o;
             o.redis_url = redis_url;
             o.redis_password = redis_password;
             if (cluster_token) {
               check(sys::check_cluster_token(*cluster_token, "cluster_token"));
               o.engine.cluster_token = *cluster_token;
             }
             o.cell = cell;
             o.engine.transports = unwrap(parse_transport_list(transports));
             if (!listen.empty()) {
               // Where peers reach this process's own memory (P/D's direct path): tcp serves
               // there, and verbs sets its queue pairs up on the same host (any port).
               const auto colon = listen.rfind(':');
               if (colon == std::string::npos || colon == 0) {
                 raise(Status::invalid_argument("listen is host:port (port 0: any), not '" + listen + "'"));
               }
               o.engine.tcp.listen = listen;
               o.engine.verbs.listen = listen.substr(0, colon) + ":0";
             }
             o.timeout = std::chrono::milliseconds(timeout_ms);
             auto out = std::make_shared<PyStore>();
             out->store = unwrap(nogil([&] { return Store::open(o); }));
             return out;
           }),
           py::arg("redis_url") = kStoreDefaults.redis_url,
           py::arg("redis_password") = kStoreDefaults.redis_password, py::arg("cell") = kStoreDefaults.cell,
           py::arg("transports") = "",
           py::arg("timeout_ms") = static_cast<std::uint32_t>(kStoreDefaults.timeout.count()),
           py::arg("cluster_token") = py::none(), py::arg("listen") = "",
           "Opens the cell's store (StoreOptions). transports: \"shm,tcp,verbs\", \"\" for every one built "
           "in. "
           "cluster_token: the cell's shared secret (kvstashd --cluster-token-file); None: none, and nodes "
           "that require one refuse the data path (Error code 'permission_denied'); an empty string, or one "
           "shorter than 16 bytes, is refused ('invalid_argument'). listen: host:port where peers reach this "
           "process's memory "
           "(P/D's direct path: EngineOptions' tcp.listen, and verbs' queue-pair setup on that host, any "
           "port); \"\": loopback.")
      .def(
          "put",
          [](PyStore& s, const std::string& key, const py::object& data, std::uint64_t ttl_ms,
             std::uint32_t timeout_ms, std::uint32_t replicas, const std::optional<KeepHint>& keep) {
            PutOptions o{.ttl = std::chrono::milliseconds(ttl_ms), .deadline = deadline_of(timeout_ms)};
            o.replicas = replicas;
            o.keep = keep;
            if (py::isinstance<py::bytes>(data)) {
              std::string bytes = data.cast<std::string>();
              Slice slice{bytes.data(), bytes.size()};
              check(nogil([&] { return s.store->put(key, {&slice, 1}, o); }));
              return;
            }
            const Buffers buffers = buffer_slices(s, data, false);  // zero-copy: the bytes in place
            check(nogil([&] { return s.store->put(key, buffers.slices, o); }));
          },
          py::arg("key"), py::arg("data"), py::arg("ttl_ms") = 0, py::arg("timeout_ms") = 0,
          py::arg("replicas") = 1, py::arg("keep") = py::none(),
          "data: bytes, or buffers whose concatenation is the object (moved from where they are): buffer "
          "objects, or (address, bytes) pairs inside memory given to register_memory. ttl_ms: 0 never "
          "expires. replicas: copies on distinct memory nodes (1-4). keep: the use, for a turn-ttl cell "
          "(KeepHint).")
      .def(
          "get",
          [](PyStore& s, const std::string& key, const py::object& into, std::uint32_t timeout_ms,
             bool promote, const std::optional<KeepHint>& keep) -> py::object {
            GetOptions o;
            o.deadline = deadline_of(timeout_ms);
            o.promote = promote;
            o.keep = keep;
            if (into.is_none()) {
              std::string out;
              check(nogil([&] {
                // One Redis script: the size and the bytes are the same object's.
                return s.store
                    ->get_unsized(
                        key,
                        [&](std::uint64_t size) -> Result<std::vector<Slice>> {
                          out.resize(size);
                          return std::vector<Slice>{{out.data(), out.size()}};
                        },
                        o)
                    .status();
              }));
              return py::bytes(out);
            }
            const Buffers buffers = buffer_slices(s, into, true);
            std::uint64_t room = 0;
            for (const Slice& sl : buffers.slices) room += sl.length;
            const ObjectInfo info = unwrap(nogil([&] { return s.store->get(key, buffers.slices, o); }));
            if (info.size != room) {
              raise(Status::invalid_argument("object " + key + " has " + std::to_string(info.size) +
                                             " bytes, the buffers " + std::to_string(room)));
            }
            return py::int_(info.size);
          },
          py::arg("key"), py::arg("into") = py::none(), py::arg("timeout_ms") = 0, py::arg("promote") = true,
          py::arg("keep") = py::none(),
          "The object's bytes; with `into`, buffers of exactly its size, read in place (zero-copy), and its "
          "size: writable buffer objects, or (address, bytes) pairs inside memory given to register_memory "
          "(any other address is refused with invalid_argument). promote=False: an object on a node's NVMe "
          "tier is not_found instead of staged back. keep: the use, for a turn-ttl cell (KeepHint).")
      .def(
          "register_memory",
          [](PyStore& s, std::uintptr_t addr, std::size_t length) {
            MemoryRegion region{.addr = reinterpret_cast<void*>(addr), .length = length};
            auto r = std::make_unique<PyStore::Registered>(PyStore::Registered{
                addr, length, unwrap(nogil([&] { return s.store->register_memory(region); }))});
            std::lock_guard lock(s.mu);
            s.registered.push_back(std::move(r));
          },
          py::arg("addr"), py::arg("length"),
          "Registers host memory that puts and gets will name buffers in, once (zero-copy for RDMA). It "
          "must stay allocated while the store lives.")
      .def(
          "remove",
          [](PyStore& s, const std::string& key, std::uint32_t timeout_ms) {
            check(nogil([&] { return s.store->remove(key, deadline_of(timeout_ms)); }));
          },
          py::arg("key"), py::arg("timeout_ms") = 0)
      .def(
          "remove_corrupt",
          [](PyStore& s, const std::string& key, std::uint32_t timeout_ms) {
            check(nogil([&] { return s.store->remove_corrupt(key, deadline_of(timeout_ms)); }));
          },
          py::arg("key"), py::arg("timeout_ms") = 0,
          "remove, of an object whose bytes were found bad: `kvstash explain` says it was corrupt.")
      .def(
          "announce",
          [](PyStore& s, const std::vector<std::pair<std::string, std::string>>& items,
             std::uint32_t timeout_ms) -> py::object {
            auto r = unwrap(nogil([&] { return s.store->announce(items, deadline_of(timeout_ms)); }));
            if (!r) return py::none();
            return py::int_(*r);
          },
          py::arg("items"), py::arg("timeout_ms") = 0,
          "KV events for routers: each (key, event data) whose key is present is published as stored by "
          "the cell's `kvstash events` relay, and its removal later with the same data. How many were "
          "announced; None when the cell's events are off.")
      .def(
          "contains_prefix",
          [](PyStore& s, const std::vector<std::string>& keys, std::uint32_t timeout_ms) {
            return unwrap(nogil([&] { return s.store->contains_prefix(keys, deadline_of(timeout_ms)); }));
          },
          py::arg("keys"), py::arg("timeout_ms") = 0,
          "How many leading keys of `keys` are stored (a scheduler's prefix check, no tensors needed).")
      .def(
          "lookup_prefix",
          [](PyStore& s, const std::vector<std::string>& keys, std::uint32_t timeout_ms) {
            const PrefixLookup found =
                unwrap(nogil([&] { return s.store->lookup_prefix(keys, deadline_of(timeout_ms)); }));
            return py::make_tuple(found.hit, found.turn, found.clock);
          },
          py::arg("keys"), py::arg("timeout_ms") = 0,
          "contains_prefix, with the request's conversation turn and the cell's turn-ttl clock (0 under "
          "another policy): (hit, turn, clock), what a turn-ttl cell's keep hints name.")
      .def(
          "contains_each",
          [](PyStore& s, const std::vector<std::string>& keys, std::uint32_t timeout_ms) {
            return unwrap(nogil([&] { return s.store->contains_each(keys, deadline_of(timeout_ms)); }));
          },
          py::arg("keys"), py::arg("timeout_ms") = 0,
          "Whether each of `keys` (one chain's objects) is stored, in one round trip: a hybrid model's "
          "lookup, whose KV-cache groups need different chunks.")
      .def(
          "metrics_text", [](PyStore& s) { return s.store->metrics_text(); },
          "This client's metrics in Prometheus' text exposition format (operations by outcome and "
          "latency, bytes per transport, KV-cache chunks, failed loads, layer waits), counted since "
          "open.")
      .def(
          "prefix_tiers",
          [](PyStore& s, const std::vector<std::string>& keys, std::uint32_t timeout_ms) {
            auto where = unwrap(nogil([&] { return s.store->prefix_tiers(keys, deadline_of(timeout_ms)); }));
            std::vector<std::string> out;
            for (Tier t : where) out.emplace_back(t == Tier::kSsd ? "ssd" : "dram");
            return out;
          },
          py::arg("keys"), py::arg("timeout_ms") = 0,
          "Where each leading stored key of `keys` is: 'dram' (a memory node's pool) or 'ssd' (its NVMe "
          "tier: a get stages it back first, a round trip and a device read more), to weigh a load against "
          "a recompute.")
      .def(
          "connect_nodes",
          [](PyStore& s, std::uint32_t timeout_ms) {
            return unwrap(nogil([&] { return s.store->connect_nodes(deadline_of(timeout_ms)); }));
          },
          py::arg("timeout_ms") = 0,
          "Connects to every live node of the cell now (off a first request's path); how many.");

  py::class_<PyHandoffs>(m, "KvHandoffs",
                         "The direct path's rendezvous records in the store's cell (kvstash/kvpeer.h).")
      .def(py::init([](std::shared_ptr<PyStore> s) {
             return PyHandoffs{s, KvHandoffs(*s->store)};
           }),
           py::arg("store"))
      .def(
          "publish",
          [](PyHandoffs& h, const std::string& name, const py::bytes& descriptor,
             const std::vector<std::string>& readers, std::uint64_t ttl_ms, std::uint32_t timeout_ms) {
            const std::string d = descriptor;
            check(nogil([&] {
              return h.records.publish(name, d, readers, std::chrono::milliseconds(ttl_ms),
                                       deadline_of(timeout_ms));
            }));
          },
          py::arg("name"), py::arg("descriptor"), py::arg("readers"), py::arg("ttl_ms"),
          py::arg("timeout_ms") = 0,
          "A handoff record: where this process holds memory for `readers`, for ttl_ms.")
      .def(
          "descriptor",
          [](PyHandoffs& h, const std::string& name, std::uint32_t timeout_ms) {
            return py::bytes(
                unwrap(nogil([&] { return h.records.descriptor(name, deadline_of(timeout_ms)); })));
          },
          py::arg("name"), py::arg("timeout_ms") = 0,
          "The handoff's descriptor (Error 'not_found' once it expired or every reader ended it).")
      .def(
          "end",
          [](PyHandoffs& h, const std::string& name, const std::string& reader, std::uint32_t timeout_ms) {
            return unwrap(nogil([&] { return h.records.end(name, reader, deadline_of(timeout_ms)); }));
          },
          py::arg("name"), py::arg("reader"), py::arg("timeout_ms") = 0,
          "`reader` is done: True when it was pending.")
      .def(
          "pending",
          [](PyHandoffs& h, const std::string& name, const std::string& reader, std::uint32_t timeout_ms) {
            return unwrap(nogil([&] { return h.records.pending(name, reader, deadline_of(timeout_ms)); }));
          },
          py::arg("name"), py::arg("reader"), py::arg("timeout_ms") = 0,
          "Whether `reader` has yet to end the handoff.");

  // KvSync: handles are ints (torch.cuda.Stream.cuda_stream, torch.cuda.Event.cuda_event).
  // KvSync() is CUDA's legacy default stream (torch's default stream has handle 0 too);
  // nothing to wait for is said with KvSync.none().
  py::class_<KvSync>(m, "KvSync")
      .def(py::init<>(), "The legacy default stream (a null cudaStream_t), as CUDA defines it.")
      .def_static(
          "stream", [](std::uintptr_t handle) { return KvSync::stream(reinterpret_cast<void*>(handle)); },
          py::arg("handle"), "Everything queued on the stream so far; 0 is the legacy default stream.")
      .def_static(
          "event", [](std::uintptr_t handle) { return KvSync::event(reinterpret_cast<void*>(handle)); },
          py::arg("handle"), "An event the engine recorded, as recorded now.")
      .def_static("none", &KvSync::none, "Nothing to wait for: the memory is final.")
      .def_property_readonly("kind",
                             [](const KvSync& s) {
                               return s.kind == KvSync::Kind::kStream  ? "stream"
                                      : s.kind == KvSync::Kind::kEvent ? "event"
                                                                       : "none";
                             })
      .def_property_readonly("handle",
                             [](const KvSync& s) { return reinterpret_cast<std::uintptr_t>(s.handle); })
      .def("__repr__", [](const KvSync& s) {
        if (s.kind == KvSync::Kind::kNone) return std::string("KvSync.none()");
        return std::string(s.kind == KvSync::Kind::kStream ? "KvSync.stream(" : "KvSync.event(") +
               std::to_string(reinterpret_cast<std::uintptr_t>(s.handle)) + ")";
      });

  py::class_<PySave, std::shared_ptr<PySave>>(m, "KvSave")
      .def(
          "save_layer",
          [](PySave& s, std::uint32_t layer, const KvSync& after) {
            check(nogil([&] { return s.save.save_layer(layer, after); }));
          },
          py::arg("layer"), py::arg("after") = KvSync{},
          "Writes the layer once the engine's work up to `after` is done (default: the legacy default "
          "stream); returns at once.")
      .def("wait", [](PySave& s) { return statuses(nogil([&] { return s.save.wait(); })); })
      .def("cancel", [](PySave& s) { nogil([&] { s.save.cancel(); }); })
      .def(
          "keys", [](const PySave& s) { return s.save.keys(); },
          "The keys of the objects the save writes, chunk by chunk (KvCache.objects_per_chunk() each).")
      .def(
          "announced", [](const PySave& s) { return s.save.announced(); },
          "After wait(): how many chunks' event data the cell recorded (0 while its events are off).");

  py::class_<PyLoad, std::shared_ptr<PyLoad>>(m, "KvLoad")
      .def(
          "wait_layer",
          [](PyLoad& l, std::uint32_t layer) { check(nogil([&] { return l.load.wait_layer(layer); })); },
          py::arg("layer"))
      .def(
          "layer_ready", [](const PyLoad& l, std::uint32_t layer) { return l.load.layer_ready(layer); },
          py::arg("layer"))
      // `stream`: a raw cudaStream_t (torch.cuda.current_stream().cuda_stream; 0 is the legacy
      // default stream); layer_event's result is a raw cudaEvent_t (an int) owned by the load.
      .def(
          "wait_layer_on",
          [](PyLoad& l, std::uint32_t layer, std::uintptr_t stream) {
            check(l.load.wait_layer_on(layer, reinterpret_cast<void*>(stream)));
          },
          py::arg("layer"), py::arg("stream"),
          "The stream waits on the GPU for the layer, then places it itself; the caller does not block.")
      .def(
          "layer_event",
          [](PyLoad& l, std::uint32_t layer) {
            return reinterpret_cast<std::uintptr_t>(unwrap(l.load.layer_event(layer)));
          },
          py::arg("layer"))
      .def("wait", [](PyLoad& l) { return statuses(nogil([&] { return l.load.wait(); })); })
      .def(
          "object_statuses",
          [](PyLoad& l) { return statuses(nogil([&] { return l.load.object_statuses(); })); },
          "Waits, then (code, message) per object (KvCache.objects_per_chunk a chunk), unfolded.")
      .def("cancel", [](PyLoad& l) { nogil([&] { l.load.cancel(); }); })
      .def(
          "failed_blocks", [](PyLoad& l) { return nogil([&] { return l.load.failed_blocks(); }); },
          "Waits, then the block ids whose chunk did not load whole: what to recompute.");

  py::class_<PyKvCache, std::shared_ptr<PyKvCache>>(m, "KvCache")
      .def(py::init([](std::shared_ptr<PyStore> store, const py::object& layer_tensors,
                       std::uint32_t num_blocks, std::uint32_t block_size, std::uint32_t num_kv_heads,
                       std::uint32_t head_dim, const std::string& dtype, const std::string& order, bool mla,
                       const std::string& arrangement, const std::string& model, std::uint32_t tp_rank,
                       std::uint32_t tp_size, std::uint32_t chunk_tokens, const std::string& extra,
                       const std::string& memory_kind, const std::string& staging, const py::object& base,
                       std::uint32_t num_layers, bool joint_kv, std::uint32_t heads_total,
                       std::uint32_t head_first, std::uint32_t head_count, std::uint32_t layers_total,
                       std::uint32_t layer_first, const std::string& group) {
             auto dt = parse_kv_dtype(dtype);
             if (!dt) raise(Status::invalid_argument("unknown dtype '" + dtype + "'"));
             if (order != "nhd" && order != "hnd") raise(Status::invalid_argument("order is 'nhd' or 'hnd'"));
             if (memory_kind != "host" && memory_kind != "cuda") {
               raise(Status::invalid_argument("memory_kind is 'host' or 'cuda'"));
             }
             const bool cross = arrangement == "cross_layer";
             if (!cross && arrangement != "per_layer" && arrangement != "per_layer_blocks_first") {
               raise(Status::invalid_argument(
                   "arrangement is 'per_layer', 'per_layer_blocks_first' or 'cross_layer'"));
             }
             if (cross != !base.is_none()) {
               raise(Status::invalid_argument("base is the region of the cross_layer arrangement (only)"));
             }
             if (cross == !layer_tensors.is_none()) {
               raise(Status::invalid_argument("layer_tensors are the per-layer arrangements' (only)"));
             }
             py::list tensors = cross ? py::list() : py::list(layer_tensors);
             if (num_layers == 0) num_layers = static_cast<std::uint32_t>(tensors.size());
             KvCacheShape shape{.num_layers = num_layers,
                                .num_blocks = num_blocks,
                                .block_size = block_size,
                                .num_kv_heads = num_kv_heads,
                                .head_dim = head_dim,
                                .dtype = *dt,
                                .order = order == "hnd" ? KvBlockOrder::kHND : KvBlockOrder::kNHD,
                                .mla = mla,
                                .joint_kv = joint_kv};
             check(shape.validate());
             auto out = std::make_shared<PyKvCache>();
             out->store = store;
             const std::size_t per_layer = shape.parts() * std::size_t{num_blocks} * shape.block_bytes();
             const MemoryKind kind = memory_kind == "cuda" ? MemoryKind::kCuda : MemoryKind::kHost;
             Result<KvLayout> layout = Status::internal("unset");
             if (cross) {
               layout =
                   KvLayout::cross_layer(shape, address_of(base, per_layer * num_layers, out->buffers), kind);
             } else {
               if (tensors.size() != num_layers) {
                 raise(Status::invalid_argument("num_layers is " + std::to_string(num_layers) +
                                                ", layer_tensors has " + std::to_string(tensors.size())));
               }
               std::vector<void*> ptrs;
               for (const auto& t : tensors) ptrs.push_back(address_of(t, per_layer, out->buffers));
               layout = arrangement == "per_layer" ? KvLayout::per_layer(shape, ptrs, kind)
                                                   : KvLayout::per_layer_blocks_first(shape, ptrs, kind);
             }
             KvLayout l = unwrap(std::move(layout));
             KvCacheOptions options;
             if (staging == "none") {
               options.path = KvPath::kDirect;
             } else if (staging == "host") {
               options.device = host_device();
               options.path = KvPath::kStaged;
             } else if (staging == "cuda") {
               options.device = unwrap(cuda_device_of(l));  // on the GPU that owns the tensors, not GPU 0
               options.path = KvPath::kStaged;
             } else if (staging != "auto") {
               raise(Status::invalid_argument("staging is 'auto', 'none', 'host' or 'cuda'"));
             }
             PrefixKeyOptions keys{.model = model,
                                   .tp_rank = tp_rank,
                                   .tp_size = tp_size,
                                   .chunk_tokens = chunk_tokens,
                                   .extra = extra,
                                   .heads_total = heads_total,
                                   .head_first = head_first,
                                   .head_count = head_count,
                                   .layers_total = layers_total,
                                   .layer_first = layer_first,
                                   .group = group};
             out->kv = unwrap(nogil([&] {
               return KvCache::open(*store->store, std::move(l), std::move(keys), std::move(options));
             }));
             return out;
           }),
           py::arg("store"), py::arg("layer_tensors") = py::none(), py::arg("num_blocks"),
           py::arg("block_size"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("dtype") = std::string(to_string(kShapeDefaults.dtype)),
           py::arg("order") = std::string(order_name(kShapeDefaults.order)),
           py::arg("mla") = kShapeDefaults.mla, py::arg("arrangement") = "per_layer", py::arg("model"),
           py::arg("tp_rank") = kKeyDefaults.tp_rank, py::arg("tp_size") = kKeyDefaults.tp_size,
           py::arg("chunk_tokens") = kKeyDefaults.chunk_tokens, py::arg("extra") = kKeyDefaults.extra,
           py::arg("memory_kind") = std::string(memory_kind_name(MemoryKind::kHost)),
           py::arg("staging") = "auto", py::arg("base") = py::none(),
           py::arg("num_layers") = kShapeDefaults.num_layers, py::arg("joint_kv") = kShapeDefaults.joint_kv,
           py::arg("heads_total") = kKeyDefaults.heads_total, py::arg("head_first") = kKeyDefaults.head_first,
           py::arg("head_count") = kKeyDefaults.head_count,
           py::arg("layers_total") = kKeyDefaults.layers_total,
           py::arg("layer_first") = kKeyDefaults.layer_first, py::arg("group") = kKeyDefaults.group,
           "A KV cache over the engine's tensors: KvCacheShape's fields, the KvLayout constructor's "
           "(arrangement 'per_layer', 'per_layer_blocks_first': layer_tensors, one per layer, as ints "
           "(data_ptr()) or writable buffers; 'cross_layer': base, the one region, and num_layers; "
           "memory_kind 'host' or 'cuda'), PrefixKeyOptions' fields, and staging ('auto', 'none', 'host', "
           "'cuda': KvCacheOptions' path and device). num_layers 0: len(layer_tensors).")
      .def_property_readonly("chunk_tokens",
                             [](const PyKvCache& k) { return k.kv->key_options().chunk_tokens; })
      .def_property_readonly("chunk_bytes", [](const PyKvCache& k) { return k.kv->chunk_bytes(); })
      .def_property_readonly("objects_per_chunk",
                             [](const PyKvCache& k) { return k.kv->objects_per_chunk(); })
      .def_property_readonly("layout_tag", [](const PyKvCache& k) { return k.kv->key_options().layout_tag; })
      .def_property_readonly("data_path", [](const PyKvCache& k) { return std::string(k.kv->data_path()); })
      .def_property_readonly("device", [](const PyKvCache& k) { return std::string(k.kv->device().name()); })
      .def(
          "keys",
          [](const PyKvCache& k, const std::vector<std::uint32_t>& tokens,
             const std::vector<std::string>& chunk_salts) {
            return k.kv->keys({tokens, chunk_salts});
          },
          py::arg("tokens"), py::arg("chunk_salts") = std::vector<std::string>{})
      .def(
          "contains_prefix",
          [](PyKvCache& k, const std::vector<std::uint32_t>& tokens, std::uint32_t timeout_ms,
             const std::vector<std::string>& chunk_salts) {
            return unwrap(nogil([&] {
              return k.kv->contains_prefix({tokens, chunk_salts}, deadline_of(timeout_ms));
            }));
          },
          py::arg("tokens"), py::arg("timeout_ms") = 0, py::arg("chunk_salts") = std::vector<std::string>{})
      .def(
          "lookup_prefix",
          [](PyKvCache& k, const std::vector<std::uint32_t>& tokens, std::uint32_t timeout_ms,
             const std::vector<std::string>& chunk_salts) {
            const KvLookup found = unwrap(nogil([&] {
              return k.kv->lookup_prefix({tokens, chunk_salts}, deadline_of(timeout_ms));
            }));
            return py::make_tuple(found.chunks, found.keep);
          },
          py::arg("tokens"), py::arg("timeout_ms") = 0, py::arg("chunk_salts") = std::vector<std::string>{},
          "contains_prefix, with what the request's loads and saves tell a turn-ttl cell: (chunks, KvKeep); "
          "pass the KvKeep as their keep.")
      .def(
          "begin_save",
          [](std::shared_ptr<PyKvCache> k, const std::vector<std::uint32_t>& tokens,
             const std::vector<std::uint32_t>& block_ids, std::size_t first, std::size_t count,
             std::uint32_t timeout_ms, const std::vector<std::string>& chunk_salts,
             const std::optional<KvKeep>& keep, const std::vector<std::string>& events) {
            auto s = std::make_shared<PySave>();
            s->kv = k;
            s->save = unwrap(nogil([&] {
              return k->kv->begin_save({tokens, chunk_salts}, block_ids, first, count,
                                       deadline_of(timeout_ms), keep, events);
            }));
            return s;
          },
          py::arg("tokens"), py::arg("block_ids"), py::arg("first"), py::arg("count"),
          py::arg("timeout_ms") = 0, py::arg("chunk_salts") = std::vector<std::string>{},
          py::arg("keep") = py::none(), py::arg("events") = std::vector<std::string>{},
          "Starts a layer-wise save of chunks [first, first + count). `events`: none, or each chunk's "
          "event data (msgpack, docs/events.md), recorded by the chunks' commits while the cell's events "
          "are on.")
      .def(
          "begin_load",
          [](std::shared_ptr<PyKvCache> k, const std::vector<std::uint32_t>& tokens,
             const std::vector<std::uint32_t>& block_ids, std::size_t count, std::uint32_t timeout_ms,
             const KvSync& after, const std::vector<std::string>& chunk_salts,
             const std::optional<KvKeep>& keep) {
            auto l = std::make_shared<PyLoad>();
            l->kv = k;
            l->load = unwrap(nogil([&] {
              return k->kv->begin_load({tokens, chunk_salts}, block_ids, count, deadline_of(timeout_ms),
                                       after, keep);
            }));
            return l;
          },
          py::arg("tokens"), py::arg("block_ids"), py::arg("count"), py::arg("timeout_ms") = 0,
          py::arg("after") = KvSync{}, py::arg("chunk_salts") = std::vector<std::string>{},
          py::arg("keep") = py::none(),
          "Loads the first `count` chunks, writing no block before the engine's work up to `after`.")
      .def(
          "begin_load_range",
          [](std::shared_ptr<PyKvCache> k, const std::vector<std::uint32_t>& tokens,
             const std::vector<std::uint32_t>& block_ids, std::size_t first, std::size_t count,
             std::uint32_t timeout_ms, const KvSync& after, const std::vector<std::string>& chunk_salts,
             const std::optional<KvKeep>& keep) {
            auto l = std::make_shared<PyLoad>();
            l->kv = k;
            l->load = unwrap(nogil([&] {
              return k->kv->begin_load_range({tokens, chunk_salts}, block_ids, first, count,
                                             deadline_of(timeout_ms), after, keep);
            }));
            return l;
          },
          py::arg("tokens"), py::arg("block_ids"), py::arg("first"), py::arg("count"),
          py::arg("timeout_ms") = 0, py::arg("after") = KvSync{},
          py::arg("chunk_salts") = std::vector<std::string>{}, py::arg("keep") = py::none(),
          "Loads chunks [first, first + count) only; statuses count from `first`.");

  py::class_<PyKvExport, std::shared_ptr<PyKvExport>>(m, "KvExport")
      .def(py::init([](std::shared_ptr<PyKvCache> kv) {
             auto out = std::make_shared<PyKvExport>();
             out->kv = kv;
             out->out = unwrap(nogil([&] { return KvExport::open(*kv->store->store, kv->kv->layout()); }));
             return out;
           }),
           py::arg("cache"),
           "The cache's memory, readable by peers under leases (KvExport::open over the cache's store and "
           "layout).")
      .def_property_readonly("descriptor", [](const PyKvExport& e) { return py::bytes(e.out->descriptor()); })
      .def(
          "fence", [](PyKvExport& e, std::uint64_t through) { nogil([&] { e.out->fence(through); }); },
          py::arg("through"), "Ends every lease whose fence tag is <= through; returns once none can read.")
      .def(
          "grant",
          [](const PyKvExport& e, const std::vector<std::uint32_t>& blocks, std::uint64_t fence) {
            return py::bytes(unwrap(e.out->grant(blocks, fence)));
          },
          py::arg("blocks"), py::arg("fence"),
          "What a reader of `blocks` needs until the export fences through `fence` (KvExport::grant): "
          "hand it over with the blocks.");

  py::class_<PyPeerRead, std::shared_ptr<PyPeerRead>>(m, "KvPeerRead")
      .def("poll", [](PyPeerRead& r) { return r.read.poll(); })
      .def("wait", [](PyPeerRead& r) { check(nogil([&] { return r.read.wait(); })); })
      .def("cancel", [](PyPeerRead& r) { nogil([&] { r.read.cancel(); }); })
      .def_property_readonly("bytes", [](const PyPeerRead& r) { return r.read.bytes(); });

  py::class_<PyKvImport, std::shared_ptr<PyKvImport>>(m, "KvImport")
      .def(py::init([](std::shared_ptr<PyKvCache> kv) {
             auto out = std::make_shared<PyKvImport>();
             out->kv = kv;
             out->in = unwrap(nogil([&] { return KvImport::open(*kv->store->store, kv->kv->layout()); }));
             return out;
           }),
           py::arg("cache"), "Reads peers' exported blocks into the cache's blocks.")
      .def(
          "begin_read",
          [](std::shared_ptr<PyKvImport> in, const py::bytes& descriptor,
             const std::vector<std::uint32_t>& remote_blocks, const std::vector<std::uint32_t>& local_blocks,
             std::uint64_t fence, std::uint64_t ttl_ms, std::uint32_t timeout_ms, const py::bytes& grant,
             std::uint32_t heads, std::uint32_t remote_head_first, std::uint32_t local_head_first) {
            const std::string d = descriptor;
            auto r = std::make_shared<PyPeerRead>();
            r->in = in;
            const KvPeerReadOptions o{.fence = fence,
                                      .ttl = std::chrono::milliseconds(ttl_ms),
                                      .grant = grant,
                                      .heads = heads,
                                      .remote_head_first = remote_head_first,
                                      .local_head_first = local_head_first};
            const Deadline deadline =
                deadline_of(timeout_ms).value_or(deadline_after(kStoreDefaults.timeout));
            r->read = unwrap(
                nogil([&] { return in->in->begin_read(d, remote_blocks, local_blocks, o, deadline); }));
            return r;
          },
          py::arg("descriptor"), py::arg("remote_blocks"), py::arg("local_blocks"),
          py::arg("fence") = KvPeerReadOptions{}.fence,
          py::arg("ttl_ms") = static_cast<std::uint64_t>(KvPeerReadOptions{}.ttl.count()),
          py::arg("timeout_ms") = 0, py::arg("grant") = py::bytes(),
          py::arg("heads") = KvPeerReadOptions{}.heads,
          py::arg("remote_head_first") = KvPeerReadOptions{}.remote_head_first,
          py::arg("local_head_first") = KvPeerReadOptions{}.local_head_first,
          "Reads remote_blocks of the export into local_blocks, every layer (KvImport::begin_read), under "
          "the exporter's grant (KvExport.grant); with `heads`, those heads of each block only (a peer of "
          "another tensor-parallel degree).");

  m.def(
      "prefix_chunk_keys",
      [](const std::vector<std::uint32_t>& tokens, const std::string& model, const std::string& layout_tag,
         std::uint32_t tp_rank, std::uint32_t tp_size, std::uint32_t chunk_tokens, const std::string& extra,
         const std::vector<std::string>& chunk_salts, std::uint32_t heads_total, std::uint32_t head_first,
         std::uint32_t head_count, std::uint32_t layers_total, std::uint32_t layer_first,
         std::uint32_t layer_count, std::uint32_t groups, const std::string& group) {
        return prefix_object_keys({tokens, chunk_salts},
                                  {.model = model,
                                   .layout_tag = layout_tag,
                                   .tp_rank = tp_rank,
                                   .tp_size = tp_size,
                                   .chunk_tokens = chunk_tokens,
                                   .extra = extra,
                                   .heads_total = heads_total,
                                   .head_first = head_first,
                                   .head_count = head_count,
                                   .layers_total = layers_total,
                                   .layer_first = layer_first,
                                   .layer_count = layer_count,
                                   .group = group},
                                  groups);
      },
      py::arg("tokens"), py::arg("model"), py::arg("layout_tag"), py::arg("tp_rank") = kKeyDefaults.tp_rank,
      py::arg("tp_size") = kKeyDefaults.tp_size, py::arg("chunk_tokens") = kKeyDefaults.chunk_tokens,
      py::arg("extra") = kKeyDefaults.extra, py::arg("chunk_salts") = std::vector<std::string>{},
      py::arg("heads_total") = kKeyDefaults.heads_total, py::arg("head_first") = kKeyDefaults.head_first,
      py::arg("head_count") = kKeyDefaults.head_count, py::arg("layers_total") = kKeyDefaults.layers_total,
      py::arg("layer_first") = kKeyDefaults.layer_first, py::arg("layer_count") = kKeyDefaults.layer_count,
      py::arg("groups") = 1, py::arg("group") = kKeyDefaults.group,
      "The keys of the full chunks of `tokens` (prefix_chunk_keys); chunk_salts[c], bytes, names what chunk "
      "c's KV was computed from besides its tokens (KvTokens). heads_total set: the keys of the objects "
      "of heads [head_first, head_first + head_count), and with `groups` of that many such groups, chunk by "
      "chunk (prefix_object_keys); layers_total set: of a pipeline stage's layers; group set: of a "
      "hybrid model's KV-cache group (PrefixKeyOptions).");
}
