-- begin_gets.lua: begin_get of many objects in one run (a KV load's chunks), so that a load
-- costs Redis one script, not one per chunk.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     lease_ms, then key, reader, keep hint ('' none: turn-ttl's, prelude's ttl_hint) per
--          object
-- Returns  one array per object, in order: begin_get's reply, or an empty array when there is
--          no such object; PROMOTING, node id, token for an object on that node's NVMe tier (its
--          promotion queued)
-- Uses     call, grants, reads

local lease_ms, refused = lease_ms_of(ARGV[1])
if not lease_ms then return refused end
local batch = new_read_batch()
local out = {}
for i = 2, #ARGV - 2, 3 do
  out[#out + 1] = lease_read(ARGV[i], ARGV[i + 1], lease_ms, batch, nil, ARGV[i + 2]) or {}
end
lease_reads_done(batch)
return out
