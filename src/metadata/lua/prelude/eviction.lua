-- prelude/eviction.lua: making room: expired objects first, then the policy's order over objects no
-- reader leases; room under a quota.
-- Uses     call, pages, quotas, policy, objects

-- Releases expired objects, oldest deadline first, at most `limit`.
local function sweep_expired(limit)
  local keys = redis.call('ZRANGEBYSCORE', P .. ':expiry', '-inf', now, 'LIMIT', 0, limit)
  for _, key in ipairs(keys) do release(key, 'expired') end
  if #keys > 0 then redis.call('HINCRBY', P .. ':stats', 'expired', #keys) end
  return #keys
end

-- Walks the LRU order, least recently used first, calling visit(key, last_access, extents,
-- size) for each object no reader leases: leased objects are never evicted. visit returns true
-- to stop. At most `max_visits` LRU entries are looked at, so the work is bounded by what
-- the caller needs, never by the cell's size. Returns the LRU entries whose record is gone
-- (deleted by hand). `lru`: another LRU order to walk (a quota's), instead of the cell's.
-- The record of `key` (token, extents, size) for an eviction's walk: nil when a reader leases
-- it, false when the record is gone (an order's entry left behind: deleted by hand).
local function unleased_record(key)
  local o = redis.call('HMGET', P .. ':obj:' .. key, 'token', 'extents', 'size')
  if not o[1] then return false end
  if redis.call('ZCOUNT', P .. ':readers:' .. o[1], now, '+inf') == 0 then return o end
  return nil
end

local function walk_unleased_lru(visit, max_visits, lru)
  local orphans, offset = {}, 0
  while offset < max_visits do
    local batch = redis.call('ZRANGE', lru or (P .. ':lru'), offset, math.min(offset + 63, max_visits - 1), 'WITHSCORES')
    if #batch == 0 then return orphans end
    offset = offset + #batch / 2
    for i = 1, #batch, 2 do
      local key = batch[i]
      local o = unleased_record(key)
      if o == false then
        orphans[#orphans + 1] = key
      elseif o and visit(key, tonumber(batch[i + 1]), o[2], o[3]) then
        return orphans
      end
    end
  end
  return orphans
end

-- Releases `victims` as evicted (counted in P:stats), `pressure` saying what made room
-- necessary (record_gone). Returns the pages freed now.
local function evict_keys(victims, pressure)
  local freed = 0
  for _, key in ipairs(victims) do freed = freed + release(key, 'evicted', pressure) end
  if #victims > 0 then redis.call('HINCRBY', P .. ':stats', 'evicted', #victims) end
  return freed
end

-- Walks the objects a policy chosen since they were stored does not hold (`holds(key)` false),
-- least recent first, as walk_unleased_lru does; they go first. Looks at most 256 (or
-- `max_visits`) entries. Returns the entries whose record is gone, whether visit stopped, and
-- the entries looked at.
local function walk_unadopted(visit, max_visits, holds)
  local visits, stop = 0, false
  local orphans = walk_unleased_lru(function(key, last, extents, size)
    visits = visits + 1
    if holds(key) then return visits >= 256 end
    stop = visit(key, last, extents, size)
    return stop or visits >= 256
  end, math.min(max_visits, 256))
  return orphans, stop, visits
end

-- Walks ARC's order of eviction as walk_unleased_lru walks LRU's: objects stored before arc
-- was chosen first (least recent first), then each time T1's least recent object while T1 holds
-- more than p (or T2 has none left), else T2's. Returns the entries whose record is gone, per
-- list.
local function walk_unleased_arc(visit, max_visits)
  local orphans = {}
  local visits = 0
  local held1, held2 = redis.call('ZCARD', ARC_T1), redis.call('ZCARD', ARC_T2)
  if redis.call('ZCARD', P .. ':lru') > held1 + held2 then
    local stop
    orphans[P .. ':lru'], stop, visits = walk_unadopted(visit, max_visits, function(key)
      return redis.call('ZSCORE', ARC_T1, key) or redis.call('ZSCORE', ARC_T2, key)
    end)
    if stop then return orphans end
  end
  local p = tonumber(redis.call('HGET', ARC, 'p') or '0') or 0
  local lists = {{key = ARC_T1, held = held1, at = 0, orphans = {}}, {key = ARC_T2, held = held2, at = 0, orphans = {}}}
  orphans[ARC_T1], orphans[ARC_T2] = lists[1].orphans, lists[2].orphans
  while visits < max_visits do
    local l = lists[2]
    if lists[1].held > 0 and (lists[1].held > p or lists[2].held <= 0) then l = lists[1] end
    if l.held <= 0 then return orphans end
    local e = redis.call('ZRANGE', l.key, l.at, l.at, 'WITHSCORES')
    if #e == 0 then
      l.held = 0  -- the rest of this list is leased
    else
      l.at = l.at + 1
      visits = visits + 1
      local key = e[1]
      local o = unleased_record(key)
      if o ~= nil then l.held = l.held - 1 end  -- gone, or visited: T1's share counts it out
      if o == false then
        l.orphans[#l.orphans + 1] = key
      elseif o and visit(key, tonumber(e[2]), o[2], o[3]) then
        return orphans
      end
    end
  end
  return orphans
end

-- Walks turn-ttl's order of eviction: objects stored before it was chosen first, then the
-- object due first.
local function walk_unleased_ttl(visit, max_visits)
  local orphans, stop, visits = {}, false, 0
  if redis.call('ZCARD', P .. ':lru') > redis.call('ZCARD', TTL_DUE) then
    orphans[P .. ':lru'], stop, visits = walk_unadopted(visit, max_visits, function(key)
      return redis.call('ZSCORE', TTL_DUE, key)
    end)
    if stop then return orphans end
  end
  orphans[TTL_DUE] = walk_unleased_lru(function(key, _, extents, size)
    return visit(key, nil, extents, size)
  end, max_visits - visits, TTL_DUE)
  return orphans
end

-- Walks the cell's policy's order of eviction (walk_unleased_lru's visit and bound); returns
-- the entries whose record is gone, per list.
local function walk_victims(visit, max_visits)
  if policy() == 'arc' then return walk_unleased_arc(visit, max_visits) end
  if policy() == 'turn-ttl' then return walk_unleased_ttl(visit, max_visits) end
  return {[P .. ':lru'] = walk_unleased_lru(visit, max_visits)}
end

-- Evicts objects that no reader leases, in the order of the cell's policy, until `need` pages
-- came free on the nodes in `usable` (id -> true: those that take allocations; pages on a
-- draining or dead node free nothing a put can use). All or nothing: when the unleased objects
-- cannot free enough, nothing is evicted (a put that fails anyway must not empty the cache).
-- Looks at most `need` + 256 objects: leased ones in front are skipped, a longer search fails.
-- Returns objects evicted and pages freed.
local function evict(need, usable)
  if need <= 0 then return 0, 0 end
  local victims, pages = {}, 0
  local orphans = walk_victims(function(key, _, extents)
    local n = 0
    for id, _, _, count in runs(extents) do
      if usable[id] then n = n + count end
    end
    if n > 0 then
      victims[#victims + 1] = key
      pages = pages + n
    end
    return pages >= need
  end, need + 256)
  for list, keys in pairs(orphans) do
    if #keys > 0 then call_chunked('ZREM', list, keys) end
  end
  if pages < need then return 0, 0 end
  return #victims, evict_keys(victims, 'the pool was full: a put needed ' .. need .. (need == 1 and ' page' or ' pages'))
end

-- Makes room under the quota of `key` for its next object, of `size` bytes, which replaces
-- the one `key` holds now (its pending puts' and reservations' pages count as held:
-- quota_reserve): evicts the quota's least recently used objects that no reader
-- leases (never `key` or its copies) until the quota holds it. All or nothing, as evict, unless
-- the quota is over its limits already (lowered since): then what the search found goes
-- anyway, so that the prefix comes down to its quota over the next puts. Looks at most 1,024
-- objects. Returns nil when it fits (or no quota governs `key`), else the refusal's text.
-- `old`: the quota and size `key`'s record holds now, when the caller read them already.
local function quota_fit(key, size, old)
  local q, prefix = quota_of(key)
  if not q or (q[2] == 0 and q[3] == 0) then return nil end
  local qk = P .. ':quota:' .. q[1]
  local use = redis.call('HMGET', qk, 'objects', 'bytes', 'reserved')
  local objects = tonumber(use[1] or '0') or 0
  local bytes = (tonumber(use[2] or '0') or 0) + math.max(0, tonumber(use[3] or '0') or 0)
  old = old or redis.call('HMGET', P .. ':obj:' .. key, 'quota', 'size')
  if old[1] == q[1] then objects, bytes = objects - 1, bytes - charged_bytes(old[2]) end
  local add = charged_bytes(size)
  local over = (q[2] > 0 and objects > q[2]) or (q[3] > 0 and bytes > q[3])
  local function fits() return (q[2] == 0 or objects + 1 <= q[2]) and (q[3] == 0 or bytes + add <= q[3]) end
  if fits() then return nil end
  local refusal = 'NO_SPACE quota of prefix ' .. prefix .. ' ('
  if q[3] > 0 and add > q[3] then
    redis.call('HINCRBY', qk, 'refused', 1)
    return refusal .. decimal(q[3]) .. ' bytes) is smaller than this object (' .. decimal(add) .. ' bytes in pages)'
  end
  local victims = {}
  local orphans = walk_unleased_lru(function(victim, _, _, vsize)
    if victim == key or string.sub(victim, 1, #key + 1) == key .. '\31' then return false end
    victims[#victims + 1] = victim
    objects, bytes = objects - 1, bytes - charged_bytes(vsize)
    return fits()
  end, 1024, qk .. ':lru')
  if #orphans > 0 then call_chunked('ZREM', qk .. ':lru', orphans) end
  if fits() or over then
    evict_keys(victims, 'the quota of prefix ' .. prefix .. ' was full')
    redis.call('HINCRBY', qk, 'evicted', #victims)
  end
  if fits() then return nil end
  redis.call('HINCRBY', qk, 'refused', 1)
  return 'NO_SPACE for now: quota of prefix ' .. prefix .. ' (' .. decimal(q[2]) .. ' objects, ' .. decimal(q[3]) ..
         ' bytes; 0: no limit) is full, and its objects that no reader leases cannot make room'
end
