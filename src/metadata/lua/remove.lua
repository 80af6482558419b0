-- remove.lua: drops an object.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     key, why (optional: 'corrupt' when the client found its bytes bad; else 'removed')
-- Returns  OK; NOT_FOUND
--
-- Every copy of an object put with replicas goes with it.
-- Uses     call, objects, replicas

local keys = present_copies(ARGV[1])
if #keys == 0 then return redis.error_reply('NOT_FOUND no object ' .. ARGV[1]) end
local why = ARGV[2] == 'corrupt' and 'corrupt' or 'removed'
for _, key in ipairs(keys) do
  release(key, why, why == 'corrupt' and 'a client found its bytes bad and removed it' or '')
end
return 'OK'
