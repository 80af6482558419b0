-- begin_get.lua: looks the object up and leases it for reading.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     key, reader, lease_ms, no_promote ('1': an object on the NVMe tier stays there), keep hint
--          ('' or absent: none; turn-ttl's, prelude's ttl_hint)
-- Returns  page_size, token, size, extents, checksum, layout, the lease's deadline (ms of Redis
--          time), then id, address, key per node; PROMOTING, node id, object token when the object
--          is on that node's NVMe tier (its promotion is queued: wait on P:woken:<token>, then ask
--          again); NOT_FOUND (with no_promote,
--          'NOT_FOUND ON_SSD <node>' for an object on the tier)
--
-- Of an object put with replicas, the readable copy with the fewest readers is leased.
-- Uses     call, grants, reads

local lease_ms, refused = lease_ms_of(ARGV[3])
if not lease_ms then return refused end
local batch = new_read_batch()
local leased, why = lease_read(ARGV[1], ARGV[2], lease_ms, batch, ARGV[4] == '1', ARGV[5])
lease_reads_done(batch)
if not leased then
  if why then return redis.error_reply('NOT_FOUND ' .. why .. ': object ' .. ARGV[1] .. ' is on the NVMe tier, not promoted') end
  return redis.error_reply('NOT_FOUND no object ' .. ARGV[1])
end
return leased
