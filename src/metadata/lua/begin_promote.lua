-- begin_promote.lua: a node stages an object of its NVMe tier back into its pool.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id, epoch, key, put token (the promotion's, fresh), lease_ms, evict ('1': when the
--          pool has no free page, evict its least recently used unleased objects for it; else
--          NO_SPACE, and the node moves some down first)
-- Returns  the lease's deadline, token, size, pool extents (new, on this node), slots, the
--          node's sum of the bytes; DONE when there is nothing to do (the object is in the pool
--          already, or gone); STALE when the node is not this epoch, alive and up; NO_SPACE
--
-- The pages are a pending put of the node's, under the same rules as any put: fresh
-- generations, a lease, and, if the node never commits, freed by reclaim only once the node
-- has fenced through the lease's deadline (its own writes into the pages included).
-- Uses     call, nodes, pages, quotas, objects, eviction, grants, reads

local id, epoch, key, ptoken = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local lease, refused = lease_ms_of(ARGV[5])
if not lease then return refused end
if not serves(id, epoch) then return redis.error_reply('STALE node ' .. id .. ' is not serving under this epoch') end
local ok = P .. ':obj:' .. key
local o = redis.call('HMGET', ok, 'token', 'tier', 'ssd_extents', 'size', 'nodes', 'ssd_sum')
if not o[1] or o[2] ~= 'ssd' or o[5] ~= id or not lookup(key) then
  if o[1] then
    redis.call('HDEL', ok, 'promoting')
    wake_waiters(key, o[1])
  end
  return 'DONE'
end
local ps = page_size()
local need = math.ceil((tonumber(o[4]) or 0) / ps)
if free_pages(id) < need then
  sweep_expired(64)
  local free = free_pages(id)
  if free < need and ARGV[6] == '1' then evict(need - free, {[id] = true}) end
end
if free_pages(id) < need then
  if ARGV[6] == '1' then
    redis.call('HDEL', ok, 'promoting')
    wake_waiters(key, o[1])
  end
  return redis.error_reply('NO_SPACE node ' .. id .. ' has ' .. free_pages(id) .. ' free pages, the promotion of ' ..
                           key .. ' needs ' .. need .. ', and what no reader leases cannot make room')
end
local floor = tonumber(redis.call('HGET', P .. ':node:' .. id, 'gen_floor') or '0') or 0
local extents = table.concat(new_runs(id, floor, take_pages(id, need)), ';')
local deadline = now + lease
redis.call('HSET', P .. ':put:' .. ptoken, 'key', key, 'size', o[4], 'extents', extents, 'nodes', id)
redis.call('ZADD', P .. ':pending', deadline, ptoken)
redis.call('HSET', ok, 'promoting', deadline)
return {deadline, o[1], o[4], extents, o[3], o[6] or ''}
