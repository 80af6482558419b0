-- prelude/objects.lua: an object's life: its release from every index, whether its pages are
-- readable, lookup, and the sweep that releases the objects of gone nodes in bounded batches.
-- Uses     call, nodes, pages, quotas, tier, events, policy

-- Drops an object from every index. Its pages return to the pool, or wait as a zombie until
-- the last read lease on them ends; its slots on the tier (and a write-down's) return at once:
-- only the node's own tier thread writes slots, and a promotion reading a slot freed meanwhile
-- fails its sum (src/node/tier.h). `why` and `detail`: why it leaves, for record_gone (none:
-- a new object replaces it). Returns the pages freed now.
local function release(key, why, detail)
  local ok = P .. ':obj:' .. key
  local o =
    redis.call('HMGET', ok, 'token', 'extents', 'nodes', 'size', 'quota', 'ssd_extents', 'moving', 'ev', 'turn')
  redis.call('DEL', ok)
  if why and o[1] then record_gone(key, why, detail) end
  if o[8] then
    redis.call('SREM', P .. ':events:objs', key)
    emit_event('removed', key, o[8], why or 'replaced')
  end
  quota_uncharge(o[5], key, o[4])
  if o[6] or o[7] then
    free_extents(o[6])
    free_extents(o[7])
    for id in string.gmatch(o[3] or '', '[^ ]+') do
      redis.call('ZREM', P .. ':lru_ssd:' .. id, key)
      redis.call('SREM', P .. ':tier_objs:' .. id, key)
    end
  end
  -- Sizes stay decimal strings: Lua would print a number of 15 digits or more as 1e+14.
  if o[1] and (tonumber(o[4] or '0') or 0) > 0 then redis.call('HINCRBY', P .. ':stats', 'bytes', '-' .. o[4]) end
  mark_gone(key, why == 'evicted', o[9])
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
    local v = node_view(id)
    if not v.alive or (v.state ~= 'up' and v.state ~= 'draining') then return false end
    if not floors[id] then
      floors[id] = v.floor
      left = left + 1
    end
  end
  for id, _, gen in runs(extents) do
    if left == 0 then break end
    local floor = floors[id]
    if floor then
      if gen <= floor then return false end
      floors[id] = nil
      left = left - 1
    end
  end
  return true
end

-- The fields of a readable object (present, unexpired, its pages on live nodes), or nil. An
-- expired object or one on a dead or restarted node is released on the spot.
local FIELDS = {'token', 'size', 'extents', 'checksum', 'layout', 'nodes', 'expires', 'copies', 'quota', 'tier',
                'ssd_extents'}
-- Why the pages of an object on `nodes` are no longer readable (on_live_pages said so): a
-- node past its heartbeat, one leaving the cell, or one that registered again since (a
-- restart, a pause past its deadline, a failover's fence).
local function why_unreadable(nodes)
  for id in string.gmatch(nodes or '', '[^ ]+') do
    local v = node_view(id)
    if not v.alive then return 'node_down', id end
    if v.state ~= 'up' and v.state ~= 'draining' then return 'node_left', id end
  end
  return 'node_restarted', (string.match(nodes or '', '[^ ]+') or '')
end

local function lookup(key)
  local o = redis.call('HMGET', P .. ':obj:' .. key, unpack(FIELDS))
  if not o[1] then return nil end
  local exp = tonumber(o[7] or '0') or 0
  local expired = exp > 0 and exp <= now
  if o[10] == 'ssd' then
    -- On a tier: gone with the tier (another device, or the node forgotten), or expired; while
    -- its node is down or restarting, unreadable but kept: the node finds its tier again.
    if expired or not slots_live(o[11]) then
      release(key, expired and 'expired' or 'tier_lost', expired and '' or o[6])
      return nil
    end
    if not on_live_pages('', o[6]) then return nil end
    return o
  end
  if expired then
    release(key, 'expired')
    return nil
  end
  if not on_live_pages(o[3], o[6]) then
    release(key, why_unreadable(o[6]))
    return nil
  end
  return o
end

-- Hands the objects of set `ok` to the sweep (the set becomes a sweep batch in O(1)): they are
-- unreadable already, and reclaim releases them in bounded batches, so no script walks a
-- million objects at once. Returns how many objects that was.
local function to_sweep(ok)
  local n = redis.call('SCARD', ok)
  if n > 0 then
    local batch = P .. ':sweep:' .. redis.call('INCR', P .. ':sweep_seq')
    redis.call('RENAME', ok, batch)
    redis.call('RPUSH', P .. ':sweep', batch)
  end
  return n
end

-- Hands node `id`'s pool objects to the sweep (the node is gone or registered again, which
-- lookup sees).
local function sweep_node_objects(id)
  return to_sweep(P .. ':objs:' .. id)
end

-- Starts node `id`'s NVMe tier over: its slots above a new floor (every object on it
-- unreadable at once), its free list and generations gone, its objects (P:tier_objs:<id>) handed
-- to the sweep. For a node whose device is not the tier the cell knew, or that is forgotten.
-- Returns how many objects that was.
local function sweep_tier_objects(id)
  local sk = P .. ':node:' .. slots_of(id)
  local floor = (redis.call('HINCRBY', sk, 'epochs', 1) - 1) * 4294967296
  redis.call('DEL', P .. ':free:' .. slots_of(id), P .. ':gen:' .. slots_of(id), P .. ':promote:' .. id)
  redis.call('HSET', sk, 'next_page', 0, 'free_pages', 0, 'gen_floor', floor)
  return to_sweep(P .. ':tier_objs:' .. id)
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
