-- release_reservation.lua: a client returns the pages of its reservation it never handed out,
-- and with them, once every put from it has settled, the reservation's record.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     reservation, from (pages [from, end) were never given to a put), drop ('1': the
--          client's puts from it have all committed or been aborted with every node confirming)
-- Returns  the pages freed
--
-- No write went to those pages, so they are free at once. The pages before `from` stay with
-- the reservation: commits moved theirs to objects, and the pages of failed puts return
-- once its lease has passed and its nodes have fenced through it (reclaim). With drop, the
-- record goes now, unless a page before `from` is still the reservation's (a put the client
-- believes settled is not): then it stays for reclaim. Idempotent.
-- Uses     call, pages, quotas, publish

local res, from, drop = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local pk = P .. ':put:' .. res
if redis.call('HGET', pk, 'key') ~= '' then return 0 end
local rest = carve(res, from, 4294967296, false)  -- every page from `from` on
local freed = free_extents(rest)
quota_unreserve(res, freed * page_size())
redis.call('HSET', pk, 'ends', math.min(from, tonumber(redis.call('HGET', pk, 'ends') or '') or from))
local handed = redis.call('HGET', pk, 'extents')
if from <= 0 or (drop and held_pages(handed) == 0) then drop_put(res, handed) end
return freed
