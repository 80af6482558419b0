// The deployment's cells as the store routes over them: one cell (StoreOptions::cell),
// several (StoreOptions::cells), or the Redis's cell directory (StoreOptions::cell_directory,
// read again now and then). Which cell a key goes to: metadata/cell_routes.h.
#include "common/log.h"
#include "metadata/cell_directory.h"
#include "metadata/cell_routes.h"
#include "store/store_internal.h"

namespace kvstash {

namespace {

metadata::RedisOptions redis_options(const StoreOptions& o) {
  metadata::RedisOptions r;
  r.url = o.redis_url;
  r.password = o.redis_password;
  r.command_timeout = o.redis_timeout;
  r.connect_timeout = o.redis_timeout;
  return r;
}

}  // namespace

Status Store::Impl::load_cell_map(Deadline deadline) {
  auto m = std::make_shared<store::CellMap>();
  if (options.cell_directory) {
    std::lock_guard lock(refresh_mu);
    if (!directory) {
      metadata::RedisOptions r = redis_options(options);
      r.cluster_key = metadata::kCellDirectoryKey;
      KVSTASH_ASSIGN_OR_RETURN(directory, metadata::RedisClient::connect(r));
    }
    directory->set_deadline(deadline);
    auto d = metadata::read_cell_directory(*directory);
    directory->set_deadline(std::nullopt);
    map_read_at = Clock::now();
    if (!d.is_ok()) return d.status().with_context("store: reading the cell directory");
    if (!*d) {
      return Status::not_found("store: cell_directory is set, but " + directory->url().redacted() +
                               " holds no cell directory (kvstash cells set NAME,...)");
    }
    m->cells = (*d)->cells;
    m->previous = (*d)->previous;
    m->epoch = (*d)->epoch;
  } else if (!options.cells.empty()) {
    m->cells = options.cells;
    m->previous = options.previous_cells;
  } else {
    m->cells = {options.cell};
  }

  std::lock_guard lock(cells_mu);
  auto open = [&](const std::string& name) -> Result<store::CellLink*> {
    if (auto it = cell_links.find(name); it != cell_links.end()) return it->second.get();
    auto link = std::make_unique<store::CellLink>();
    link->name = name;
    KVSTASH_ASSIGN_OR_RETURN(
        link->pool,
        metadata::CellPool::open({.redis = redis_options(options), .cell = name}, options.redis_connections));
    KVSTASH_ASSIGN_OR_RETURN(auto c, link->pool->borrow(deadline));
    KVSTASH_RETURN_IF_ERROR(c.cell().check_schema().with_context("cell " + name));
    return cell_links.emplace(name, std::move(link)).first->second.get();
  };
  for (const auto& name : m->cells) {
    KVSTASH_ASSIGN_OR_RETURN(auto* link, open(name));
    m->links.push_back(link);
  }
  for (const auto& name : m->previous) {
    KVSTASH_ASSIGN_OR_RETURN(auto* link, open(name));
    m->previous_links.push_back(link);
  }
  if (map && map->epoch != m->epoch) {
    KVSTASH_LOG_INFO("store: the cell directory changed (epoch {}): {} cells, {} draining", m->epoch,
                     m->cells.size(), m->previous.size());
  }
  map = std::move(m);
  return {};
}

std::shared_ptr<const store::CellMap> Store::Impl::cell_map(Deadline deadline) {
  if (options.cell_directory) {
    std::unique_lock refreshing(refresh_mu, std::try_to_lock);
    // One caller reads the directory again; the others route by the map they have.
    if (refreshing.owns_lock() && Clock::now() - map_read_at > options.cell_directory_refresh) {
      map_read_at = Clock::now();
      refreshing.unlock();
      Status s = load_cell_map(deadline);
      if (!s.is_ok()) KVSTASH_LOG_WARN("store: keeping the cells it routes over: {}", s.to_string());
    }
  }
  std::lock_guard lock(cells_mu);
  return map;
}

store::CellLink& Store::Impl::put_cell(std::string_view key, Deadline deadline) {
  const auto m = cell_map(deadline);
  return *m->links[metadata::pick_cell(m->cells, metadata::route_of(key))];
}

std::vector<store::CellLink*> Store::Impl::get_cells(std::string_view key, Deadline deadline) {
  const auto m = cell_map(deadline);
  const std::string_view route = metadata::route_of(key);
  store::CellLink* now = m->links[metadata::pick_cell(m->cells, route)];
  if (m->previous.empty()) return {now};
  store::CellLink* before = m->previous_links[metadata::pick_cell(m->previous, route)];
  if (before == now) return {now};
  return {before, now};
}

Status Store::Impl::remove_older_copy(std::string_view key, store::CellLink& committed_in,
                                      Deadline deadline) {
  for (store::CellLink* cell : get_cells(key, deadline)) {
    if (cell == &committed_in) continue;
    auto c = borrow(*cell, deadline);
    Status s = c.is_ok() ? (*c)->remove(key) : c.status();
    if (!s.is_ok() && s.code() != StatusCode::kNotFound) {
      return Status::unavailable(
          "committed in cell " + committed_in.name + ", but the copy an earlier put left in cell " +
          cell->name +
          " (where gets look first until the change of cells settles) is still there: " + s.message());
    }
  }
  return {};
}

}  // namespace kvstash
