// Engine address and remote-key blobs (src/engine/blobs.h), as a peer or Redis hands them to
// Engine::connect and Peer::import_key. The input is one blob. It is decoded both ways (an
// address, a key) and re-encoded, which must decode to the same parts; each part goes to the
// tcp and shm transports' can_reach (their address decoders); the blob is offered to a real
// Engine::connect (forced onto a transport that engine lacks, so nothing dials out) and
// imported as a key through a real Peer connected over tcp, which runs the tcp key decoder.
// Its hex text form goes through from_text.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "engine/blobs.h"
#include "fuzz_util.h"
#include "kvstash/engine.h"
#include "kvstash/memory.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace kvstash {
namespace {

struct World {
  std::unique_ptr<transport::Transport> tcp;
  std::unique_ptr<transport::Transport> shm;
  std::unique_ptr<Engine> target;
  std::unique_ptr<Engine> initiator;
  Buffer buffer;
  MemoryHandle handle;
  std::unique_ptr<Peer> peer;
};

World& world() {
  static World* w = [] {
    fuzz::quiet_logs();
    auto* w = new World;
    w->tcp = fuzz::must(transport::make_tcp_transport({}), "tcp transport");
    const auto dir = fuzz::scratch_dir("blobs");
    w->shm =
        fuzz::must(transport::make_shm_transport({.socket_dir = (dir / "shm").string()}), "shm transport");
    EngineOptions o;
    o.transports = {TransportKind::kTcp};
    o.tcp.streams = 1;
    o.tcp.io_threads = 1;
    w->target = fuzz::must(Engine::create(o), "target engine");
    w->initiator = fuzz::must(Engine::create(o), "initiator engine");
    w->buffer = fuzz::must(Buffer::allocate(4096), "buffer");
    w->handle = fuzz::must(w->target->register_memory(w->buffer.region(), Access::kRemote), "register");
    w->peer = fuzz::must(w->initiator->connect(w->target->address()), "connect");
    return w;
  }();
  return *w;
}

bool same(const blobs::Decoded& a, const blobs::Decoded& b) {
  return a.base == b.base && a.length == b.length && a.parts == b.parts;
}

// Decodes `blob` as a record with `magic`; when it decodes, its encoding decodes to the same
// thing, and is the input itself when no part was left out (a transport this build lacks).
void round_trip(std::string_view blob, std::uint32_t magic, bool with_range) {
  auto d = blobs::decode_parts(blob, magic, with_range);
  if (!d) return;
  const std::string again = blobs::encode_parts(magic, d->base, d->length, d->parts, with_range);
  auto d2 = blobs::decode_parts(again, magic, with_range);
  FUZZ_CHECK(d2 && same(*d, *d2), "re-encoded blob decodes differently");
  const std::size_t count_at = with_range ? 20 : 4;
  if (static_cast<unsigned char>(blob[count_at]) == d->parts.size()) {
    FUZZ_CHECK(again == blob, "a blob with only known parts re-encodes to other bytes");
  }
}

}  // namespace
}  // namespace kvstash

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvstash;
  World& w = world();
  const std::string_view blob(reinterpret_cast<const char*>(data), size);

  round_trip(blob, blobs::kAddressMagic, false);
  round_trip(blob, blobs::kKeyMagic, true);

  if (auto address = blobs::decode_parts(blob, blobs::kAddressMagic, false)) {
    for (const auto& part : address->parts) {
      (void)w.tcp->can_reach(part.second);
      (void)w.shm->can_reach(part.second);
    }
  }
  // A transport the engine does not run: the address is decoded and checked, nothing dials.
  auto peer = w.initiator->connect(blob, deadline_after(std::chrono::milliseconds(100)), TransportKind::kUcx);
  FUZZ_CHECK(!peer.is_ok(), "connect succeeded over a transport the engine lacks");

  auto imported = w.peer->import_key(blob, deadline_after(std::chrono::milliseconds(500)));
  if (imported.is_ok()) {
    auto d = blobs::decode_parts(blob, blobs::kKeyMagic, true);
    FUZZ_CHECK(d.has_value(), "import_key took a key decode_parts refuses");
    FUZZ_CHECK(imported->base() == d->base && imported->length() == d->length, "imported range differs");
  } else {
    const auto code = imported.status().code();
    FUZZ_CHECK(code == StatusCode::kInvalidArgument || code == StatusCode::kUnsupported ||
                   code == StatusCode::kPermissionDenied,
               "import_key failed with %s", imported.status().to_string().c_str());
  }

  auto text = from_text(to_text(blob));
  FUZZ_CHECK(text.is_ok() && *text == blob, "to_text/from_text lost bytes");
  (void)from_text(blob);
  return 0;
}
