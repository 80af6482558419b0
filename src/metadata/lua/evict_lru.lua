-- evict_lru.lua: an operator's eviction (kvstash evict).
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     idle_ms (0: any), max_bytes (0: no bound), dry_run (1/0), limit
-- Returns  now, then key, size, last access per object chosen
--
-- Least recently used unleased objects first: those idle for at least idle_ms, until
-- max_bytes of them are chosen (the one that crosses it included). Released unless dry_run.
-- Uses     call, eviction

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
if not dry then evict_keys(chosen, 'an operator evicted it (kvstash evict)') end
return out
