-- stat.lua: an object's record, without a lease.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     key
-- Returns  size, checksum, layout, extents, nodes, ms to expiry (-1: none), token, tier ('dram'
--          or 'ssd'); NOT_FOUND
-- Uses     call, objects, replicas

local o = lookup(ARGV[1])  -- the object itself (its version is its put's), else a copy
if not o then o = lookup_copy(ARGV[1]) end
if not o then return redis.error_reply('NOT_FOUND no object ' .. ARGV[1]) end
local exp = tonumber(o[7] or '0') or 0
local left = -1
if exp > 0 then left = exp - now end
return {o[2] or '', o[4] or '', o[5] or '', o[3] or '', o[6] or '', left, o[1], o[10] or 'dram'}
