-- remove.lua: drops an object.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     key
-- Returns  OK; NOT_FOUND

if not present(ARGV[1]) then return redis.error_reply('NOT_FOUND no object ' .. ARGV[1]) end
release(ARGV[1])
return 'OK'
