-- node_status.lua: one node's record.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id
-- Returns  state, epoch, page_size, page_count, free pages, objects, heartbeat deadline (ms, -1
--          when not in the cell), now; NOT_FOUND for an unknown id

local id = ARGV[1]
local n = redis.call('HMGET', P .. ':node:' .. id, 'state', 'epoch', 'page_size', 'page_count', 'next_page')
if not n[1] then return redis.error_reply('NOT_FOUND no node ' .. id) end
local free = (tonumber(n[4]) or 0) - (tonumber(n[5]) or 0) + redis.call('LLEN', P .. ':free:' .. id)
local d = redis.call('ZSCORE', P .. ':nodes', id)
return {n[1], n[2] or '', tonumber(n[3]) or 0, tonumber(n[4]) or 0, free,
        redis.call('SCARD', P .. ':objs:' .. id), d and tonumber(d) or -1, now}
