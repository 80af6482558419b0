-- prelude/placement.lua: placement: where a put's pages go (most free node first, one node when
-- asked), eviction and waiting when the cell is full, and the refusal that says what holds the
-- pages.
-- Uses     call, pages, quotas, tier, capacity, eviction, grants

-- Allocates the pages of `size` bytes, most free node first and spilling over nodes (with
-- `one_node`, all on one node while one can hold them, evicting there), and
-- records them as pending put `token` of `key` leased for `lease` ms. Expired, then least
-- recently used unleased objects make room for them. A page reservation (key '') takes up to
-- `extra` bytes' more, only from pages already free and at most a quarter of them (idle
-- reserved pages must not push a neighbour into eviction) or RESERVE_MAX (one script must
-- stay short), and lists its pages in P:put:<token>:pages for the commits that take them.
-- Returns page size, extents and nodes, or nil and an error.
local RESERVE_MAX = 256
-- Pages one object may span. A script's work grows with the runs of the object it touches (a
-- commit of 4,096 pages scattered one per run: 60 ms; of 32,768: 580 ms, which held every
-- other client and the heartbeats that long), so the object is what is capped: 4,096 pages is
-- 16 GiB at the default 4 MiB page. records.h kMaxObjectPages (what clients still read) is
-- higher, for objects written before the cap.
local MAX_OBJECT_PAGES = 4096

-- For `one_node` (a copy of an object put with replicas, which must leave the other nodes to
-- the other copies): the candidate that holds all `need` pages, the one with most free pages,
-- after evicting on it alone when none has them free; nil when no node can.
local function one_node_for(need, avoid)
  local free_of = free_pages
  local nodes = {}
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. ':nodes', now, '+inf')) do
    local st = redis.call('HMGET', P .. ':node:' .. id, 'state', 'page_count', 'gen_floor', 'key')
    if st[1] == 'up' and avoid[id] ~= st[4] and (tonumber(st[2]) or 0) >= need then
      nodes[#nodes + 1] = {id, free_of(id), tonumber(st[3] or '0') or 0}
    end
  end
  table.sort(nodes, function(a, b) return a[2] > b[2] end)
  if nodes[1] and nodes[1][2] >= need then return nodes[1] end
  sweep_expired(256)
  for _, c in ipairs(nodes) do  -- the least eviction first
    c[2] = free_of(c[1])
    if c[2] < need then
      evict(need - c[2], {[c[1]] = true})
      c[2] = free_of(c[1])
    end
    if c[2] >= need then return c end
  end
  return nil
end

-- A node's NVMe tier moves objects down while its pool has fewer free pages than its low
-- water (P:node:<id>!ssd 'low'). When an allocation takes it below, the node is told at once
-- (an empty item on its promotion queue, ahead of the gets' keys), once until it looks
-- ('nudged', cleared by begin_write_down), instead of finding out at its next look.
local function nudge_tier(id)
  local sk = P .. ':node:' .. slots_of(id)
  local t = redis.call('HMGET', sk, 'low', 'nudged')
  local low = tonumber(t[1] or '')
  if not low or t[2] or free_pages(id) >= low then return end
  redis.call('HSET', sk, 'nudged', 1)
  redis.call('RPUSH', P .. ':promote:' .. id, '')
end

-- What holds the `held` pages of the nodes in `usable` that are not free, for a put's refusal
-- (the error path only): pending puts (being written, reserved ahead by clients, or waiting
-- for their nodes to fence them: aborted, or past their lease), the rest objects that readers
-- lease or zombies that wait for theirs. Looks at 256 pending puts at most. Every one of them
-- comes back by itself: the refusal begins 'NO_SPACE for now:' (Catalog::pages_held), and a
-- put waits for them within its deadline.
local function held_text(usable, held)
  local writing, reserved, fencing = 0, 0, 0
  local pending = redis.call('ZRANGE', P .. ':pending', 0, 255, 'WITHSCORES')
  for i = 1, #pending, 2 do
    local p = redis.call('HMGET', P .. ':put:' .. pending[i], 'key', 'extents', 'aborted')
    local n = 0
    for id, _, _, count in runs(p[2] or '') do
      if usable[id] then n = n + count end
    end
    if p[3] or tonumber(pending[i + 1]) < now then
      fencing = fencing + n
    elseif p[1] == '' then
      reserved = reserved + n
    else
      writing = writing + n
    end
  end
  local readers = math.max(0, held - writing - reserved - fencing)
  return 'of the others ' .. writing .. ' are being written by puts, ' .. reserved .. ' reserved ahead by clients, ' ..
         fencing .. ' wait for their memory nodes to fence failed puts, and ' .. readers ..
         ' hold objects that readers lease (or pages that wait for their readers)'
end

local function allocate(token, key, size, extra, lease, avoid, one_node)
  local ps = page_size()
  if ps <= 0 then return nil, 'NO_SPACE no memory node has joined this cell' end
  local need = math.ceil(size / ps)
  if need > MAX_OBJECT_PAGES then
    return nil, 'INVALID an object of ' .. need .. ' pages: at most ' .. MAX_OBJECT_PAGES ..
                ' pages per object (a larger page size, or the object in parts)'
  end
  extra = math.min(math.floor(extra / ps), MAX_OBJECT_PAGES - need)
  local cands, total = candidates(avoid)
  local single = one_node and one_node_for(need, avoid)
  if single then
    cands, total = {single}, single[2]
  elseif total < need then
    -- The nodes that take allocations (as usable_nodes), and their pages, in one walk.
    local capacity, usable = 0, {}
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. ':nodes', now, '+inf')) do
      local st = redis.call('HMGET', P .. ':node:' .. id, 'state', 'page_count', 'key')
      if st[1] == 'up' and avoid[id] ~= st[3] then
        capacity = capacity + (tonumber(st[2]) or 0)
        usable[id] = true
      end
    end
    if need > capacity then
      return nil, 'NO_SPACE object needs ' .. need .. ' pages, the live nodes hold ' .. capacity
    end
    sweep_expired(256)
    cands, total = candidates(avoid)
    if total < need then
      evict(need - total, usable)
      cands, total = candidates(avoid)
    end
    if total < need then
      return nil, 'NO_SPACE for now: object needs ' .. need .. ' pages, ' .. total .. ' are free; ' ..
                  held_text(usable, capacity - total)
    end
  end
  local want = need + math.min(extra, RESERVE_MAX, math.floor((total - need) / 4))
  table.sort(cands, function(a, b) return a[2] > b[2] end)
  local ext, nodes, got = {}, {}, 0
  for _, c in ipairs(cands) do
    if got >= want then break end
    local id = c[1]
    local take = math.min(c[2], want - got)
    nodes[#nodes + 1] = id
    for _, e in ipairs(new_runs(id, c[3], take_pages(id, take))) do ext[#ext + 1] = e end
    nudge_tier(id)
    got = got + take
  end
  local extents, node_list = table.concat(ext, ';'), table.concat(nodes, ' ')
  local pk = P .. ':put:' .. token
  redis.call('HSET', pk, 'key', key, 'size', size, 'extents', extents, 'nodes', node_list)
  if key == '' and #ext > 0 then call_chunked('RPUSH', pk .. ':pages', ext) end
  redis.call('ZADD', P .. ':pending', now + lease, token)
  return ps, extents, node_list
end

-- The reply of begin_put and reserve_pages: page size, extents, the lease's deadline, then id,
-- address, key per node, of pending put `token`, allocated now (allocate) or, for a token seen
-- before, as they were then (a retry after a lost reply); an error reply when the pages cannot
-- be found. No page comes from a node in `avoid` (avoid_from_args: nodes the client just
-- failed to reach), unless only they have room left: they may be back already. None ever
-- comes from a node in `apart` (a set of ids: the earlier copies' of an object put with
-- replicas).
local function place_put(token, key, size, extra, lease_text, avoid, one_node, apart, for_key)
  local lease, refused = lease_ms_of(lease_text)
  if not lease then return refused end
  local prev = redis.call('HMGET', P .. ':put:' .. token, 'extents', 'nodes')
  if prev[1] then
    local deadline = redis.call('ZSCORE', P .. ':pending', token) or '0'
    return endpoints({page_size(), prev[1], deadline}, prev[2], 'w', prev[1], tonumber(deadline))
  end
  -- The pages are charged to the quota of the key (a reservation's: the key it is for).
  local qkey = key ~= '' and key or (for_key or '')
  local q = qkey ~= '' and quota_of(qkey)
  if q then
    local failed = quota_fit(qkey, size)
    if failed then return redis.error_reply(failed) end
    if q[3] > 0 and extra > 0 then  -- a reservation's spare pages only within the quota's room
      local use = redis.call('HMGET', P .. ':quota:' .. q[1], 'bytes', 'reserved')
      local room = q[3] - (tonumber(use[1] or '0') or 0) - (tonumber(use[2] or '0') or 0) - charged_bytes(size)
      extra = math.max(0, math.min(extra, room))
    end
  end
  -- The nodes apart are avoided whatever their pool key, and on the second try too.
  local strict = {}
  for id in pairs(apart or {}) do
    strict[id] = redis.call('HGET', P .. ':node:' .. id, 'key')
  end
  for id, k in pairs(avoid) do
    if strict[id] == nil then strict[id] = k end
  end
  local ps, extents, nodes = allocate(token, key, size, extra, lease, strict, one_node)
  if not ps and next(avoid) ~= nil then
    local only_apart = {}
    for id in pairs(apart or {}) do only_apart[id] = strict[id] end
    ps, extents, nodes = allocate(token, key, size, extra, lease, only_apart, one_node)
  end
  if not ps then return redis.error_reply(extents) end
  if q then quota_reserve(token, q, held_pages(extents) * ps) end
  return endpoints({ps, extents, now + lease}, nodes, 'w', extents, now + lease)
end
