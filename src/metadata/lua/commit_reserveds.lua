-- commit_reserveds.lua: commit_reserved of many puts in one run (a KV save's chunks, ready
-- together), so that a save costs Redis one script, not one per chunk.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     per put, commit_reserved's fourteen arguments: reservation, first, count, put token,
--          key, size, checksum, layout, ttl_ms, condition, copies, keep hint, commit by, event
--          data
-- Returns  one reply per put, in order: OK (or 'OK announced'), or the error text
--          commit_reserved would have replied (STALE ..., INVALID ..., TIMEOUT ...)
-- Uses     call, publish

local out = {}
for base = 0, #ARGV - 14, 14 do
  local failed, announced = commit_reserved_one(ARGV, base)
  out[#out + 1] = failed or committed_reply(announced)
end
return out
