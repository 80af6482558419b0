-- touch.lua: sets an object's expiry and marks it used.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     key, ttl_ms (0: no expiry)
-- Returns  OK; NOT_FOUND
-- Uses     call, quotas, policy, replicas

local ttl = tonumber(ARGV[2])
local keys = present_copies(ARGV[1])  -- every copy of it
if #keys == 0 then return redis.error_reply('NOT_FOUND no object ' .. ARGV[1]) end
local expires = 0
if ttl > 0 then expires = now + ttl end
for _, key in ipairs(keys) do
  redis.call('HSET', P .. ':obj:' .. key, 'expires', expires)
  if expires > 0 then
    redis.call('ZADD', P .. ':expiry', expires, key)
  else
    redis.call('ZREM', P .. ':expiry', key)
  end
  local where = redis.call('HMGET', P .. ':obj:' .. key, 'tier', 'nodes')
  if where[1] == 'ssd' then
    redis.call('ZADD', P .. ':lru_ssd:' .. where[2], now, key)
  else
    mark_used({key})
  end
end
local gens = {}
for i, key in ipairs(keys) do gens[i] = redis.call('HGET', P .. ':obj:' .. key, 'quota') or '' end
quota_touch(keys, gens)
return 'OK'
