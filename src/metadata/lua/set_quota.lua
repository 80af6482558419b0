-- set_quota.lua: sets, changes or removes the quota of a key prefix (prelude, "Quotas").
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     prefix, max objects, max bytes (decimal; 0: no limit; both 0: remove the quota)
-- Returns  the quota's gen ('0' once removed), and '1' when the cell's objects must be counted
--          again (quota_scan) because which quota governs some of them changed, else '0';
--          INVALID for an empty prefix, a bad number, or a quota past the 256th
--
-- Changing a quota's limits keeps its counts: objects over a lowered limit leave by its own
-- eviction as the prefix's next puts need room.
-- Uses     call, quotas

local prefix, max_objects, max_bytes = ARGV[1], ARGV[2], ARGV[3]
if prefix == '' then return redis.error_reply('INVALID a quota needs a key prefix') end
if not string.match(max_objects, '^%d+$') or not string.match(max_bytes, '^%d+$') or #max_objects > 15 or
   #max_bytes > 15 then
  return redis.error_reply('INVALID quota limits are decimal numbers below 10^15')
end
local current = parse_quota(redis.call('HGET', P .. ':quotas', prefix))
if tonumber(max_objects) == 0 and tonumber(max_bytes) == 0 then
  if not current then return {'0', '0'} end
  redis.call('DEL', P .. ':quota:' .. current[1], P .. ':quota:' .. current[1] .. ':lru')
  redis.call('HDEL', P .. ':quotas', prefix)
  if redis.call('HINCRBY', P .. ':quota_lens', #prefix, -1) <= 0 then redis.call('HDEL', P .. ':quota_lens', #prefix) end
  -- Its objects now fall to a shorter prefix's quota, if one covers them.
  return {'0', redis.call('HLEN', P .. ':quotas') > 0 and '1' or '0'}
end
if current then
  redis.call('HSET', P .. ':quotas', prefix, current[1] .. ' ' .. max_objects .. ' ' .. max_bytes)
  return {current[1], '0'}
end
if redis.call('HLEN', P .. ':quotas') >= MAX_QUOTAS then
  return redis.error_reply('INVALID a cell has at most ' .. MAX_QUOTAS .. ' quotas')
end
local gen = tostring(redis.call('INCR', P .. ':quota_seq'))
redis.call('HSET', P .. ':quotas', prefix, gen .. ' ' .. max_objects .. ' ' .. max_bytes)
redis.call('HINCRBY', P .. ':quota_lens', #prefix, 1)
redis.call('HSET', P .. ':quota:' .. gen, 'objects', 0, 'bytes', 0, 'evicted', 0, 'refused', 0, 'counting', 1)
return {gen, '1'}
