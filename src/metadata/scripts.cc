#include "metadata/scripts.h"

#include <string>

namespace kvstash::metadata::scripts {
namespace {

// Shared by every script: the prefix, the time from Redis itself (client clocks never
// matter), and the helpers that keep the invariants in one place.
//
// Extent lists are text, "node,page,generation;..." in object order. A free page's
// generation is stored negated, so freeing twice, or freeing with an outdated extent, is a
// no-op: only the holder of the current generation can free a page.
constexpr const char* kPrelude = R"lua(
local P = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Commands in one script cost a few microseconds each: the helpers below touch a node's
-- pages with one command per node (chunked under Lua's unpack limit), never one per page.
local CHUNK = 1000

local function call_chunked(cmd, key, items, step)
  local n = #items
  local i = 1
  while i <= n do
    local j = math.min(n, i + CHUNK * (step or 1) - 1)
    redis.call(cmd, key, unpack(items, i, j))
    i = j + 1
  end
end

local function hmget_chunked(key, fields)
  local out = {}
  for i = 1, #fields, CHUNK do
    local part = redis.call('HMGET', key, unpack(fields, i, math.min(#fields, i + CHUNK - 1)))
    for _, v in ipairs(part) do out[#out + 1] = v end
  end
  return out
end

local function live(id)
  local d = redis.call('ZSCORE', P .. ':nodes', id)
  return d ~= false and d ~= nil and tonumber(d) >= now
end

-- An extent list grouped by node, in order of first appearance.
local function by_node(list)
  local groups, order = {}, {}
  for id, page, gen in string.gmatch(list or '', '([^,;]+),(%d+),(%d+)') do
    local g = groups[id]
    if not g then
      g = {pages = {}, gens = {}}
      groups[id] = g
      order[#order + 1] = id
    end
    g.pages[#g.pages + 1] = page
    g.gens[#g.gens + 1] = tonumber(gen)
  end
  return groups, order
end

-- Whether every page of `list` still carries the generation it names.
local function current(list)
  local groups, order = by_node(list)
  for _, id in ipairs(order) do
    local g = groups[id]
    local cur = hmget_chunked(P .. ':gen:' .. id, g.pages)
    for i = 1, #g.pages do
      if tonumber(cur[i] or '0') ~= g.gens[i] then return false end
    end
  end
  return true
end

local function free_extents(list)
  local n = 0
  local groups, order = by_node(list)
  for _, id in ipairs(order) do
    local g, gk = groups[id], P .. ':gen:' .. id
    local cur = hmget_chunked(gk, g.pages)
    local sets, frees = {}, {}
    for i, page in ipairs(g.pages) do
      local gen = g.gens[i]
      if gen > 0 and tonumber(cur[i] or '0') == gen then
        sets[#sets + 1] = page
        sets[#sets + 1] = -gen
        frees[#frees + 1] = page
      end
    end
    if #frees > 0 then
      call_chunked('HSET', gk, sets, 2)
      call_chunked('LPUSH', P .. ':free:' .. id, frees)
      n = n + #frees
    end
  end
  return n
end

-- Ends pending put `token`: its record goes, and the pages of `extents` (the put's, or what is
-- left of them) return to the pool.
local function drop_put(token, extents)
  free_extents(extents)
  redis.call('DEL', P .. ':put:' .. token)
  redis.call('ZREM', P .. ':pending', token)
end

-- Drops an object from every index. Its pages return to the pool, or wait as a zombie until
-- the last read lease on them ends. Returns the pages freed now.
local function release(key)
  local ok = P .. ':obj:' .. key
  local o = redis.call('HMGET', ok, 'token', 'extents', 'nodes', 'size')
  redis.call('DEL', ok)
  -- Sizes stay decimal strings: Lua would print a number of 15 digits or more as 1e+14.
  if o[1] and (tonumber(o[4] or '0') or 0) > 0 then redis.call('HINCRBY', P .. ':stats', 'bytes', '-' .. o[4]) end
  redis.call('ZREM', P .. ':lru', key)
  redis.call('ZREM', P .. ':expiry', key)
  for id in string.gmatch(o[3] or '', '[^ ]+') do redis.call('SREM', P .. ':objs:' .. id, key) end
  if not o[1] then return 0 end
  local rk = P .. ':readers:' .. o[1]
  local last = redis.call('ZREVRANGEBYSCORE', rk, '+inf', now, 'WITHSCORES', 'LIMIT', 0, 1)
  if last[2] then
    redis.call('SET', P .. ':zombie:' .. o[1], o[2] or '')
    redis.call('ZADD', P .. ':zombies', last[2], o[1])
    return 0
  end
  redis.call('DEL', rk)
  return free_extents(o[2])
end

-- Whether the pages an object names on its nodes are still there: every node alive and
-- serving (not leaving the cell), and still the incarnation that allocated them (a node that
-- registered again started its generations above every earlier one, so one extent per node
-- tells).
local function on_live_pages(extents, nodes)
  local floors, left = {}, 0
  for id in string.gmatch(nodes or '', '[^ ]+') do
    if not live(id) then return false end
    if not floors[id] then
      local n = redis.call('HMGET', P .. ':node:' .. id, 'state', 'gen_floor')
      if n[1] ~= 'up' and n[1] ~= 'draining' then return false end
      floors[id] = tonumber(n[2] or '0') or 0
      left = left + 1
    end
  end
  for id, gen in string.gmatch(extents or '', '([^,;]+),%d+,(%d+)') do
    if left == 0 then break end
    local floor = floors[id]
    if floor then
      if tonumber(gen) <= floor then return false end
      floors[id] = nil
      left = left - 1
    end
  end
  return true
end

-- The fields of a readable object (present, unexpired, its pages on live nodes), or nil. An
-- expired object or one on a dead or restarted node is released on the spot.
local FIELDS = {'token', 'size', 'extents', 'checksum', 'layout', 'nodes', 'expires'}
local function lookup(key)
  local o = redis.call('HMGET', P .. ':obj:' .. key, unpack(FIELDS))
  if not o[1] then return nil end
  local exp = tonumber(o[7] or '0') or 0
  if (exp > 0 and exp <= now) or not on_live_pages(o[3], o[6]) then
    release(key)
    return nil
  end
  return o
end

-- Hands node `id`'s objects to the sweep: they are unreadable already (the node is gone or
-- registered again, which lookup sees), and reclaim releases them in bounded batches, so no
-- script walks a million objects at once. Returns how many objects that was.
local function sweep_node_objects(id)
  local ok = P .. ':objs:' .. id
  local n = redis.call('SCARD', ok)
  if n > 0 then
    local batch = P .. ':sweep:' .. redis.call('INCR', P .. ':sweep_seq')
    redis.call('RENAME', ok, batch)
    redis.call('RPUSH', P .. ':sweep', batch)
  end
  return n
end

-- Releases up to `limit` objects from the sweep batches (each through lookup, which releases
-- only what is unreadable: a key written again since keeps its new object). Returns how many
-- keys were looked at.
local function sweep(limit)
  local done = 0
  while done < limit do
    local batch = redis.call('LINDEX', P .. ':sweep', 0)
    if not batch then break end
    local keys = redis.call('SPOP', batch, limit - done)
    for _, key in ipairs(keys) do lookup(key) end
    done = done + #keys
    if redis.call('EXISTS', batch) == 0 then redis.call('LPOP', P .. ':sweep') end
  end
  return done
end

local function present(key)
  return lookup(key) ~= nil
end

-- The live nodes that take allocations (state up), as a set of ids.
local function usable_nodes()
  local s = {}
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. ':nodes', now, '+inf')) do
    if redis.call('HGET', P .. ':node:' .. id, 'state') == 'up' then s[id] = true end
  end
  return s
end

-- Free pages per live node that takes allocations, and their sum.
local function candidates()
  local c, total = {}, 0
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. ':nodes', now, '+inf')) do
    local st = redis.call('HMGET', P .. ':node:' .. id, 'state', 'page_count', 'next_page', 'gen_floor')
    if st[1] == 'up' then
      local free = (tonumber(st[2]) or 0) - (tonumber(st[3]) or 0) + redis.call('LLEN', P .. ':free:' .. id)
      if free > 0 then
        c[#c + 1] = {id, free, tonumber(st[4] or '0') or 0}
        total = total + free
      end
    end
  end
  return c, total
end

-- Releases expired objects, oldest deadline first, at most `limit`.
local function sweep_expired(limit)
  local keys = redis.call('ZRANGEBYSCORE', P .. ':expiry', '-inf', now, 'LIMIT', 0, limit)
  for _, key in ipairs(keys) do release(key) end
  if #keys > 0 then redis.call('HINCRBY', P .. ':stats', 'expired', #keys) end
  return #keys
end

-- Walks the LRU order, least recently used first, calling visit(key, last_access, extents,
-- size) for each object no reader leases: leased objects are never evicted. visit returns true
-- to stop. At most `max_visits` LRU entries are looked at, so the work is bounded by what
-- the caller needs, never by the cell's size. Returns the LRU entries whose record is gone
-- (deleted by hand).
local function walk_unleased_lru(visit, max_visits)
  local orphans, offset = {}, 0
  while offset < max_visits do
    local batch = redis.call('ZRANGE', P .. ':lru', offset, math.min(offset + 63, max_visits - 1), 'WITHSCORES')
    if #batch == 0 then return orphans end
    offset = offset + #batch / 2
    for i = 1, #batch, 2 do
      local key = batch[i]
      local o = redis.call('HMGET', P .. ':obj:' .. key, 'token', 'extents', 'size')
      if not o[1] then
        orphans[#orphans + 1] = key
      elseif redis.call('ZCOUNT', P .. ':readers:' .. o[1], now, '+inf') == 0 then
        if visit(key, tonumber(batch[i + 1]), o[2], o[3]) then return orphans end
      end
    end
  end
  return orphans
end

-- Releases `victims` as evicted (counted in P:stats). Returns the pages freed now.
local function evict_keys(victims)
  local freed = 0
  for _, key in ipairs(victims) do freed = freed + release(key) end
  if #victims > 0 then redis.call('HINCRBY', P .. ':stats', 'evicted', #victims) end
  return freed
end

-- Evicts least recently used objects that no reader leases until `need` pages came free on
-- the nodes in `usable` (id -> true: those that take allocations; pages on a draining or
-- dead node free nothing a put can use). All or nothing: when the unleased objects cannot
-- free enough, nothing is evicted (a put that fails anyway must not empty the cache). Looks
-- at most `need` + 256 objects: leased ones in front are skipped, a longer search fails.
-- Returns objects evicted and pages freed.
local function evict(need, usable)
  if need <= 0 then return 0, 0 end
  local victims, pages = {}, 0
  local orphans = walk_unleased_lru(function(key, _, extents)
    local n = 0
    for id in string.gmatch(extents or '', '([^,;]+),%d+,%d+') do
      if usable[id] then n = n + 1 end
    end
    if n > 0 then
      victims[#victims + 1] = key
      pages = pages + n
    end
    return pages >= need
  end, need + 256)
  if #orphans > 0 then call_chunked('ZREM', P .. ':lru', orphans) end
  if pages < need then return 0, 0 end
  return #victims, evict_keys(victims)
end

-- The endpoints of nodes (space-separated ids) appended to `out`: id, address, key.
local function endpoints(out, nodes)
  for id in string.gmatch(nodes or '', '[^ ]+') do
    local n = redis.call('HMGET', P .. ':node:' .. id, 'address', 'key')
    out[#out + 1] = id
    out[#out + 1] = n[1] or ''
    out[#out + 1] = n[2] or ''
  end
  return out
end

local function page_size()
  return tonumber(redis.call('HGET', P .. ':cell', 'page_size') or '0') or 0
end
)lua";

Script make(const char* body) { return Script(std::string(kPrelude) + body); }

}  // namespace

// ---------------------------------------------------------------------------------------
// Nodes

// ARGV id, epoch, page_size, page_count, address, key, ttl_ms. A new epoch means the old
// incarnation's pages can no longer be written by anyone: a new process has new memory, and a
// node that registers again from the same process has first deregistered its pool from every
// transport (which fences every lease and request of the old keys). So its objects are
// dropped (swept in batches; unreadable at once) and its pool starts over. IN_USE while
// another epoch of the id is alive: two daemons sharing an id would drop each other's objects.
// Returns Redis's clock (ms).
const Script& register_node() {
  static const Script s = make(R"lua(
local id, epoch = ARGV[1], ARGV[2]
local ps, count = tonumber(ARGV[3]), tonumber(ARGV[4])
if not count or count < 1 or not ps or ps < 1 then
  return redis.error_reply('INVALID page size and count must be positive')
end
local cell = page_size()
if cell > 0 and cell ~= ps then
  return redis.error_reply('INVALID page size ' .. ps .. ' differs from the cell page size ' .. cell)
end
redis.call('HSET', P .. ':cell', 'page_size', ps, 'schema', 3)
local nk = P .. ':node:' .. id
local held = redis.call('HMGET', nk, 'epoch', 'state')
if held[1] and held[1] ~= epoch and (held[2] == 'up' or held[2] == 'draining') and live(id) then
  return redis.error_reply('IN_USE node id ' .. id .. ' is held by a live node (another kvstashd with the same id?)')
end
if held[1] ~= epoch then
  sweep_node_objects(id)
  redis.call('DEL', P .. ':free:' .. id)
  -- Every generation of the new incarnation starts above every generation of the old ones
  -- (the floor), so an old extent can never match a page again, without touching each page.
  redis.call('DEL', P .. ':gen:' .. id)
  -- 2^32 allocations of a page per incarnation, 2^21 incarnations within Lua's exact integers.
  local floor = (redis.call('HINCRBY', nk, 'epochs', 1) - 1) * 4294967296
  -- Nothing granted before now can still write here: the pool was fenced as a whole.
  redis.call('HSET', nk, 'epoch', epoch, 'next_page', 0, 'registered', now, 'gen_floor', floor, 'fenced', now)
end
redis.call('HSET', nk, 'page_size', ps, 'page_count', count, 'state', 'up', 'address', ARGV[5], 'key', ARGV[6])
redis.call('ZADD', P .. ':nodes', now + tonumber(ARGV[7]), id)
redis.call('SADD', P .. ':known', id)
return now
)lua");
  return s;
}

// ARGV id, epoch, ttl_ms, fenced (ms of Redis time: the node has fenced every lease whose tag,
// the deadline of the put or read it serves, is at most this; it only moves up). STALE when
// the node must register again: another epoch holds the id, or its deadline passed (readers
// have been told its objects are gone, and puts' pages may have been freed without its
// fence: only a new registration, after fencing the whole pool, may serve again). Returns
// Redis's clock (ms), from which the node estimates how far it may fence.
const Script& heartbeat() {
  static const Script s = make(R"lua(
local id = ARGV[1]
local nk = P .. ':node:' .. id
local n = redis.call('HMGET', nk, 'epoch', 'state', 'fenced')
if n[1] ~= ARGV[2] or (n[2] ~= 'up' and n[2] ~= 'draining' and n[2] ~= 'leaving') then
  return redis.error_reply('STALE node ' .. id .. ' is not registered with this epoch')
end
if not live(id) then
  return redis.error_reply('STALE node ' .. id .. ' missed its heartbeat deadline')
end
redis.call('ZADD', P .. ':nodes', now + tonumber(ARGV[3]), id)
local fenced = tonumber(ARGV[4]) or 0
if fenced > (tonumber(n[3] or '0') or 0) then redis.call('HSET', nk, 'fenced', fenced) end
return now
)lua");
  return s;
}

// ARGV id, epoch. The node is leaving (kvstashd stopping): it takes no new pages and its
// objects are dropped (unreadable at once, swept in batches). Returns how many.
const Script& drain_node() {
  static const Script s = make(R"lua(
local id = ARGV[1]
local nk = P .. ':node:' .. id
if redis.call('HGET', nk, 'epoch') ~= ARGV[2] then
  return redis.error_reply('STALE node ' .. id .. ' is not registered with this epoch')
end
redis.call('HSET', nk, 'state', 'leaving')
return sweep_node_objects(id)
)lua");
  return s;
}

// ARGV id, epoch. The node leaves the cell. Generations stay, so extents handed out by this
// incarnation can never match a page of a later one.
const Script& deregister_node() {
  static const Script s = make(R"lua(
local id = ARGV[1]
local nk = P .. ':node:' .. id
if redis.call('HGET', nk, 'epoch') ~= ARGV[2] then return 'OK' end
sweep_node_objects(id)
redis.call('DEL', P .. ':free:' .. id)
redis.call('ZREM', P .. ':nodes', id)
redis.call('HSET', nk, 'state', 'gone')
return 'OK'
)lua");
  return s;
}

// ARGV id. Returns state, epoch, page_size, page_count, free pages, objects, heartbeat
// deadline (ms, -1 when not in the cell), now.
const Script& node_status() {
  static const Script s = make(R"lua(
local id = ARGV[1]
local n = redis.call('HMGET', P .. ':node:' .. id, 'state', 'epoch', 'page_size', 'page_count', 'next_page')
if not n[1] then return redis.error_reply('NOT_FOUND no node ' .. id) end
local free = (tonumber(n[4]) or 0) - (tonumber(n[5]) or 0) + redis.call('LLEN', P .. ':free:' .. id)
local d = redis.call('ZSCORE', P .. ':nodes', id)
return {n[1], n[2] or '', tonumber(n[3]) or 0, tonumber(n[4]) or 0, free,
        redis.call('SCARD', P .. ':objs:' .. id), d and tonumber(d) or -1, now}
)lua");
  return s;
}

// Returns the ids of the nodes in the cell (alive or past their deadline, not yet reclaimed).
const Script& list_nodes() {
  static const Script s = make(R"lua(
return redis.call('ZRANGE', P .. ':nodes', 0, -1)
)lua");
  return s;
}

// ARGV id. An operator's drain: the node takes no new pages; its objects stay readable until
// they expire, are evicted or removed. Returns the state before and the node's objects.
const Script& cordon_node() {
  static const Script s = make(R"lua(
local nk = P .. ':node:' .. ARGV[1]
local st = redis.call('HGET', nk, 'state')
if not st then return redis.error_reply('NOT_FOUND no node ' .. ARGV[1]) end
if st == 'up' then redis.call('HSET', nk, 'state', 'draining') end
return {st, redis.call('SCARD', P .. ':objs:' .. ARGV[1])}
)lua");
  return s;
}

// Every node the cell knows, live or not, until an operator forgets it: sorted ids.
const Script& known_nodes() {
  static const Script s = make(R"lua(
local ids = redis.call('SMEMBERS', P .. ':known')
for _, id in ipairs(redis.call('ZRANGE', P .. ':nodes', 0, -1)) do ids[#ids + 1] = id end
table.sort(ids)
local out, last = {}, nil
for _, id in ipairs(ids) do
  if id ~= last then out[#out + 1] = id end
  last = id
end
return out
)lua");
  return s;
}

// ARGV id. Removes what a dead node left: its objects (released), free list and generations,
// its place in the cell. The node's record keeps its incarnation count, so a later node with
// this id still starts above every old generation. IN_USE while its heartbeat is current.
const Script& forget_node() {
  static const Script s = make(R"lua(
local id = ARGV[1]
local nk = P .. ':node:' .. id
if redis.call('EXISTS', nk) == 0 then return redis.error_reply('NOT_FOUND no node ' .. id) end
if live(id) then
  return redis.error_reply('IN_USE node ' .. id .. ' is alive (its heartbeat is current): stop its kvstashd first')
end
local released = sweep_node_objects(id)
redis.call('DEL', P .. ':free:' .. id, P .. ':gen:' .. id)
redis.call('ZREM', P .. ':nodes', id)
redis.call('SREM', P .. ':known', id)
redis.call('HDEL', nk, 'address', 'key')
redis.call('HSET', nk, 'state', 'gone')
return released
)lua");
  return s;
}

// The cell at a glance: page size, objects, now, then the counters of P:stats as field, value.
const Script& cell_summary() {
  static const Script s = make(R"lua(
local out = {page_size(), redis.call('ZCARD', P .. ':lru'), now}
for _, v in ipairs(redis.call('HGETALL', P .. ':stats')) do out[#out + 1] = v end
return out
)lua");
  return s;
}

// ARGV keys. Read-only. Returns now, then per key: size ('' when absent), created, expires,
// last access, nodes, checksum, live read leases.
const Script& describe_objects() {
  static const Script s = make(R"lua(
local out = {now}
for _, key in ipairs(ARGV) do
  local o = redis.call('HMGET', P .. ':obj:' .. key, 'size', 'created', 'expires', 'nodes', 'checksum', 'token')
  local last = redis.call('ZSCORE', P .. ':lru', key)
  local readers = 0
  if o[6] then readers = redis.call('ZCOUNT', P .. ':readers:' .. o[6], now, '+inf') end
  out[#out + 1] = o[1] or ''
  out[#out + 1] = o[2] or '0'
  out[#out + 1] = o[3] or '0'
  out[#out + 1] = last or '0'
  out[#out + 1] = o[4] or ''
  out[#out + 1] = o[5] or ''
  out[#out + 1] = readers
end
return out
)lua");
  return s;
}

// ARGV idle_ms (0: any), max_bytes (0: no bound), dry_run (1/0), limit. Least recently used
// unleased objects first: those idle for at least idle_ms, until max_bytes of them are chosen
// (the one that crosses it included). Released unless dry_run. Returns now, then key, size,
// last access per object chosen.
const Script& evict_lru() {
  static const Script s = make(R"lua(
local idle, max_bytes, dry, limit = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3] == '1', tonumber(ARGV[4])
local out, chosen, bytes = {now}, {}, 0
walk_unleased_lru(function(key, last, _, size)
  if idle > 0 and last > now - idle then return true end  -- everything after is newer
  chosen[#chosen + 1] = key
  bytes = bytes + (tonumber(size) or 0)
  out[#out + 1] = key
  out[#out + 1] = size or '0'
  out[#out + 1] = last
  return (max_bytes > 0 and bytes >= max_bytes) or #chosen >= limit
end, 2 * limit + 256)
if not dry then evict_keys(chosen) end
return out
)lua");
  return s;
}

// ---------------------------------------------------------------------------------------
// Objects

// ARGV token, key, size, lease_ms. Allocates the pages of a new object, most free node
// first, spilling over nodes; expired then least recently used unleased objects make room.
// Repeating a begin_put with the same token returns the same pages (a retry after a lost
// reply). Returns page_size, extents, the lease's deadline (ms of Redis time: the fence tag
// of the put's writes at the nodes), then id, address, key per node.
const Script& begin_put() {
  static const Script s = make(R"lua(
local token, key, size, lease = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local pk = P .. ':put:' .. token
local prev = redis.call('HMGET', pk, 'extents', 'nodes')
if prev[1] then
  local deadline = redis.call('ZSCORE', P .. ':pending', token) or '0'
  return endpoints({page_size(), prev[1], deadline}, prev[2])
end
local ps = page_size()
if ps <= 0 then return redis.error_reply('NO_SPACE no memory node has joined this cell') end
local need = math.ceil(size / ps)
local cands, total = candidates()
if total < need then
  local capacity = 0
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. ':nodes', now, '+inf')) do
    local st = redis.call('HMGET', P .. ':node:' .. id, 'state', 'page_count')
    if st[1] == 'up' then capacity = capacity + (tonumber(st[2]) or 0) end
  end
  if need > capacity then
    return redis.error_reply('NO_SPACE object needs ' .. need .. ' pages, the live nodes hold ' .. capacity)
  end
  sweep_expired(256)
  cands, total = candidates()
  if total < need then
    evict(need - total, usable_nodes())
    cands, total = candidates()
  end
  if total < need then
    return redis.error_reply('NO_SPACE object needs ' .. need .. ' pages, ' .. total ..
                             ' are free and every other page is leased by a reader or a put, or waits' ..
                             ' for its memory node to fence a failed put')
  end
end
table.sort(cands, function(a, b) return a[2] > b[2] end)
local ext, nodes, got = {}, {}, 0
for _, c in ipairs(cands) do
  if got >= need then break end
  local id = c[1]
  local take = math.min(c[2], need - got)
  nodes[#nodes + 1] = id
  -- Returned pages first (oldest first, so neighbours stay neighbours), then fresh ones.
  local pages = redis.call('RPOP', P .. ':free:' .. id, take)
  if not pages then pages = {} end
  local fresh = take - #pages
  if fresh > 0 then
    local last = redis.call('HINCRBY', P .. ':node:' .. id, 'next_page', fresh)
    for page = last - fresh, last - 1 do pages[#pages + 1] = page end
  end
  local gk = P .. ':gen:' .. id
  local old = hmget_chunked(gk, pages)
  local sets = {}
  for i, page in ipairs(pages) do
    local gen = math.max(math.abs(tonumber(old[i] or '0')), c[3]) + 1
    sets[#sets + 1] = page
    sets[#sets + 1] = gen
    ext[#ext + 1] = string.format('%s,%s,%d', id, page, gen)  -- %d: no exponent for big numbers
  end
  call_chunked('HSET', gk, sets, 2)
  got = got + take
end
local extents, node_list = table.concat(ext, ';'), table.concat(nodes, ' ')
redis.call('HSET', pk, 'key', key, 'size', size, 'extents', extents, 'nodes', node_list)
redis.call('ZADD', P .. ':pending', now + lease, token)
return endpoints({ps, extents, now + lease}, node_list)
)lua");
  return s;
}

// ARGV token, key, checksum, layout, ttl_ms, condition ('' none; '!' only if the key holds no
// object; '=<token>' only if it holds the object that put wrote, else STALE and the put's
// pages are freed). The pending put becomes the object; an object it replaces is released.
// Repeating a commit that succeeded is OK.
const Script& commit_put() {
  static const Script s = make(R"lua(
local token, key, ttl = ARGV[1], ARGV[2], tonumber(ARGV[5])
local pk, ok = P .. ':put:' .. token, P .. ':obj:' .. key
local p = redis.call('HMGET', pk, 'key', 'extents', 'nodes', 'size', 'aborted')
if not p[1] then
  if redis.call('HGET', ok, 'token') == token then return 'OK' end
  return redis.error_reply('STALE the put lost its lease before the commit; its pages were reclaimed')
end
if p[5] then return redis.error_reply('STALE the put was aborted') end
if p[1] ~= key then return redis.error_reply('INVALID put token belongs to another key') end
local gone = not current(p[2])
for id in string.gmatch(p[3] or '', '[^ ]+') do
  if not live(id) then gone = true end
end
if gone then
  drop_put(token, p[2])
  return redis.error_reply('STALE a memory node of the put died or restarted before the commit')
end
local cond = ARGV[6] or ''
if cond ~= '' then
  local cur = redis.call('HGET', ok, 'token')
  if (cond == '!' and cur) or (cond ~= '!' and '=' .. (cur or '') ~= cond) then
    drop_put(token, p[2])
    return redis.error_reply('STALE ' .. key .. ' changed since the version this put was based on')
  end
end
if redis.call('EXISTS', ok) == 1 then release(key) end
local expires = 0
if ttl > 0 then expires = now + ttl end
redis.call('HSET', ok, 'size', p[4], 'token', token, 'extents', p[2], 'nodes', p[3], 'checksum', ARGV[3],
           'layout', ARGV[4], 'created', now, 'expires', expires)
for id in string.gmatch(p[3] or '', '[^ ]+') do redis.call('SADD', P .. ':objs:' .. id, key) end
if (tonumber(p[4]) or 0) > 0 then redis.call('HINCRBY', P .. ':stats', 'bytes', p[4]) end
redis.call('ZADD', P .. ':lru', now, key)
if expires > 0 then redis.call('ZADD', P .. ':expiry', expires, key) end
redis.call('DEL', pk)
redis.call('ZREM', P .. ':pending', token)
return 'OK'
)lua");
  return s;
}

// ARGV token, then the nodes that confirmed that none of the put's writes can land on them any
// more (Peer::revoke). The put's pages on those nodes, and on nodes that are not alive, are
// freed now; the rest stay with the pending put, and reclaim frees them once its lease has
// passed and their nodes have fenced through it (a write still queued at a stalled node must
// never land in a page another put was given). Idempotent. Returns the pages left waiting.
const Script& abort_put() {
  static const Script s = make(R"lua(
local tok = ARGV[1]
local pk = P .. ':put:' .. tok
local p = redis.call('HMGET', pk, 'extents', 'nodes')
if not p[1] then return 0 end
local confirmed = {}
for i = 2, #ARGV do confirmed[ARGV[i]] = true end
local free, keep, kept_nodes, seen = {}, {}, {}, {}
for id, page, gen in string.gmatch(p[1], '([^,;]+),(%d+),(%d+)') do
  local e = id .. ',' .. page .. ',' .. gen
  if confirmed[id] or not live(id) then
    free[#free + 1] = e
  else
    keep[#keep + 1] = e
    if not seen[id] then
      seen[id] = true
      kept_nodes[#kept_nodes + 1] = id
    end
  end
end
if #keep == 0 then
  drop_put(tok, p[1])
else
  free_extents(table.concat(free, ';'))
  redis.call('HSET', pk, 'extents', table.concat(keep, ';'), 'nodes', table.concat(kept_nodes, ' '), 'aborted', now)
end
return #keep
)lua");
  return s;
}

// ARGV key, reader, lease_ms. Looks the object up and leases it for reading. Returns
// page_size, token, size, extents, checksum, layout, the lease's deadline (ms of Redis time),
// then id, address, key per node.
const Script& begin_get() {
  static const Script s = make(R"lua(
local key = ARGV[1]
local o = lookup(key)
if not o then
  redis.call('HINCRBY', P .. ':stats', 'misses', 1)
  return redis.error_reply('NOT_FOUND no object ' .. key)
end
redis.call('HINCRBY', P .. ':stats', 'hits', 1)
local deadline = now + tonumber(ARGV[3])
redis.call('ZADD', P .. ':readers:' .. o[1], deadline, ARGV[2])
redis.call('ZADD', P .. ':lru', now, key)
return endpoints({page_size(), o[1], o[2] or '', o[3] or '', o[4] or '', o[5] or '', deadline}, o[6])
)lua");
  return s;
}

// ARGV reader, object token, extents read. Ends the read lease; STALE when the lease had
// expired or a page was freed or reused meanwhile (the bytes read cannot be trusted). A
// zombie whose last reader left is freed here.
const Script& end_get() {
  static const Script s = make(R"lua(
local tok = ARGV[2]
local rk = P .. ':readers:' .. tok
local deadline = redis.call('ZSCORE', rk, ARGV[1])
redis.call('ZREM', rk, ARGV[1])
local held = deadline and tonumber(deadline) >= now
local fresh = held and current(ARGV[3])
local zk = P .. ':zombie:' .. tok
if redis.call('EXISTS', zk) == 1 and redis.call('ZCOUNT', rk, now, '+inf') == 0 then
  free_extents(redis.call('GET', zk))
  redis.call('DEL', zk, rk)
  redis.call('ZREM', P .. ':zombies', tok)
end
if not held then return redis.error_reply('STALE the read lease expired before the read ended') end
if not fresh then return redis.error_reply('STALE the object\'s pages were reused during the read') end
return 'OK'
)lua");
  return s;
}

// ARGV key. Returns size, checksum, layout, extents, nodes, ms to expiry (-1: none).
const Script& stat() {
  static const Script s = make(R"lua(
local o = lookup(ARGV[1])
if not o then return redis.error_reply('NOT_FOUND no object ' .. ARGV[1]) end
local exp = tonumber(o[7] or '0') or 0
local left = -1
if exp > 0 then left = exp - now end
return {o[2] or '', o[4] or '', o[5] or '', o[3] or '', o[6] or '', left, o[1]}
)lua");
  return s;
}

// ARGV key.
const Script& remove() {
  static const Script s = make(R"lua(
if not present(ARGV[1]) then return redis.error_reply('NOT_FOUND no object ' .. ARGV[1]) end
release(ARGV[1])
return 'OK'
)lua");
  return s;
}

// ARGV key, ttl_ms (0: no expiry).
const Script& touch() {
  static const Script s = make(R"lua(
local key, ttl = ARGV[1], tonumber(ARGV[2])
if not present(key) then return redis.error_reply('NOT_FOUND no object ' .. key) end
local expires = 0
if ttl > 0 then expires = now + ttl end
redis.call('HSET', P .. ':obj:' .. key, 'expires', expires)
if expires > 0 then
  redis.call('ZADD', P .. ':expiry', expires, key)
else
  redis.call('ZREM', P .. ':expiry', key)
end
redis.call('ZADD', P .. ':lru', now, key)
return 'OK'
)lua");
  return s;
}

// ARGV keys. Returns how many leading keys are present.
const Script& contains_prefix() {
  static const Script s = make(R"lua(
for i, key in ipairs(ARGV) do
  if not present(key) then return i - 1 end
end
return #ARGV
)lua");
  return s;
}

// ARGV bytes. Evicts least recently used unleased objects until that many bytes came free
// (all or nothing). Returns objects, pages.
const Script& evict() {
  static const Script s = make(R"lua(
local ps = page_size()
if ps <= 0 then return {0, 0} end
local objects, pages = evict(math.ceil(tonumber(ARGV[1]) / ps), usable_nodes())
return {objects, pages}
)lua");
  return s;
}

// ARGV limit. Sweeps, at most `limit` of each: expired objects; puts past their lease whose
// live nodes have all fenced through it (their writes can no longer land; a dead node's pages
// start over when it registers again); zombies past their last read lease; nodes past their
// heartbeat deadline (`state = dead`; their objects go to the sweep); and objects of the
// sweep (dead or restarted nodes'). Each item costs a few dozen microseconds: a small limit
// keeps one run near a millisecond, and the caller runs it again while `more` says work is
// left. Returns expired, puts, zombies, dead nodes, the objects the dead nodes held, the puts
// still waiting for a node's fence, the objects swept, and more (1: a limit was reached).
const Script& reclaim() {
  static const Script s = make(R"lua(
local limit = tonumber(ARGV[1])
local expired = sweep_expired(limit)
local puts = redis.call('ZRANGEBYSCORE', P .. ':pending', '-inf', '(' .. now, 'WITHSCORES', 'LIMIT', 0, limit)
local freed, waiting, fenced = 0, 0, {}
for i = 1, #puts, 2 do
  local tok, deadline = puts[i], tonumber(puts[i + 1])
  local pk = P .. ':put:' .. tok
  local p = redis.call('HMGET', pk, 'extents', 'nodes')
  local ready = true
  for id in string.gmatch(p[2] or '', '[^ ]+') do
    if fenced[id] == nil then
      fenced[id] = tonumber(redis.call('HGET', P .. ':node:' .. id, 'fenced') or '0') or 0
    end
    if live(id) and fenced[id] < deadline then ready = false end
  end
  if ready then
    drop_put(tok, p[1])
    freed = freed + 1
  else
    waiting = waiting + 1
  end
end
local zombies = redis.call('ZRANGEBYSCORE', P .. ':zombies', '-inf', '(' .. now, 'LIMIT', 0, limit)
for _, tok in ipairs(zombies) do
  free_extents(redis.call('GET', P .. ':zombie:' .. tok))
  redis.call('DEL', P .. ':zombie:' .. tok, P .. ':readers:' .. tok)
  redis.call('ZREM', P .. ':zombies', tok)
end
local dead = redis.call('ZRANGEBYSCORE', P .. ':nodes', '-inf', '(' .. now, 'LIMIT', 0, limit)
local orphans = 0
for _, id in ipairs(dead) do
  orphans = orphans + sweep_node_objects(id)
  redis.call('HSET', P .. ':node:' .. id, 'state', 'dead')
  redis.call('ZREM', P .. ':nodes', id)
end
local swept = sweep(limit)
local more = 0
if expired == limit or #puts / 2 == limit or #zombies == limit or #dead == limit or swept == limit then more = 1 end
return {expired, freed, #zombies, #dead, orphans, waiting, swept, more}
)lua");
  return s;
}

std::vector<const Script*> all() {
  return {&register_node(),   &heartbeat(),
          &drain_node(),      &deregister_node(),
          &node_status(),     &list_nodes(),
          &begin_put(),       &commit_put(),
          &abort_put(),       &begin_get(),
          &end_get(),         &stat(),
          &remove(),          &touch(),
          &contains_prefix(), &evict(),
          &reclaim(),         &cordon_node(),
          &known_nodes(),     &forget_node(),
          &cell_summary(),    &describe_objects(),
          &evict_lru()};
}

}  // namespace kvstash::metadata::scripts
