-- prelude/capacity.lua: which live nodes take allocations, and their free pages.
-- Uses     call, pages

-- The nodes a client asks to avoid, from ARGV[first], ARGV[first + 1]... (id, pool key, id,
-- pool key...): id -> the pool key it failed to reach. A node registered again since (another
-- key) is not avoided: it is back.
local function avoid_from_args(first)
  local avoid = {}
  for i = first, #ARGV - 1, 2 do avoid[ARGV[i]] = ARGV[i + 1] end
  return avoid
end

-- The live nodes that take allocations (state up), as a set of ids; none in `avoid`.
local function usable_nodes(avoid)
  local s = {}
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. ':nodes', now, '+inf')) do
    local st = redis.call('HMGET', P .. ':node:' .. id, 'state', 'key')
    if st[1] == 'up' and not (avoid and avoid[id] == st[2]) then s[id] = true end
  end
  return s
end

-- Free pages per live node that takes allocations (none in `avoid`), and their sum.
local function candidates(avoid)
  local c, total = {}, 0
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. ':nodes', now, '+inf')) do
    local st = redis.call('HMGET', P .. ':node:' .. id, 'state', 'gen_floor', 'key')
    if st[1] == 'up' and avoid[id] ~= st[3] then
      local free = free_pages(id)
      if free > 0 then
        c[#c + 1] = {id, free, tonumber(st[2] or '0') or 0}
        total = total + free
      end
    end
  end
  return c, total
end
