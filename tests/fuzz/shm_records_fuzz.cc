// The shm transport's address and packed remote key (src/transport/shm/shm_internal.h), as a
// peer or Redis hands them to connect/can_reach and import_key. The input is one record,
// given to both decoders; what decodes must re-encode to exactly the input (every field is
// kept), and a decoded address's socket path must fit a sockaddr_un.
#include <sys/un.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_util.h"
#include "transport/shm/shm_internal.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvstash;
  using namespace kvstash::transport::shm;
  const std::string_view in(reinterpret_cast<const char*>(data), size);

  if (auto a = decode_address(in); a.is_ok()) {
    FUZZ_CHECK(encode_address(*a) == in, "an address re-encodes to other bytes");
    FUZZ_CHECK(!a->socket_path.empty() && a->socket_path.size() < sizeof(sockaddr_un::sun_path),
               "a decoded socket path does not fit sockaddr_un");
  } else {
    FUZZ_CHECK(a.status().code() == StatusCode::kInvalidArgument, "address refused with %s",
               a.status().to_string().c_str());
  }
  if (auto k = decode_key(in); k.is_ok()) {
    FUZZ_CHECK(encode_key(*k) == in, "a key re-encodes to other bytes");
    FUZZ_CHECK(k->slot >= kFirstKeySlot && k->slot < kKeySlots && k->key != 0, "a decoded key names no slot");
  } else {
    FUZZ_CHECK(k.status().code() == StatusCode::kInvalidArgument, "key refused with %s",
               k.status().to_string().c_str());
  }
  return 0;
}
