// The records the KV layer keeps in a store's cells beside the objects: kvpeer's handoffs
// (KvHandoffs, src/kvcache/kv_handoffs.cc). Each is one of the cell's scripts, run in the cell
// a put of the record's name would go to (every process opened on the same cells finds the
// same one), with the store's deadline: the deadline given, else the store's timeout.
#pragma once

#include <chrono>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kvstash/status.h"
#include "kvstash/store.h"

namespace kvstash::store {

class CellRecords {
 public:
  static Status publish_handoff(Store& store, std::string_view name, std::string_view descriptor,
                                std::span<const std::string> readers, std::chrono::milliseconds ttl,
                                std::optional<Deadline> deadline);
  static Result<std::string> handoff(Store& store, std::string_view name, std::optional<Deadline> deadline);
  static Result<bool> end_handoff(Store& store, std::string_view name, std::string_view reader,
                                  std::optional<Deadline> deadline);
  static Result<bool> handoff_pending(Store& store, std::string_view name, std::string_view reader,
                                      std::optional<Deadline> deadline);
};

}  // namespace kvstash::store
