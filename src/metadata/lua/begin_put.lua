-- begin_put.lua: allocates the pages of a new object.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     token, key, size, lease_ms
-- Returns  page_size, extents, the lease's deadline (ms of Redis time: the fence tag of the put's
--          writes at the nodes), then id, address, key per node; NO_SPACE when the pages
--          cannot be found
--
-- Most free node first, spilling over nodes; expired then least recently used unleased
-- objects make room. Repeating a begin_put with the same token returns the same pages (a retry
-- after a lost reply).

local token, key, size, lease = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local pk = P .. ':put:' .. token
local prev = redis.call('HMGET', pk, 'extents', 'nodes')
if prev[1] then
  local deadline = redis.call('ZSCORE', P .. ':pending', token) or '0'
  return endpoints({page_size(), prev[1], deadline}, prev[2])
end
local ps = page_size()
if ps <= 0 then return redis.error_reply('NO_SPACE no memory node has joined this cell') end
local need = math.ceil(size / ps)
local cands, total = candidates()
if total < need then
  local capacity = 0
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. ':nodes', now, '+inf')) do
    local st = redis.call('HMGET', P .. ':node:' .. id, 'state', 'page_count')
    if st[1] == 'up' then capacity = capacity + (tonumber(st[2]) or 0) end
  end
  if need > capacity then
    return redis.error_reply('NO_SPACE object needs ' .. need .. ' pages, the live nodes hold ' .. capacity)
  end
  sweep_expired(256)
  cands, total = candidates()
  if total < need then
    evict(need - total, usable_nodes())
    cands, total = candidates()
  end
  if total < need then
    return redis.error_reply('NO_SPACE object needs ' .. need .. ' pages, ' .. total ..
                             ' are free and every other page is leased by a reader or a put, or waits' ..
                             ' for its memory node to fence a failed put')
  end
end
table.sort(cands, function(a, b) return a[2] > b[2] end)
local ext, nodes, got = {}, {}, 0
for _, c in ipairs(cands) do
  if got >= need then break end
  local id = c[1]
  local take = math.min(c[2], need - got)
  nodes[#nodes + 1] = id
  -- Returned pages first (oldest first, so neighbours stay neighbours), then fresh ones.
  local pages = redis.call('RPOP', P .. ':free:' .. id, take)
  if not pages then pages = {} end
  local fresh = take - #pages
  if fresh > 0 then
    local last = redis.call('HINCRBY', P .. ':node:' .. id, 'next_page', fresh)
    for page = last - fresh, last - 1 do pages[#pages + 1] = page end
  end
  local gk = P .. ':gen:' .. id
  local old = hmget_chunked(gk, pages)
  local sets = {}
  for i, page in ipairs(pages) do
    local gen = math.max(math.abs(tonumber(old[i] or '0')), c[3]) + 1
    sets[#sets + 1] = page
    sets[#sets + 1] = gen
    ext[#ext + 1] = string.format('%s,%s,%d', id, page, gen)  -- %d: no exponent for big numbers
  end
  call_chunked('HSET', gk, sets, 2)
  got = got + take
end
local extents, node_list = table.concat(ext, ';'), table.concat(nodes, ' ')
redis.call('HSET', pk, 'key', key, 'size', size, 'extents', extents, 'nodes', node_list)
redis.call('ZADD', P .. ':pending', now + lease, token)
return endpoints({ps, extents, now + lease}, node_list)
