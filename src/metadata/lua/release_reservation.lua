-- release_reservation.lua: a client returns the pages of its reservation it never handed out.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     reservation, from (pages [from, end) were never given to a put)
-- Returns  the pages freed
--
-- No write went to those pages, so they are free at once. The pages before `from` stay with
-- the reservation: commits moved theirs to objects, and the pages of failed puts return
-- once its lease has passed and its nodes have fenced through it (reclaim). Idempotent.

local res, from = ARGV[1], tonumber(ARGV[2])
local pk = P .. ':put:' .. res
if redis.call('HGET', pk, 'key') ~= '' then return 0 end
local rest = redis.call('LRANGE', pk .. ':pages', from, -1)
local freed = free_extents(table.concat(rest, ';'))
if from <= 0 then
  drop_put(res, '')
  return freed
end
redis.call('LTRIM', pk .. ':pages', 0, from - 1)
redis.call('HSET', pk, 'extents', table.concat(redis.call('LRANGE', pk .. ':pages', 0, -1), ';'))
return freed
