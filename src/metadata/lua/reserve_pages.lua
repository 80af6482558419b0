-- reserve_pages.lua: a client's page reservation, which its next puts commit from.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     token, size (bytes of the put it is for), extra (bytes wanted beyond it), lease_ms,
--          the key of that put (its quota is charged for the reservation's pages until puts
--          commit them or they return; '' none), then the nodes to avoid, as for begin_put
-- Returns  page_size, extents, the lease's deadline (ms of Redis time: the fence tag of every
--          write into the reserved pages), then id, address, key per node; NO_SPACE when the
--          needed pages cannot be found
--
-- A put from a reservation costs one round trip (commit_reserved) instead of two. The pages
-- `size` needs come as a put's would (evicting when short); the extra ones only from free
-- pages (prelude: allocate, through place_put). The reservation is a pending put of no key:
-- its lease, fence and reclaim are a put's, and the pages no commit took return with it.
-- Repeating a reservation with the same token returns the same pages (a retry after a lost
-- reply).
-- Uses     call, capacity, placement

return place_put(ARGV[1], '', tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], avoid_from_args(6), false, {},
                 ARGV[5])
