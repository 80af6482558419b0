-- prelude/pages.lua: pages: extent lists and their runs, the free list, taking and returning pages,
-- the generations that make a run's holder the only one that can free it, and pending puts.
-- Uses     call

-- Runs. An extent list is "node,page,generation,count;..." in object order: `count` pages from
-- `page` on, all under one generation; "node,page,generation" is a run of one page. A run's
-- generation is stored at its first page only (P:gen:<node>, field = that page): the run is
-- current while that field holds its generation. Nothing frees part of a run, so while it is
-- current none of its pages can be anyone else's; freeing stores the generation negated, and
-- every new run at a page takes a generation above any that page held. Freeing twice, or with
-- an outdated extent, is a no-op. Scripts touch a run, not each of its pages: a chunk of 32
-- pages allocated together costs what one page costs.
local RUN = '([^,;]+),(%d+),(%d+),?(%d*)'

-- Iterates over the runs of `list`: node, first page, generation, page count (numbers).
local function runs(list)
  local it = string.gmatch(list or '', RUN)
  return function()
    local id, page, gen, n = it()
    if not id then return nil end
    return id, tonumber(page), tonumber(gen), tonumber(n) or 1
  end
end

local function run_text(id, page, gen, n)
  if n == 1 then return string.format('%s,%d,%d', id, page, gen) end  -- %d: no exponent
  return string.format('%s,%d,%d,%d', id, page, gen, n)
end

-- The runs of a list grouped by node, in order of first appearance: per node the first pages,
-- generations and counts.
local function by_node(list)
  local groups, order = {}, {}
  for id, page, gen, n in runs(list) do
    local g = groups[id]
    if not g then
      g = {pages = {}, gens = {}, counts = {}}
      groups[id] = g
      order[#order + 1] = id
    end
    g.pages[#g.pages + 1] = page
    g.gens[#g.gens + 1] = gen
    g.counts[#g.counts + 1] = n
  end
  return groups, order
end

-- Calls visit(id, group, i, current) for each run of `list` (on node `only`, when given),
-- current telling whether the run still holds the generation it names.
local function each_run_state(list, visit, only)
  local groups, order = by_node(list)
  for _, id in ipairs(order) do
    if not only or id == only then
      local g = groups[id]
      local cur = hmget_chunked(P .. ':gen:' .. id, g.pages)
      for i = 1, #g.pages do visit(id, g, i, tonumber(cur[i] or '0') == g.gens[i]) end
    end
  end
end

-- Whether every run of `list` still holds the generation it names.
local function current(list)
  local all = true
  each_run_state(list, function(_, _, _, cur) all = all and cur end)
  return all
end

-- How many pages of `list` (on node `only`, when given) are in runs that still hold their
-- generation: held by whoever the list is.
local function held_pages(list, only)
  local n = 0
  each_run_state(list, function(_, g, i, cur) if cur then n = n + g.counts[i] end end, only)
  return n
end

-- Free pages of node `id`: never handed out (from next_page up) and on its free list.
local function free_pages(id)
  local st = redis.call('HMGET', P .. ':node:' .. id, 'page_count', 'next_page', 'free_pages')
  return (tonumber(st[1]) or 0) - (tonumber(st[2]) or 0) + (tonumber(st[3]) or 0)
end

-- Returns the current runs of `list` to their nodes' free lists ("page,count" entries; the
-- node's free_pages counts their pages). Returns the pages freed.
local function free_extents(list)
  local total = 0
  local groups, order = by_node(list)
  for _, id in ipairs(order) do
    local g, gk = groups[id], P .. ':gen:' .. id
    local cur = hmget_chunked(gk, g.pages)
    local sets, frees, n = {}, {}, 0
    for i, page in ipairs(g.pages) do
      local gen = g.gens[i]
      if gen > 0 and tonumber(cur[i] or '0') == gen then
        sets[#sets + 1] = page
        sets[#sets + 1] = string.format('%d', -gen)
        frees[#frees + 1] = string.format('%d,%d', page, g.counts[i])
        n = n + g.counts[i]
      end
    end
    if n > 0 then
      call_chunked('HSET', gk, sets, 2)
      call_chunked('LPUSH', P .. ':free:' .. id, frees)
      redis.call('HINCRBY', P .. ':node:' .. id, 'free_pages', n)
      total = total + n
    end
  end
  return total
end

-- Takes `take` pages of node `id` (it has them free): returned runs first, oldest first, the
-- last one split when it holds more than is needed, then fresh pages. Returns spans
-- {page, count}, neighbours merged.
local function take_pages(id, take)
  local spans, fk = {}, P .. ':free:' .. id
  local function add(page, n)
    local last = spans[#spans]
    if last and last[1] + last[2] == page then
      last[2] = last[2] + n
    else
      spans[#spans + 1] = {page, n}
    end
  end
  local left = take
  while left > 0 do
    local e = redis.call('RPOP', fk)
    if not e then break end
    local page, n = string.match(e, '^(%d+),?(%d*)$')
    page, n = tonumber(page), tonumber(n) or 1
    if n > left then
      redis.call('RPUSH', fk, string.format('%d,%d', page + left, n - left))  -- taken next
      n = left
    end
    add(page, n)
    left = left - n
  end
  if take > left then redis.call('HINCRBY', P .. ':node:' .. id, 'free_pages', left - take) end
  if left > 0 then
    local last = redis.call('HINCRBY', P .. ':node:' .. id, 'next_page', left)
    add(last - left, left)
  end
  return spans
end

-- Makes runs of `spans` ({page, count}) on node `id`: each takes a generation above its
-- first page's every earlier one and above the node's `floor`. Returns their extents.
local function new_runs(id, floor, spans)
  local gk, starts = P .. ':gen:' .. id, {}
  for i, s in ipairs(spans) do starts[i] = s[1] end
  local old = hmget_chunked(gk, starts)
  local sets, out = {}, {}
  for i, s in ipairs(spans) do
    local gen = math.max(math.abs(tonumber(old[i] or '0') or 0), floor) + 1
    sets[#sets + 1] = s[1]
    sets[#sets + 1] = string.format('%d', gen)
    out[i] = run_text(id, s[1], gen, s[2])
  end
  if #sets > 0 then call_chunked('HSET', gk, sets, 2) end
  return out
end

-- Ends pending put `token` (or page reservation): its record goes, and the pages of `extents`
-- (the put's, or what is left of them) return to the pool. A reservation's pages that became
-- objects carry a later generation, so its extents free only what no commit took.
local quota_unreserve  -- below, with the quotas
local function drop_put(token, extents)
  quota_unreserve(token)
  free_extents(extents)
  redis.call('DEL', P .. ':put:' .. token, P .. ':put:' .. token .. ':pages')
  redis.call('ZREM', P .. ':pending', token)
end
