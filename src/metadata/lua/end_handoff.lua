-- end_handoff.lua: a reader is done with a handoff; the record goes with its last reader.
--
-- KEYS[1]  the cell's key prefix (P)
-- ARGV     name, reader
-- Returns  1 when the reader was pending, 0 when it was not (ended already, or the record
--          expired)
-- Uses     call

local key = P .. ':handoff:' .. ARGV[1]
local was = redis.call('HDEL', key, 'r:' .. ARGV[2])
if was == 1 and redis.call('HLEN', key) <= 1 then redis.call('DEL', key) end
return was
