#include "store/cell_records.h"

#include "store/store_internal.h"

namespace kvstash::store {

Status CellRecords::publish_handoff(Store& store, std::string_view name, std::string_view descriptor,
                                    std::span<const std::string> readers, std::chrono::milliseconds ttl,
                                    std::optional<Deadline> deadline) {
  return store.impl_->with_catalog(name, deadline, [&](metadata::Catalog& c) {
    return c.publish_handoff(name, descriptor, readers, ttl);
  });
}

Result<std::string> CellRecords::handoff(Store& store, std::string_view name,
                                         std::optional<Deadline> deadline) {
  return store.impl_->with_catalog(name, deadline, [&](metadata::Catalog& c) { return c.handoff(name); });
}

Result<bool> CellRecords::end_handoff(Store& store, std::string_view name, std::string_view reader,
                                      std::optional<Deadline> deadline) {
  return store.impl_->with_catalog(name, deadline,
                                   [&](metadata::Catalog& c) { return c.end_handoff(name, reader); });
}

Result<bool> CellRecords::handoff_pending(Store& store, std::string_view name, std::string_view reader,
                                          std::optional<Deadline> deadline) {
  return store.impl_->with_catalog(name, deadline,
                                   [&](metadata::Catalog& c) { return c.handoff_pending(name, reader); });
}

}  // namespace kvstash::store
