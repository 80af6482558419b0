-- commit_reserved.lua: a put into reserved pages becomes the object.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     reservation, first, count (the put's pages: the reservation's [first, first+count)),
--          put token, key, size, checksum, layout, ttl_ms, condition, copies, keep hint, commit
--          by, event data (as commit_put's)
-- Returns  OK ('OK announced' when its event data was recorded), also for a commit repeated
--          after it succeeded; STALE when the reservation lost its
--          lease, a node of the put died, restarted or is leaving, or the condition does not
--          hold (the put's pages are freed then); TIMEOUT past its commit-by time (nothing
--          changes)
--
-- The pages leave the reservation (prelude: carve) and become the object's runs, each under a
-- generation of its own: dropping the reservation (release_reservation, reclaim) frees only
-- what no commit took, and a commit repeated after its object was replaced finds its pages
-- gone (STALE), never someone else's. An object it replaces is released.
-- Uses     call, publish

local failed, announced = commit_reserved_one(ARGV, 0)
if failed then return redis.error_reply(failed) end
return committed_reply(announced)
