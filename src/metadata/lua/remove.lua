-- remove.lua: drops an object.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     key
-- Returns  OK; NOT_FOUND
--
-- Every copy of an object put with replicas goes with it.

local keys = present_copies(ARGV[1])
if #keys == 0 then return redis.error_reply('NOT_FOUND no object ' .. ARGV[1]) end
for _, key in ipairs(keys) do release(key) end
return 'OK'
