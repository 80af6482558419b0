// KvHandoffs: the direct path's rendezvous records, kept in the store's cells.
#include "kvstash/kvpeer.h"
#include "store/cell_records.h"

namespace kvstash {

Status KvHandoffs::publish(std::string_view name, std::string_view descriptor,
                           std::span<const std::string> readers, std::chrono::milliseconds ttl,
                           std::optional<Deadline> deadline) {
  return store::CellRecords::publish_handoff(*store_, name, descriptor, readers, ttl, deadline);
}

Result<std::string> KvHandoffs::descriptor(std::string_view name, std::optional<Deadline> deadline) {
  return store::CellRecords::handoff(*store_, name, deadline);
}

Result<bool> KvHandoffs::end(std::string_view name, std::string_view reader,
                             std::optional<Deadline> deadline) {
  return store::CellRecords::end_handoff(*store_, name, reader, deadline);
}

Result<bool> KvHandoffs::pending(std::string_view name, std::string_view reader,
                                 std::optional<Deadline> deadline) {
  return store::CellRecords::handoff_pending(*store_, name, reader, deadline);
}

}  // namespace kvstash
