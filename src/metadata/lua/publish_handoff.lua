-- publish_handoff.lua: a handoff record (docs/metadata.md): where a process holds memory for
-- readers, and which of them have yet to read it. Replaces a record of the same name.
--
-- KEYS[1]  the cell's key prefix (P)
-- ARGV     name, ttl_ms (> 0), descriptor, reader...
-- Returns  OK
-- Uses     call

local key = P .. ':handoff:' .. ARGV[1]
redis.call('DEL', key)
local fields = {'d', ARGV[3]}
for i = 4, #ARGV do
  fields[#fields + 1] = 'r:' .. ARGV[i]
  fields[#fields + 1] = '1'
end
redis.call('HSET', key, unpack(fields))
redis.call('PEXPIRE', key, ARGV[2])
return 'OK'
