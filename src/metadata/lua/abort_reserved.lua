-- abort_reserved.lua: ends a put into reserved pages that will not commit.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     reservation, first, count (the put's pages, as commit_reserved's), then the nodes
--          that confirmed that none of the put's writes can land on them any more
-- Returns  the pages left waiting
--
-- As abort_put: the put's pages on those nodes, and on nodes that are not alive, are freed
-- now; the rest stay in the reservation, and return with it once its lease has passed and
-- their nodes have fenced through it. Idempotent.
-- Uses     call, nodes, pages, publish

local res, first, count = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local pk = P .. ':put:' .. res
if count <= 0 or redis.call('HGET', pk, 'key') ~= '' then return 0 end
local confirmed = {}
for i = 4, #ARGV do confirmed[ARGV[i]] = true end
local free, back, keep = {}, {}, 0
for id, page, gen, n in runs(carve(res, first, count, false)) do
  if confirmed[id] or not live(id) then
    free[#free + 1] = run_text(id, page, gen, n)
  else
    back[#back + 1] = run_text(id, page, gen, n)
    keep = keep + n
  end
end
free_extents(table.concat(free, ';'))
if #back > 0 then
  local held = redis.call('HGET', pk, 'extents')
  if held ~= '' then back[#back + 1] = held end
  redis.call('HSET', pk, 'extents', table.concat(back, ';'))
end
return keep
