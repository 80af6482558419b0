#include "metadata/cell.h"

#include "metadata/catalog_common.h"

namespace kvstash::metadata {

Result<std::unique_ptr<Cell>> Cell::open(const CellOptions& options) {
  KVSTASH_ASSIGN_OR_RETURN(auto redis, RedisClient::connect(options.redis));
  return std::unique_ptr<Cell>(new Cell(std::move(redis), options.cell));
}

Cell::Cell(std::unique_ptr<RedisClient> redis, std::string name)
    : redis_(std::move(redis)),
      name_(std::move(name)),
      catalog_(*redis_, name_),
      node_catalog_(*redis_, name_),
      admin_(*redis_, name_) {}

Status Cell::check_schema() { return detail::check_schema(*redis_, prefix()); }

}  // namespace kvstash::metadata
