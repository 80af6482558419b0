-- describe_objects.lua: the records of some objects, for the kvstash CLI. Read-only.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     keys
-- Returns  now, then per key: size ('' when absent), created, expires, last access, nodes,
--          checksum, live read leases, tier ('dram', or 'ssd': on its node's NVMe tier)
-- Uses     call

local out = {now}
for _, key in ipairs(ARGV) do
  local o = redis.call('HMGET', P .. ':obj:' .. key, 'size', 'created', 'expires', 'nodes', 'checksum', 'token', 'tier')
  local last = redis.call('ZSCORE', P .. ':lru', key)
  if o[7] == 'ssd' then last = redis.call('ZSCORE', P .. ':lru_ssd:' .. (o[4] or ''), key) end
  local readers = 0
  if o[6] then readers = redis.call('ZCOUNT', P .. ':readers:' .. o[6], now, '+inf') end
  out[#out + 1] = o[1] or ''
  out[#out + 1] = o[2] or '0'
  out[#out + 1] = o[3] or '0'
  out[#out + 1] = last and string.format('%.0f', math.floor(tonumber(last))) or '0'  -- whole ms
  out[#out + 1] = o[4] or ''
  out[#out + 1] = o[5] or ''
  out[#out + 1] = readers
  out[#out + 1] = o[7] or 'dram'
end
return out
