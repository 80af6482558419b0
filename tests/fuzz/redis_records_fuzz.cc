// The text fields of the records kvstash keeps in Redis, parsed wherever a record is read:
// an object's extent list ("node,page,generation;...": metadata::parse_extents), the layout
// string a KV-cache chunk's object carries ("<tag>;xxh3=<16 hex>,...": kvcache::parse_layout)
// and a KV dtype name (parse_kv_dtype). The input's byte 0 is the layer count the layout is
// read for, the rest is the text, given to every parser. What parses must print back as
// itself (layout, dtype) or parse again to the same extents.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "kvcache/object_layout.h"
#include "kvstash/kvcache.h"
#include "metadata/records.h"

namespace {

// A tag as KvLayout::tag() makes one.
constexpr std::string_view kTag = "L2.P2.H8.D128.B16.bf16.nhd";

std::string print(const std::vector<kvstash::metadata::Extent>& extents) {
  std::string s;
  for (const auto& e : extents) {
    if (!s.empty()) s += ';';
    s += e.node + "," + std::to_string(e.page) + "," + std::to_string(e.generation);
  }
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvstash;
  if (size == 0) return -1;
  const std::uint32_t layers = data[0];
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);

  if (auto e = metadata::parse_extents(text); e.is_ok()) {
    for (const auto& x : *e)
      FUZZ_CHECK(!x.node.empty() && x.generation > 0, "an extent without node or generation");
    auto again = metadata::parse_extents(print(*e));
    FUZZ_CHECK(again.is_ok() && *again == *e, "printed extents parse differently");
  } else {
    FUZZ_CHECK(e.status().code() == StatusCode::kCorrupt, "extents refused with %s",
               e.status().to_string().c_str());
  }

  if (auto sums = kvcache::parse_layout(text, kTag, layers)) {
    FUZZ_CHECK(sums->size() == layers, "%zu checksums for %u layers", sums->size(), layers);
    FUZZ_CHECK(kvcache::object_layout(std::string(kTag), *sums) == text, "a layout prints back differently");
  }

  if (auto t = parse_kv_dtype(text)) {
    FUZZ_CHECK(to_string(*t) == text || text == "fp8", "dtype %.*s prints as another name",
               static_cast<int>(text.size()), text.data());
  }
  return 0;
}
