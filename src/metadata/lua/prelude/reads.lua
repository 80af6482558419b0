-- prelude/reads.lua: read leases: a get's lease on the readable copy, promotions from the tier,
-- what a batch of leases counts.
-- Uses     call, pages, quotas, policy, replicas, grants

-- What a run's leases leave for lease_reads_done: hits, misses and LRU touches, so that many
-- leases cost one command of each.
local function new_read_batch()
  return {hits = 0, misses = 0, tier = 0, lru = {}, hints = {}, qkeys = {}, qgens = {}}
end

-- How long a queued promotion keeps others from queueing it again (a node that lost the job
-- in a crash: the next get after this queues it afresh).
local PROMOTE_MS = 5000
-- At most this many promotions wait per node (the oldest go; their gets queue them again).
local PROMOTE_QUEUE = 4096

-- Wakes the gets waiting for the promotion of `key` (object token `token`) to end, however it
-- ended: they ask again. At most 64 items; a waiter not woken asks again after its wait.
local function wake_waiters(key, token)
  local ok = P .. ':obj:' .. key
  local n = math.min(tonumber(redis.call('HGET', ok, 'waiters') or '0') or 0, 64)
  if n <= 0 then return end
  redis.call('HDEL', ok, 'waiters')
  local wk = P .. ':woken:' .. token
  local items = {}
  for i = 1, n do items[i] = '1' end
  redis.call('LPUSH', wk, unpack(items))
  redis.call('PEXPIRE', wk, 10000)
end

-- Queues the promotion of `key`, on the tier of node `id`, unless one is queued or running.
-- Returns whether it queued one now.
local function queue_promotion(key, id)
  local ok = P .. ':obj:' .. key
  if (tonumber(redis.call('HGET', ok, 'promoting') or '0') or 0) >= now then return false end
  redis.call('HSET', ok, 'promoting', now + PROMOTE_MS)
  local qk = P .. ':promote:' .. id
  redis.call('LPUSH', qk, key)
  redis.call('LTRIM', qk, 0, PROMOTE_QUEUE - 1)
  return true
end

-- Looks `key` up and leases its readable copy for `reader` until now + `lease_ms`: the reply
-- of begin_get, or nil when there is none (and, for an object on a tier that `no_promote`
-- leaves there, why). Its hit or miss and LRU touch (with `hint`, turn-ttl's) go into `batch`.
local function lease_read(key, reader, lease_ms, batch, no_promote, hint)
  local o, leased = lookup_copy(key)
  if not o then
    batch.misses = batch.misses + 1
    return nil
  end
  if o[10] == 'ssd' then
    -- On the tier: the node stages it back into pool pages (one more round trip for the get,
    -- which asks again), or, with no_promote, a miss that says where it is.
    if no_promote then
      batch.tier = batch.tier + 1
      return nil, 'ON_SSD ' .. o[6]
    end
    if queue_promotion(leased, o[6]) then batch.tier = batch.tier + 1 end
    -- The get waits on P:woken:<token> (BLPOP), where the promotion's end pushes one item per
    -- waiter (wake_waiters).
    redis.call('HINCRBY', P .. ':obj:' .. leased, 'waiters', 1)
    return {'PROMOTING', o[6], o[1]}
  end
  local deadline = now + lease_ms
  redis.call('ZADD', P .. ':readers:' .. o[1], deadline, reader)
  batch.hits = batch.hits + 1
  batch.lru[#batch.lru + 1] = leased
  batch.hints[#batch.lru] = hint
  if o[9] then
    batch.qkeys[#batch.qkeys + 1] = leased
    batch.qgens[#batch.qkeys] = o[9]
  end
  return endpoints({page_size(), o[1], o[2] or '', o[3] or '', o[4] or '', o[5] or '', deadline}, o[6], 'r', o[3],
                   deadline)
end

local function lease_reads_done(batch)
  if batch.hits > 0 then redis.call('HINCRBY', P .. ':stats', 'hits', batch.hits) end
  if batch.misses > 0 then redis.call('HINCRBY', P .. ':stats', 'misses', batch.misses) end
  if batch.tier > 0 then redis.call('HINCRBY', P .. ':stats', 'tier_hits', batch.tier) end
  mark_used(batch.lru, batch.hints)
  quota_touch(batch.qkeys, batch.qgens)
end

-- The node ids of an extent list, space-separated, in order of first appearance.
local function nodes_of(extents)
  local _, order = by_node(extents)
  return table.concat(order, ' ')
end
