// A put's pages. A store reserves pages ahead of its puts (Catalog::reserve_pages, under one
// put lease); each put takes the next run of them without asking Redis and commits them with
// one script, so a put costs one round trip where begin_put + commit_put cost two. The
// reservation is a pending put of no key: its lease, its fence at the nodes and its reclaim
// are a put's, so a client that dies holding one loses nothing for longer than a put would.
#include <algorithm>
#include <thread>

#include "common/log.h"
#include "store/store_internal.h"
#include "store/transfers.h"

namespace kvstash {

using store::MetadataClock;

namespace {

// The pages [first, first + count) of `r` as a put's placement: those extents, and the
// endpoints of the nodes they are on.
metadata::Placement run_of(const store::Reservation& r, std::uint64_t first, std::uint64_t count) {
  const metadata::Placement& all = r.placement;
  metadata::Placement p;
  p.page_size = all.page_size;
  p.lease_deadline_ms = all.lease_deadline_ms;
  p.extents.assign(all.extents.begin() + static_cast<std::ptrdiff_t>(first),
                   all.extents.begin() + static_cast<std::ptrdiff_t>(first + count));
  for (const auto& n : all.nodes) {
    if (std::ranges::any_of(p.extents, [&](const metadata::Extent& e) { return e.node == n.id; })) {
      p.nodes.push_back(n);
    }
  }
  return p;
}

}  // namespace

Result<store::PutPages> Store::Impl::put_pages(store::CellLink& cell, std::string_view key,
                                               std::uint64_t size, Deadline deadline, OpTimings* timings,
                                               std::span<const metadata::NodeEndpoint> apart, bool one_node) {
  const Deadline give_up = std::min(deadline, deadline_after(options.wait_for_pages));
  auto pause = std::chrono::milliseconds(2);
  for (;;) {
    auto pages = place_pages(cell, key, size, deadline, timings, apart, one_node);
    if (pages.is_ok() || !metadata::Catalog::pages_held(pages.status()) || Clock::now() + pause >= give_up) {
      return pages;
    }
    KVSTASH_LOG_DEBUG("put {}: waiting {} ms for pages: {}", key, pause.count(), pages.status().to_string());
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(64));
  }
}

Result<store::PutPages> Store::Impl::place_pages(store::CellLink& cell, std::string_view key,
                                                 std::uint64_t size, Deadline deadline, OpTimings* timings,
                                                 std::span<const metadata::NodeEndpoint> apart,
                                                 bool one_node) {
  store::PutPages pages;
  pages.cell = &cell;
  pages.token = store::random_token();
  // A put from the reservation keeps at least half a put lease for its writes (or the
  // caller's whole deadline, when that is shorter).
  const Clock::time_point needs_until = std::min(deadline, Clock::now() + options.put_lease / 2);
  auto take = [&](const std::shared_ptr<store::Reservation>& r) {
    const std::uint64_t need = metadata::pages_for(size, r->placement.page_size);
    if (r->lease_until < needs_until || r->placement.extents.size() - r->next < need) return false;
    pages.placement = run_of(*r, r->next, need);
    pages.lease_until = r->lease_until;
    pages.answered_at = r->answered_at;
    pages.reservation = r;
    pages.first = r->next;
    r->next += need;
    ++r->unsettled;
    return true;
  };
  const bool own_pages = options.put_reservation == 0 || !apart.empty() || one_node;
  if (!own_pages) {
    std::shared_ptr<store::Reservation> held;
    bool shunned = false;  // it has pages on a node this client avoids now
    {
      std::lock_guard lock(reserve_mu);
      held = cell.reservation;
      shunned = held && avoided->any_in(held->placement);
      if (held && !shunned && take(held)) {
        pages.held = true;
        return pages;
      }
    }
    if (shunned) retire(held);  // the next reservation comes from the other nodes
  }

  const std::vector<metadata::NodeEndpoint> avoid = avoided->list();
  KVSTASH_ASSIGN_OR_RETURN(auto c, borrow(cell, deadline));
  MetadataClock mc(timings);
  const auto leased_at = Clock::now();
  pages.lease_until = store::within_lease(Deadline::max(), leased_at, options.put_lease);
  if (one_node || !apart.empty()) {
    KVSTASH_ASSIGN_OR_RETURN(pages.placement,
                             c->begin_copy(pages.token, key, size, options.put_lease, avoid, apart));
    pages.answered_at = Clock::now();
    return pages;
  }
  if (own_pages) {
    KVSTASH_ASSIGN_OR_RETURN(pages.placement, c->begin_put(pages.token, key, size, options.put_lease, avoid));
    pages.answered_at = Clock::now();
    return pages;
  }
  auto fresh = std::make_shared<store::Reservation>();
  fresh->cell = &cell;
  fresh->token = store::random_token();
  auto placement =
      c->reserve_pages(fresh->token, size, options.put_reservation, options.put_lease, avoid, key);
  if (!placement.is_ok()) {
    // A reply lost to the deadline or a broken connection may hide a reservation Redis made:
    // no put took from it, so all of it goes back (releasing a token Redis never saw does
    // nothing), rather than its pages waiting for its lease.
    const StatusCode code = placement.status().code();
    if (code == StatusCode::kTimeout || code == StatusCode::kUnavailable) {
      releaser->submit(
          [this, fresh] { release_reservation(*fresh, 0, true, deadline_after(options.redis_timeout * 2)); });
    }
    // Every page is held for now, some by this client's own reservation, too short for this
    // put: it goes back, for the next try.
    if (metadata::Catalog::pages_held(placement.status())) {
      std::shared_ptr<store::Reservation> short_one;
      {
        std::lock_guard lock(reserve_mu);
        short_one = cell.reservation;
      }
      if (short_one) retire(std::move(short_one));
    }
    return placement.status();
  }
  fresh->placement = std::move(placement).value();
  fresh->lease_until = pages.lease_until;
  fresh->answered_at = Clock::now();
  std::shared_ptr<store::Reservation> replaced;
  {
    std::lock_guard lock(reserve_mu);
    if (!take(fresh)) return Status::internal("store: a page reservation without the put's own pages");
    replaced = std::exchange(cell.reservation, fresh);
  }
  if (replaced) end_reservation_later(std::move(replaced));
  return pages;
}

std::int64_t Store::Impl::commit_by(const store::PutPages& pages, Deadline deadline) const {
  const std::int64_t lease_end = pages.placement.lease_deadline_ms;
  if (lease_end <= 0) return 0;
  using std::chrono::duration_cast, std::chrono::milliseconds;
  // The script that leased the pages ran at Redis time lease_end - put_lease (its clock in
  // whole ms: no later), and locally no later than answered_at: from there, Redis's clock runs
  // at least as far as ours. The client gives up on the commit when RedisClient's wait ends:
  // the command's timeout, or the deadline rounded up to a whole ms.
  const auto now = Clock::now();
  const Deadline gives_up =
      now + std::min(options.redis_timeout, std::chrono::ceil<milliseconds>(deadline - now));
  const std::int64_t span = duration_cast<milliseconds>(gives_up - pages.answered_at).count();  // rounds down
  // Less 100 ppm for the two clocks' rates (crystals drift by tens of ppm; a reservation
  // serves puts for up to half a put lease: 3 ms over 30 s).
  return lease_end - options.put_lease.count() + span - std::max<std::int64_t>(0, span) / 10000;
}

Status Store::Impl::commit_pages(metadata::Catalog& c, const store::PutPages& pages, std::string_view key,
                                 std::uint64_t size, const sum::ObjectSum& checksum, const PutOptions& o,
                                 std::uint32_t copies, Deadline deadline, bool* announced) {
  const std::string keep = metadata::keep_hint_text(o.keep);
  const std::int64_t by = commit_by(pages, deadline);
  if (!pages.reservation) {
    return c.commit_put(pages.token, key, checksum, o.object_layout, o.ttl, o.if_version, copies, keep, by,
                        o.event, announced);
  }
  Status s = c.commit_reserved(pages.run(), pages.token, key, size, checksum, o.object_layout, o.ttl,
                               o.if_version, copies, keep, by, o.event, announced);
  reservation_committed(pages, s);
  return s;
}

void Store::Impl::reservation_committed(const store::PutPages& pages, const Status& s) {
  // The reservation was reclaimed, or a node of it died.
  if (s.code() == StatusCode::kStale && !metadata::Catalog::condition_failed(s)) retire(pages.reservation);
}

Result<std::uint64_t> Store::Impl::abort_pages(metadata::Catalog& c, const store::PutPages& pages,
                                               std::span<const std::string> fenced) {
  if (!pages.reservation) return c.abort_put(pages.token, fenced);
  return c.abort_reserved(pages.run(), fenced);
}

void Store::Impl::end_reservation(const std::shared_ptr<store::Reservation>& r, Deadline deadline) {
  std::uint64_t from = 0;
  bool drop = false;
  {
    std::lock_guard lock(reserve_mu);
    from = r->next;
    r->next = r->placement.extents.size();  // nothing more is taken from it
    r->retired = true;
    drop = r->unsettled == 0 && !r->lingering && !r->dropped;
    r->dropped |= drop;
  }
  release_reservation(*r, from, drop, deadline);
}

void Store::Impl::release_reservation(const store::Reservation& r, std::uint64_t from, bool drop,
                                      Deadline deadline) {
  auto c = borrow(*r.cell, deadline);
  Status s = c.is_ok() ? (*c)->release_reservation(r.token, from, drop).status() : c.status();
  if (!s.is_ok()) {
    KVSTASH_LOG_INFO("page reservation {}: its unused pages and its record go with its lease: {}", r.token,
                     s.to_string());
  }
}

void Store::Impl::end_reservation_later(std::shared_ptr<store::Reservation> r) {
  releaser->submit(
      [this, r = std::move(r)] { end_reservation(r, deadline_after(options.redis_timeout * 2)); });
}

void Store::Impl::retire(std::shared_ptr<store::Reservation> r) {
  {
    std::lock_guard lock(reserve_mu);
    if (r->cell->reservation != r) return;  // replaced already, and ended then
    r->cell->reservation.reset();
  }
  end_reservation_later(std::move(r));
}

void Store::Impl::settle(const store::PutPages& pages, bool clean) {
  const std::shared_ptr<store::Reservation>& r = pages.reservation;
  if (!r) return;
  bool drop = false;
  {
    std::lock_guard lock(reserve_mu);
    if (r->unsettled > 0) --r->unsettled;
    r->lingering |= !clean;
    drop = r->retired && r->unsettled == 0 && !r->lingering && !r->dropped;
    r->dropped |= drop;
  }
  if (!drop) return;
  // Retired already: its unused pages went back then (on this same thread, in order), and
  // the record goes now. Redis keeps it when a page of it is still held after all.
  releaser->submit([this, r] {
    release_reservation(*r, r->placement.extents.size(), true, deadline_after(options.redis_timeout * 2));
  });
}

}  // namespace kvstash
