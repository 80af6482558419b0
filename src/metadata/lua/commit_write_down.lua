-- commit_write_down.lua: objects a node copied to its NVMe tier now live there.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id, epoch, then per object: key, token, slots, sum (the node's xxh3 of the bytes,
--          hex)
-- Returns  per object: OK, or why it stays in the pool (its slots freed): STALE ...
--
-- An object moves only if it is still the one the write-down copied (its token, its pages
-- current), its slots are the write-down's and within its deadline, and no reader leases it
-- now; then its pool pages return to the pool and it takes the tier's LRU place it had.
-- Uses     call, nodes, pages, policy

local id, epoch = ARGV[1], ARGV[2]
local serving = serves(id, epoch)
local out, moved = {}, 0
for i = 3, #ARGV - 3, 4 do
  local key, token, slots, sum = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local ok = P .. ':obj:' .. key
  local o = redis.call('HMGET', ok, 'token', 'moving', 'moving_until', 'extents')
  local why = nil
  if o[1] ~= token then
    why = 'STALE object ' .. key .. ' was replaced or removed during its write-down'
  elseif o[2] ~= slots then
    why = 'STALE the write-down of ' .. key .. ' no longer holds its slots'
  elseif not serving then
    why = 'STALE node ' .. id .. ' is not serving under this epoch'
  elseif (tonumber(o[3] or '0') or 0) < now then
    why = 'STALE the write-down of ' .. key .. ' passed its deadline'
  elseif redis.call('ZCOUNT', P .. ':readers:' .. token, now, '+inf') > 0 then
    why = 'STALE object ' .. key .. ' is leased by a reader'
  elseif not current(o[4]) then
    why = 'STALE the pages of ' .. key .. ' changed'
  end
  if why then
    if o[1] and o[2] == slots then
      free_extents(slots)
      redis.call('HDEL', ok, 'moving', 'moving_until')
    end
    out[#out + 1] = why
  else
    free_extents(o[4])
    redis.call('DEL', P .. ':readers:' .. token)  -- past leases only (checked above)
    redis.call('HSET', ok, 'tier', 'ssd', 'ssd_extents', slots, 'ssd_sum', sum, 'extents', '')
    redis.call('HDEL', ok, 'moving', 'moving_until')
    local last = redis.call('ZSCORE', P .. ':lru', key) or now
    mark_gone(key, false)
    redis.call('ZADD', P .. ':lru_ssd:' .. id, last, key)
    redis.call('SMOVE', P .. ':objs:' .. id, P .. ':tier_objs:' .. id, key)  -- outlives the pool
    moved = moved + 1
    out[#out + 1] = 'OK'
  end
end
if moved > 0 then redis.call('HINCRBY', P .. ':stats', 'written_down', moved) end
return out
