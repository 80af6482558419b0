-- commit_reserved.lua: a put into reserved pages becomes the object.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     reservation, first, count (the put's pages: the reservation's [first, first+count)),
--          put token, key, size, checksum, layout, ttl_ms, condition, copies (as commit_put's)
-- Returns  OK, also for a commit repeated after it succeeded; STALE when the reservation lost its
--          lease, a node of the put died, restarted or is leaving, or the condition does not
--          hold (the put's pages are freed then)
--
-- The pages move to the object with their generation raised by one: the reservation's record
-- still names them under the old one, so dropping it (release_reservation, reclaim) frees only
-- what no commit took. An object it replaces is released.

local res, first, count = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local token, key, size, ttl = ARGV[4], ARGV[5], ARGV[6], tonumber(ARGV[9])
if redis.call('HGET', P .. ':obj:' .. key, 'token') == token then return 'OK' end
local pk = P .. ':put:' .. res
if redis.call('HGET', pk, 'key') ~= '' then
  return redis.error_reply('STALE the page reservation lost its lease before the commit; its pages were reclaimed')
end
local taken = {}
if count > 0 then taken = redis.call('LRANGE', pk .. ':pages', first, first + count - 1) end
if #taken ~= count then return redis.error_reply('INVALID the reservation holds no pages ' .. first .. '+' .. count) end
local extents = table.concat(taken, ';')
local nodes = nodes_of(extents)
if not current(extents) or not on_live_pages(extents, nodes) then
  return redis.error_reply('STALE a memory node of the put died, restarted or began leaving before the' ..
                           ' commit, or the reservation\'s pages were reclaimed')
end
local failed = condition_fails(key, ARGV[10])
if failed then
  free_extents(extents)  -- the writes are done: nothing can land in them any more
  return redis.error_reply(failed)
end
local groups, order = by_node(extents)
local moved = {}
for _, id in ipairs(order) do
  local g, sets = groups[id], {}
  for i, page in ipairs(g.pages) do
    sets[#sets + 1] = page
    sets[#sets + 1] = g.gens[i] + 1
  end
  call_chunked('HSET', P .. ':gen:' .. id, sets, 2)
end
for i, e in ipairs(taken) do
  local id, page, gen = string.match(e, '([^,]+),(%d+),(%d+)')
  moved[i] = string.format('%s,%s,%d', id, page, tonumber(gen) + 1)
end
publish(key, token, size, table.concat(moved, ';'), nodes, ARGV[7], ARGV[8], ttl, ARGV[11])
return 'OK'
