-- prelude.lua: the start of every script: the prefix, the time from Redis itself (client
-- clocks never matter), and the helpers that keep the invariants in one place. scripts.cc
-- makes of it and the bodies one function library (each script a function, `enter` called
-- first), or, where Redis has no Functions, puts it in front of each body (one EVAL text per
-- script, `enter(KEYS, ARGV)` between).
--
-- KEYS[1]  the cell's key prefix, bound to P by enter
-- Defines  P, now (ms of Redis time), KEYS, ARGV and the helpers the scripts call
--
-- Extent lists are text, runs of pages in object order (see RUN below). Only the holder of a
-- run's current generation can free it.

-- What one call sees, set by enter: its keys and arguments, the cell's prefix, Redis's clock
-- (now_fine keeps the microseconds as a fraction: the order of uses, P:lru, which uses a
-- millisecond apart keep), the keys named after the prefix, and what a call reads once.
local KEYS, ARGV, P, now, now_fine
local ARC_T1, ARC_T2, ARC_B1, ARC_B2, ARC
local TTL, TTL_DUE, TTL_GHOST, TTL_TRACK, TTL_TRACKED, TTL_PENDING, TTL_STATS
local node_views, quota_lens, quota_seen, cell_view, ttl_state, ttl_evicted_here, grant_keys

local function enter(keys, args)
  KEYS, ARGV = keys, args
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  now_fine = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
  if P ~= keys[1] then  -- a function library serves call after call of one cell: named once
    P = keys[1]
    ARC_T1, ARC_T2, ARC_B1, ARC_B2, ARC = P .. ':arc:t1', P .. ':arc:t2', P .. ':arc:b1', P .. ':arc:b2', P .. ':arc'
    TTL, TTL_DUE, TTL_GHOST = P .. ':ttl', P .. ':ttl:due', P .. ':ttl:ghost'
    TTL_TRACK, TTL_TRACKED, TTL_PENDING, TTL_STATS =
      P .. ':ttl:track', P .. ':ttl:tracked', P .. ':ttl:pending', P .. ':ttl:stats'
  end
  node_views, quota_lens, quota_seen, cell_view = {}, nil, {}, nil
  ttl_state, ttl_evicted_here, grant_keys = nil, 0, {}
end

-- Commands in one script cost a few microseconds each: the helpers below touch a node's
-- pages with one command per node (chunked under Lua's unpack limit), never one per page.
local CHUNK = 1000

local function call_chunked(cmd, key, items, step)
  local n = #items
  local i = 1
  while i <= n do
    local j = math.min(n, i + CHUNK * (step or 1) - 1)
    redis.call(cmd, key, unpack(items, i, j))
    i = j + 1
  end
end

local function hmget_chunked(key, fields)
  local out = {}
  for i = 1, #fields, CHUNK do
    local part = redis.call('HMGET', key, unpack(fields, i, math.min(#fields, i + CHUNK - 1)))
    for _, v in ipairs(part) do out[#out + 1] = v end
  end
  return out
end

local function live(id)
  local d = redis.call('ZSCORE', P .. ':nodes', id)
  return d ~= false and d ~= nil and tonumber(d) >= now
end

-- Whether node `id` serves under `epoch`: its record holds that epoch, it is up or draining,
-- and its heartbeat is current (the tier's scripts run for the node itself).
local function serves(id, epoch)
  local n = redis.call('HMGET', P .. ':node:' .. id, 'epoch', 'state')
  return n[1] == epoch and (n[2] == 'up' or n[2] == 'draining') and live(id)
end

-- What a script reads of a node to serve its objects, read once per run (a get, a
-- contains_prefix of many keys on few nodes): alive, state, generation floor, address, key.
-- Scripts that change a node's record read it directly, never through here.
local function node_view(id)
  local v = node_views[id]
  if v == nil then
    local n = redis.call('HMGET', P .. ':node:' .. id, 'state', 'gen_floor', 'address', 'key')
    v = {alive = live(id), state = n[1], floor = tonumber(n[2] or '0') or 0, address = n[3] or '', key = n[4] or ''}
    node_views[id] = v
  end
  return v
end

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

-- Quotas (docs/operations.md, "Quotas"): a key prefix may hold at most so many objects and
-- so many bytes of the pool (whole pages: what its objects keep from others; a replica's copy
-- counts as an object of its own). P:quotas maps a prefix to '<gen> <max objects> <max bytes>'
-- (0: no limit); P:quota:<gen> counts what is charged to it (objects, bytes, evicted, refused;
-- 'counting' until set_quota's first pass over the cell's objects is done) and
-- P:quota:<gen>:lru orders its objects for its own eviction. A key is governed by the longest
-- prefix with a quota. Its record says which quota it is charged to ('quota' = gen), so that
-- its release takes back exactly what its publish charged, whatever quotas came and went (a
-- removed quota's gen has no counters: nothing to take back).
local MAX_QUOTAS = 256
local function parse_quota(text)
  local gen, o, b = string.match(text or '', '^(%d+) (%d+) (%d+)$')
  if not gen then return nil end
  return {gen, tonumber(o), tonumber(b)}
end

-- Every quota: prefix -> {gen, max objects, max bytes} (the operator's views).
local function quotas()
  local t = {}
  local all = redis.call('HGETALL', P .. ':quotas')
  for i = 1, #all, 2 do t[all[i]] = parse_quota(all[i + 1]) end
  return t
end

-- The quota that governs `key` (the longest prefix with one) and its prefix, or nil. One
-- HMGET of the key's prefixes of the lengths quotas have (P:quota_lens: length -> how many
-- quotas), never a walk over every quota.
local function quota_lengths()
  if not quota_lens then
    quota_lens = {}
    for _, l in ipairs(redis.call('HKEYS', P .. ':quota_lens')) do quota_lens[#quota_lens + 1] = tonumber(l) end
    table.sort(quota_lens, function(a, b) return a > b end)
  end
  return quota_lens
end
local function quota_of(key)
  local seen = quota_seen[key]
  if seen then return seen[1], seen[2] end
  quota_lengths()
  local prefixes = {}
  for _, l in ipairs(quota_lens) do
    if l <= #key then prefixes[#prefixes + 1] = string.sub(key, 1, l) end
  end
  if #prefixes == 0 then return nil end
  local found = redis.call('HMGET', P .. ':quotas', unpack(prefixes))
  for i, text in ipairs(prefixes) do
    local q = found[i] and parse_quota(found[i])
    if q then
      quota_seen[key] = {q, text}
      return q, text
    end
  end
  return nil
end

-- The cell's settings, read once per call (one HMGET for the page size and the policy, which
-- a get, a put and their quotas all ask for). A script that changes them updates this view.
local function cell_settings()
  if not cell_view then
    local c = redis.call('HMGET', P .. ':cell', 'page_size', 'policy')
    cell_view = {page_size = tonumber(c[1] or '0') or 0, policy = c[2] or 'lru'}
  end
  return cell_view
end
local function page_size()
  return cell_settings().page_size
end

-- What an object of `size` bytes is charged: its whole pages.
local function charged_bytes(size)
  local ps = page_size()
  if ps <= 0 then return 0 end
  return math.ceil((tonumber(size) or 0) / ps) * ps
end
local function decimal(n)
  return string.format('%.0f', n)  -- never 1e+14
end

-- Charges object `key` of `size` bytes, last used at `last`, to quota `q` (nil: none).
-- `recorded`: its record names the quota already (publish writes it with the record).
local function quota_charge(q, key, size, last, recorded)
  if not q then return end
  local qk = P .. ':quota:' .. q[1]
  redis.call('HINCRBY', qk, 'objects', 1)
  redis.call('HINCRBY', qk, 'bytes', decimal(charged_bytes(size)))
  redis.call('ZADD', qk .. ':lru', last, key)
  if not recorded then redis.call('HSET', P .. ':obj:' .. key, 'quota', q[1]) end
end

-- Takes back what object `key` of `size` bytes was charged to quota `gen` (nil: none).
local function quota_uncharge(gen, key, size)
  if not gen then return end
  local qk = P .. ':quota:' .. gen
  if redis.call('EXISTS', qk) == 0 then return end  -- the quota was removed since
  redis.call('HINCRBY', qk, 'objects', -1)
  redis.call('HINCRBY', qk, 'bytes', decimal(-charged_bytes(size)))
  redis.call('ZREM', qk .. ':lru', key)
end

-- A pending put's pages, and a page reservation's, are charged to the quota of the key they
-- are for from their allocation until they commit, abort or their lease ends: P:quota:<gen>
-- 'reserved' (bytes), and the put's record names what it holds there ('qgen', 'qbytes'), so
-- that uncommitted pages never escape their prefix's quota.
local function quota_reserve(token, q, bytes)
  if not q or bytes <= 0 then return end
  redis.call('HINCRBY', P .. ':quota:' .. q[1], 'reserved', decimal(bytes))
  redis.call('HSET', P .. ':put:' .. token, 'qgen', q[1], 'qbytes', decimal(bytes))
end

-- Takes back `bytes` (all when nil) of what pending put `token` holds in its quota. In a cell
-- without quotas nothing is held (and a removed quota has nothing to take back). `held_now`:
-- the put's 'qgen' and 'qbytes', when the caller read them already.
function quota_unreserve(token, bytes, held_now)
  if #quota_lengths() == 0 then return end
  local pk = P .. ':put:' .. token
  local r = held_now or redis.call('HMGET', pk, 'qgen', 'qbytes')
  local held = tonumber(r[2] or '0') or 0
  if not r[1] or held <= 0 then return end
  local take = math.min(held, bytes or held)
  local qk = P .. ':quota:' .. r[1]
  if redis.call('EXISTS', qk) == 1 then redis.call('HINCRBY', qk, 'reserved', decimal(-take)) end
  if take < held then
    redis.call('HSET', pk, 'qbytes', decimal(held - take))
  else
    redis.call('HDEL', pk, 'qgen', 'qbytes')
  end
end

-- Marks `keys` (object keys, with their quota gens in `gens`) used now in their quotas' LRU.
local function quota_touch(keys, gens)
  local by = {}
  for i, key in ipairs(keys) do
    local gen = gens[i]
    if gen and gen ~= '' then
      by[gen] = by[gen] or {}
      local l = by[gen]
      l[#l + 1] = now_fine
      l[#l + 1] = key
    end
  end
  for gen, l in pairs(by) do
    if redis.call('EXISTS', P .. ':quota:' .. gen) == 1 then call_chunked('ZADD', P .. ':quota:' .. gen .. ':lru', l, 2) end
  end
end

-- The NVMe tier (docs/nvme-tier.md). A node's tier is cut into slots of one page each, handed
-- out exactly as its pool's pages are (take_pages, new_runs, free_extents), under the pseudo
-- node id <id>!ssd ('!' is in no node id): P:node:<id>!ssd (page_count, next_page, free_pages,
-- gen_floor), P:free:<id>!ssd, P:gen:<id>!ssd. So every invariant of pages holds for slots: a
-- slot is handed out once, and only the holder of its current generation frees it. An object
-- on the tier has tier = ssd, its slots in ssd_extents and no pool page (extents ''), the
-- node's own xxh3 of its bytes in ssd_sum, and sits in P:lru_ssd:<id> instead of P:lru. Only
-- an object wholly on one node moves down. A write-down in progress is 'moving' (the slots it
-- took) until 'moving_until'; a promotion queued or running is 'promoting' (until when).
local function slots_of(id)
  return id .. '!ssd'
end

-- Whether the slot runs of `list` are still the tier's current incarnation's (a node that
-- registered again started its slots over, above a new floor).
local function slots_live(list)
  for id, _, gen in runs(list) do
    local floor = tonumber(redis.call('HGET', P .. ':node:' .. id, 'gen_floor') or '') or math.huge
    return gen > floor
  end
  return false
end

-- Why objects left the cell (`kvstash explain`): P:gone:why maps a key to '<ms> <why>
-- <detail>' of its last removal (expired, evicted, removed, corrupt, node_down,
-- node_restarted, node_left, tier_lost). Bounded by generations: once it holds GONE_KEEP keys
-- it becomes P:gone:old (the generation before is unlinked, freed off Redis's thread), so the
-- record holds the last GONE_KEEP to 2 x GONE_KEEP removals whatever the churn, at two
-- commands per removal. A key put again keeps its record until explain sees it present.
local GONE_KEEP = 50000
local function record_gone(key, why, detail)
  local gk = P .. ':gone:why'
  redis.call('HSET', gk, key, now .. ' ' .. why .. ' ' .. (detail or ''))
  if redis.call('HLEN', gk) >= GONE_KEEP then
    redis.call('UNLINK', P .. ':gone:old')
    redis.call('RENAME', gk, P .. ':gone:old')
  end
end

-- KV events for cache-aware routers (docs/events.md). Off until `kvstash events` turns them on
-- (P:events: maxlen, epoch). An object a client announced (announce.lua) carries `ev`, the
-- event data its engine gave (msgpack: block hashes, parent hash, token ids, block size, LoRA
-- id), and is in P:events:objs; its stored and removed events go to the stream P:events:log,
-- capped at about maxlen entries, in the order the scripts ran. The relay (`kvstash events
-- serve`) publishes them; epoch changes whenever the stream cannot be trusted to continue what
-- the relay read (a failover), and the relay then starts over from P:events:objs.
local function events_maxlen()
  return tonumber(redis.call('HGET', P .. ':events', 'maxlen') or '')
end
-- `maxlen`: events_maxlen() when the caller has it already.
local function emit_event(kind, key, ev, why, maxlen)
  maxlen = maxlen or events_maxlen()
  if not maxlen then return end
  redis.call('XADD', P .. ':events:log', 'MAXLEN', '~', maxlen, '*', 't', kind, 'k', key, 'ev', ev, 'why', why or '')
end

-- ---- Eviction policy ----------------------------------------------------------------------
-- Which object a full pool gives up first (docs/operations.md, "Choosing an eviction policy")
-- is the cell's policy, P:cell 'policy' (kvstash policy; lru unless set):
--   lru  the least recently used object: P:lru, key -> its last use (now_fine).
--   arc  ARC (Megiddo and Modha, FAST 2003): P:arc:t1 holds the objects used once lately,
--        P:arc:t2 those used at least twice (key -> last use); P:arc:b1 and P:arc:b2 the keys
--        evicted from each (ghosts: names only, key -> when); P:arc 'p', T1's target size. A
--        new object whose key B1 remembers raises p, one B2 remembers lowers it; either enters
--        T2. An eviction takes T1's least recent object while T1 holds more than p (or T2 is
--        empty), else T2's; the ghosts are then trimmed to the objects held (T1 and B1
--        together) and twice that (all four). Objects stored before arc was chosen go first.
--   turn-ttl  kvstash's own, for KV caches' prefix chunks: each use keeps an object until a
--        time learned for its class (turn-ttl below); the object due first goes first.
-- Under each, P:lru keeps every pool object's last use, for operators (kvstash evict), quotas
-- and the NVMe tier's write-down. tools/common/replay_model.cc runs the same rules in process.
local POLICIES = {lru = true, arc = true, ['turn-ttl'] = true}

local function policy()
  return cell_settings().policy
end

-- turn-ttl. Once an object is stored nothing new is learned about it until it is used again, so
-- the best an online policy can do for a class of objects is to keep them for some time T. The
-- cell learns, per class, how many tokens each keep-time would hit and what it would cost in
-- object-seconds, from a sample of the objects' reuse gaps, and every 30 s chooses the times
-- that fill the pool with the most hits (a fractional knapsack over each class's concave hull).
-- A use's class comes with it (a hint: Store's KeepHint): the conversation's turn (1 + the turn
-- of the chunk the request's prefix ends in, or of its first missing chunk if a ghost
-- remembers it; up to 5), the prompt's length (under 16 chunks, under 48, longer), and whether
-- it is the prompt's last chunk. An unhinted use keeps for no time: among themselves, such
-- objects go as under lru.
--   P:ttl          the learned times ('k<class>', the split class 'sc', 'ss', 'sl', 'sh'), the
--                  policy's clock ('origin', real s; 'scale': policy seconds per real one, for
--                  replays that compress time), 'solved' (when, policy s), 'wbase' (weights)
--   P:ttl:due      pool object -> when it is due to go (policy s); a use never lowers it
--   P:ttl:ghost    evicted keys -> (a sequence) * 8 + their turn (at most 5), the oldest
--                  forgotten past TTL_GHOSTS per pool object
--   P:ttl:track    sampled key -> 'its last use (policy s) and class'; P:ttl:tracked the same
--                  keys by last use; P:ttl:pending reuses waiting until TTL_MAX_GAP has passed
--   P:ttl:stats    per class and keep-time bin, decayed: tokens hit, gaps, reuses; samples
-- An object's turn is its record's 'turn'.
local TTL_MAX_GAP = 900     -- s: a reuse gap counts once this old (or never)
local TTL_HALF_LIFE = 1800  -- s: weights of older samples decay (e-folding)
local TTL_SAMPLE = 8        -- one chunk in 8 is sampled (KeepHint's key hash decides)
local TTL_SOLVE_EVERY = 30  -- s
local TTL_GHOSTS = 4        -- ghosts per pool object
local TTL_CLASSES = 30
local TTL_GRID = {0}        -- the keep-times tried: 0, then 5 s growing by a quarter to TTL_MAX_GAP
do
  local g = 5
  while g <= TTL_MAX_GAP do
    TTL_GRID[#TTL_GRID + 1] = g
    g = g * 1.25
  end
end

local function ttl()
  if ttl_state == nil then
    ttl_state = {}
    local h = redis.call('HGETALL', TTL)
    for i = 1, #h, 2 do ttl_state[h[i]] = tonumber(h[i + 1]) end
  end
  return ttl_state
end

-- The policy's clock, s since it was chosen.
local function ttl_now()
  local s = ttl()
  return (now_fine / 1000 - (s.origin or 0)) * (s.scale or 1)
end

-- A use's hint: 'turn chunks index tokens sampled draw looked_up' (Catalog's keep_hint_text: the
-- last, the policy's clock when the request looked its prefix up, 0 if unknown), or nil.
local function ttl_hint(text)
  if not text or text == '' then return nil end
  local turn, chunks, index, tokens, sampled, draw, looked_up =
    string.match(text, '^(%d+) (%d+) (%d+) (%d+) ([01]) (%d+) (%S+)$')
  if not turn then return nil end
  local h = {turn = tonumber(turn), chunks = tonumber(chunks), index = tonumber(index), tokens = tonumber(tokens),
             sampled = sampled == '1', draw = tonumber(draw), looked_up = tonumber(looked_up) or 0}
  local length = h.chunks < 16 and 0 or (h.chunks < 48 and 1 or 2)
  h.class = (math.min(math.max(h.turn, 1), 5) - 1) * 6 + length * 2 + ((h.index + 1 == h.chunks) and 1 or 0)
  return h
end

local function ttl_keep(h)
  if not h then return 0 end
  local s = ttl()
  if h.class == s.sc then return (h.draw < s.sh * 65536) and s.sl or s.ss end
  return s['k' .. h.class] or 0
end

local function ttl_weight(at)
  return math.exp((at - (ttl().wbase or 0)) / TTL_HALF_LIFE)
end

-- Stats fields: '<class>:s' samples, '<class>:<bin>:h|g|r' tokens hit, gaps, reuses; those
-- changed go into `changed` (field -> true).
local function ttl_add(stats, changed, field, x)
  stats[field] = (stats[field] or 0) + x
  changed[field] = true
end

local function ttl_count(stats, changed, at, class, gap, tokens)
  local w = ttl_weight(at)
  ttl_add(stats, changed, class .. ':s', w)
  if gap < 0 then return end
  local bin = 1
  while bin <= #TTL_GRID and TTL_GRID[bin] < gap do bin = bin + 1 end
  if bin > #TTL_GRID then return end
  local f = class .. ':' .. bin .. ':'
  ttl_add(stats, changed, f .. 'h', w * tokens)
  ttl_add(stats, changed, f .. 'g', w * gap)
  ttl_add(stats, changed, f .. 'r', w)
end

local function fmt17(x) return string.format('%.17g', x) end

-- The samples older than TTL_MAX_GAP (their reuse within it known, or known not to have come)
-- into the stats; then the keep-times: per class the points (cost in object-seconds, tokens
-- hit) of each time on the grid, their upper concave hull, and the hull's segments taken by
-- slope while the budget (the sampled pool over the weighted time seen) lasts.
local function ttl_solve(t)
  local s = ttl()
  local limit = t - TTL_MAX_GAP
  local stats, changed = {}, {}
  local h = redis.call('HGETALL', TTL_STATS)
  for i = 1, #h, 2 do stats[h[i]] = tonumber(h[i + 1]) end
  local old = redis.call('ZRANGEBYSCORE', TTL_TRACKED, '-inf', '(' .. fmt17(limit))
  for _, key in ipairs(old) do
    local at, class = string.match(redis.call('HGET', TTL_TRACK, key) or '', '^(%S+) (%S+)$')
    if at then ttl_count(stats, changed, tonumber(at), class, -1, 0) end
  end
  if #old > 0 then
    call_chunked('HDEL', TTL_TRACK, old)
    call_chunked('ZREM', TTL_TRACKED, old)
  end
  local due = redis.call('ZRANGEBYSCORE', TTL_PENDING, '-inf', fmt17(limit))
  for _, item in ipairs(due) do
    local at, class, gap, tokens = string.match(item, '^(%S+) (%S+) (%S+) (%S+)')
    ttl_count(stats, changed, tonumber(at), class, tonumber(gap), tonumber(tokens))
  end
  if #due > 0 then redis.call('ZREMRANGEBYSCORE', TTL_PENDING, '-inf', fmt17(limit)) end
  -- Weights grow by e each half-life: rebased (all scaled down) before they grow large.
  if t - (s.wbase or 0) > 40 * TTL_HALF_LIFE then
    local f = math.exp(-(t - (s.wbase or 0)) / TTL_HALF_LIFE)
    for k, v in pairs(stats) do
      stats[k] = v * f
      changed[k] = true
    end
    s.wbase = t
  end
  local flat = {}
  for k in pairs(changed) do
    flat[#flat + 1] = k
    flat[#flat + 1] = fmt17(stats[k])
  end
  if #flat > 0 then call_chunked('HSET', TTL_STATS, flat, 2) end

  local keep, split = {}, nil
  if limit > 0 then
    local capacity = redis.call('ZCARD', P .. ':lru')
    local budget = capacity / TTL_SAMPLE * TTL_HALF_LIFE * (ttl_weight(limit) - ttl_weight(0))
    local segments, spent = {}, 0
    for class = 0, TTL_CLASSES - 1 do
      local samples = stats[class .. ':s']
      if samples then
        local hull, hits, gaps, reuses = {}, 0, 0, 0
        for i, g in ipairs(TTL_GRID) do
          local f = class .. ':' .. i .. ':'
          hits = hits + (stats[f .. 'h'] or 0)
          gaps = gaps + (stats[f .. 'g'] or 0)
          reuses = reuses + (stats[f .. 'r'] or 0)
          local p = {cost = gaps + (samples - reuses) * g, hits = hits, keep = g}
          if #hull == 0 or p.hits > hull[#hull].hits + 1e-12 then
            while #hull >= 2 do
              local a, b = hull[#hull - 1], hull[#hull]
              if (b.hits - a.hits) * (p.cost - a.cost) > (p.hits - a.hits) * (b.cost - a.cost) then break end
              hull[#hull] = nil
            end
            hull[#hull + 1] = p
          end
        end
        if #hull > 0 then
          spent = spent + hull[1].cost
          keep[class] = hull[1].keep
          for i = 2, #hull do
            local cost = hull[i].cost - hull[i - 1].cost
            segments[#segments + 1] = {slope = (hull[i].hits - hull[i - 1].hits) / math.max(cost, 1e-9), cost = cost,
                                       class = class, from = hull[i - 1].keep, to = hull[i].keep}
          end
        end
      end
    end
    table.sort(segments, function(a, b) return a.slope > b.slope end)
    for _, g in ipairs(segments) do
      if spent + g.cost > budget then
        split = {class = g.class, short = g.from, long = g.to, share = (budget - spent) / g.cost}
        break
      end
      spent = spent + g.cost
      keep[g.class] = g.to
    end
  end
  local fields = {'solved', fmt17(t), 'wbase', fmt17(s.wbase or 0)}
  s.solved = t
  for class = 0, TTL_CLASSES - 1 do
    local k = keep[class] or 0
    s['k' .. class] = k
    fields[#fields + 1] = 'k' .. class
    fields[#fields + 1] = fmt17(k)
  end
  s.sc, s.ss, s.sl, s.sh = -1, 0, 0, 0
  if split then s.sc, s.ss, s.sl, s.sh = split.class, split.short, split.long, split.share end
  for _, f in ipairs({'sc', 'ss', 'sl', 'sh'}) do
    fields[#fields + 1] = f
    fields[#fields + 1] = fmt17(s[f])
  end
  redis.call('HSET', TTL, unpack(fields))
end

-- `key` used now under `h` (a hint, or nil): a sampled key's reuse gap waits in P:ttl:pending,
-- and every TTL_SOLVE_EVERY the times are chosen again. Returns when it is due to go. A hinted
-- use counts from its request's lookup (not after now, nor a minute before).
local function ttl_use(key, h, t)
  if h and h.looked_up > 0 then t = math.min(t, math.max(h.looked_up, t - 60 * (ttl().scale or 1))) end
  if t - (ttl().solved or 0) >= TTL_SOLVE_EVERY then ttl_solve(t) end
  if h and h.sampled then
    local at, class = string.match(redis.call('HGET', TTL_TRACK, key) or '', '^(%S+) (%S+)$')
    if at then
      redis.call('ZADD', TTL_PENDING, at, table.concat({at, class, fmt17(t - tonumber(at)), h.tokens, key}, ' '))
    end
    redis.call('HSET', TTL_TRACK, key, fmt17(t) .. ' ' .. h.class)
    redis.call('ZADD', TTL_TRACKED, fmt17(t), key)
  end
  return t + ttl_keep(h) - 1e-6 * (h and h.index or 0)
end

-- The request's turn for a lookup that found `count` of `keys` (contains_prefix 'turn').
local function ttl_turn(keys, count)
  if count < #keys then
    local g = redis.call('ZSCORE', TTL_GHOST, keys[count + 1])
    if g then return 1 + tonumber(g) % 8 end
  end
  if count == 0 then return 1 end
  return 1 + (tonumber(redis.call('HGET', P .. ':obj:' .. keys[count], 'turn') or '0') or 0)
end

-- Evicted `key` of `turn`: remembered, the oldest ghosts forgotten past TTL_GHOSTS per pool
-- object (the one being stored counted in; this run's evictions in their order).
local function ttl_remember(key, turn)
  ttl_evicted_here = ttl_evicted_here + 1
  redis.call('ZADD', TTL_GHOST, (now * 64 + math.min(ttl_evicted_here, 63)) * 8 + math.min(tonumber(turn or '0') or 0, 5), key)
  local over = redis.call('ZCARD', TTL_GHOST) - TTL_GHOSTS * (redis.call('ZCARD', P .. ':lru') + 1)
  if over > 0 then redis.call('ZPOPMIN', TTL_GHOST, over) end
end

-- Objects ARC holds (T1 and T2), the one being stored or evicted counted in.
local function arc_capacity()
  return redis.call('ZCARD', ARC_T1) + redis.call('ZCARD', ARC_T2) + 1
end

-- `keys` (pool objects) were used now; `hints` (turn-ttl's, optional) says how, per key.
local function mark_used(keys, hints)
  if #keys == 0 then return end
  -- In their order: a step of 2^-12 ms apart (a double this size has no finer one), less than
  -- a script takes per key, so the next script's uses still come after.
  local scored = {}
  for i, key in ipairs(keys) do
    scored[#scored + 1] = now_fine + (i - 1) / 4096
    scored[#scored + 1] = key
  end
  call_chunked('ZADD', P .. ':lru', scored, 2)
  if policy() == 'arc' then
    call_chunked('ZREM', ARC_T1, keys)
    call_chunked('ZADD', ARC_T2, scored, 2)
  elseif policy() == 'turn-ttl' then
    local t, due = ttl_now(), {'GT'}
    for i, key in ipairs(keys) do
      due[#due + 1] = fmt17(ttl_use(key, ttl_hint(hints and hints[i]), t))
      due[#due + 1] = key
    end
    redis.call('ZADD', TTL_DUE, unpack(due))
  end
end

-- What the policy holds of `key` (an object about to be replaced: its new one is a use, not
-- a new object), or false: ARC, true; turn-ttl, its due time and turn.
local function policy_holds(key)
  if policy() == 'arc' then
    return redis.call('ZSCORE', ARC_T1, key) ~= false or redis.call('ZSCORE', ARC_T2, key) ~= false
  elseif policy() == 'turn-ttl' then
    local due = redis.call('ZSCORE', TTL_DUE, key)
    if not due then return false end
    return {due = tonumber(due), turn = redis.call('HGET', P .. ':obj:' .. key, 'turn')}
  end
  return false
end

-- `key` is a pool object now (a put, a promotion from the tier): a use if `replaced` (what
-- policy_holds said before) one the policy held, else new to it; `hint`: turn-ttl's.
local function mark_stored(key, replaced, hint)
  if policy() == 'turn-ttl' then
    redis.call('ZADD', P .. ':lru', now_fine, key)
    local h = ttl_hint(hint)
    local due = ttl_use(key, h, ttl_now())
    local turn = h and h.turn
    if replaced then
      due = math.max(due, replaced.due)
      turn = replaced.turn
    else
      redis.call('ZREM', TTL_GHOST, key)
    end
    redis.call('ZADD', TTL_DUE, fmt17(due), key)
    if turn then redis.call('HSET', P .. ':obj:' .. key, 'turn', turn) end
    return
  end
  if replaced or policy() ~= 'arc' then return mark_used({key}) end
  redis.call('ZADD', P .. ':lru', now_fine, key)
  local in_b1 = redis.call('ZREM', ARC_B1, key) == 1
  local in_b2 = not in_b1 and redis.call('ZREM', ARC_B2, key) == 1
  if in_b1 or in_b2 then
    -- The ghosts' sizes before the key left its own.
    local b1 = redis.call('ZCARD', ARC_B1) + (in_b1 and 1 or 0)
    local b2 = redis.call('ZCARD', ARC_B2) + (in_b2 and 1 or 0)
    local p = tonumber(redis.call('HGET', ARC, 'p') or '0') or 0
    if in_b1 then
      p = math.min(arc_capacity(), p + math.max(1, b2 / b1))
    else
      p = math.max(0, p - math.max(1, b1 / b2))
    end
    redis.call('HSET', ARC, 'p', tostring(p))
  end
  redis.call('ZADD', (in_b1 or in_b2) and ARC_T2 or ARC_T1, now_fine, key)
end

-- `key` leaves the pool (released, or moved down to the tier); `evicted`: to make room, which
-- ARC's and turn-ttl's ghosts remember (`turn`: the object's, for turn-ttl).
local function mark_gone(key, evicted, turn)
  redis.call('ZREM', P .. ':lru', key)
  if policy() == 'turn-ttl' then
    if redis.call('ZREM', TTL_DUE, key) == 1 and evicted then ttl_remember(key, turn) end
    return
  end
  if policy() ~= 'arc' then return end
  local ghost
  if redis.call('ZREM', ARC_T1, key) == 1 then
    ghost = ARC_B1
  elseif redis.call('ZREM', ARC_T2, key) == 1 then
    ghost = ARC_B2
  end
  if not (evicted and ghost) then return end
  redis.call('ZADD', ghost, now_fine, key)
  local c = arc_capacity()
  local t1, b1, b2 = redis.call('ZCARD', ARC_T1), redis.call('ZCARD', ARC_B1), redis.call('ZCARD', ARC_B2)
  if t1 + b1 > c then redis.call('ZPOPMIN', ARC_B1, t1 + b1 - c) end
  b1 = math.min(b1, math.max(0, c - t1))
  if c - 1 + b1 + b2 > 2 * c then redis.call('ZPOPMIN', ARC_B2, c - 1 + b1 + b2 - 2 * c) end
end

-- Drops an object from every index. Its pages return to the pool, or wait as a zombie until
-- the last read lease on them ends; its slots on the tier (and a write-down's) return at once:
-- only the node's own tier thread writes slots, and a promotion reading a slot freed meanwhile
-- fails its sum (src/node/tier.h). `why` and `detail`: why it leaves, for record_gone (none:
-- a new object replaces it). Returns the pages freed now.
local function release(key, why, detail)
  local ok = P .. ':obj:' .. key
  local o =
    redis.call('HMGET', ok, 'token', 'extents', 'nodes', 'size', 'quota', 'ssd_extents', 'moving', 'ev', 'turn')
  redis.call('DEL', ok)
  if why and o[1] then record_gone(key, why, detail) end
  if o[8] then
    redis.call('SREM', P .. ':events:objs', key)
    emit_event('removed', key, o[8], why or 'replaced')
  end
  quota_uncharge(o[5], key, o[4])
  if o[6] or o[7] then
    free_extents(o[6])
    free_extents(o[7])
    for id in string.gmatch(o[3] or '', '[^ ]+') do
      redis.call('ZREM', P .. ':lru_ssd:' .. id, key)
      redis.call('SREM', P .. ':tier_objs:' .. id, key)
    end
  end
  -- Sizes stay decimal strings: Lua would print a number of 15 digits or more as 1e+14.
  if o[1] and (tonumber(o[4] or '0') or 0) > 0 then redis.call('HINCRBY', P .. ':stats', 'bytes', '-' .. o[4]) end
  mark_gone(key, why == 'evicted', o[9])
  redis.call('ZREM', P .. ':expiry', key)
  for id in string.gmatch(o[3] or '', '[^ ]+') do redis.call('SREM', P .. ':objs:' .. id, key) end
  if not o[1] then return 0 end
  local rk = P .. ':readers:' .. o[1]
  local last = redis.call('ZREVRANGEBYSCORE', rk, '+inf', now, 'WITHSCORES', 'LIMIT', 0, 1)
  if last[2] then
    redis.call('SET', P .. ':zombie:' .. o[1], o[2] or '')
    redis.call('ZADD', P .. ':zombies', last[2], o[1])
    return 0
  end
  redis.call('DEL', rk)
  return free_extents(o[2])
end

-- Whether the pages an object names on its nodes are still there: every node alive and
-- serving (not leaving the cell), and still the incarnation that allocated them (a node that
-- registered again started its generations above every earlier one, so one extent per node
-- tells).
local function on_live_pages(extents, nodes)
  local floors, left = {}, 0
  for id in string.gmatch(nodes or '', '[^ ]+') do
    local v = node_view(id)
    if not v.alive or (v.state ~= 'up' and v.state ~= 'draining') then return false end
    if not floors[id] then
      floors[id] = v.floor
      left = left + 1
    end
  end
  for id, _, gen in runs(extents) do
    if left == 0 then break end
    local floor = floors[id]
    if floor then
      if gen <= floor then return false end
      floors[id] = nil
      left = left - 1
    end
  end
  return true
end

-- The fields of a readable object (present, unexpired, its pages on live nodes), or nil. An
-- expired object or one on a dead or restarted node is released on the spot.
local FIELDS = {'token', 'size', 'extents', 'checksum', 'layout', 'nodes', 'expires', 'copies', 'quota', 'tier',
                'ssd_extents'}
-- Why the pages of an object on `nodes` are no longer readable (on_live_pages said so): a
-- node past its heartbeat, one leaving the cell, or one that registered again since (a
-- restart, a pause past its deadline, a failover's fence).
local function why_unreadable(nodes)
  for id in string.gmatch(nodes or '', '[^ ]+') do
    local v = node_view(id)
    if not v.alive then return 'node_down', id end
    if v.state ~= 'up' and v.state ~= 'draining' then return 'node_left', id end
  end
  return 'node_restarted', (string.match(nodes or '', '[^ ]+') or '')
end

local function lookup(key)
  local o = redis.call('HMGET', P .. ':obj:' .. key, unpack(FIELDS))
  if not o[1] then return nil end
  local exp = tonumber(o[7] or '0') or 0
  local expired = exp > 0 and exp <= now
  if o[10] == 'ssd' then
    -- On a tier: gone with the tier (another device, or the node forgotten), or expired; while
    -- its node is down or restarting, unreadable but kept: the node finds its tier again.
    if expired or not slots_live(o[11]) then
      release(key, expired and 'expired' or 'tier_lost', expired and '' or o[6])
      return nil
    end
    if not on_live_pages('', o[6]) then return nil end
    return o
  end
  if expired then
    release(key, 'expired')
    return nil
  end
  if not on_live_pages(o[3], o[6]) then
    release(key, why_unreadable(o[6]))
    return nil
  end
  return o
end

-- Hands the objects of set `ok` to the sweep (the set becomes a sweep batch in O(1)): they are
-- unreadable already, and reclaim releases them in bounded batches, so no script walks a
-- million objects at once. Returns how many objects that was.
local function to_sweep(ok)
  local n = redis.call('SCARD', ok)
  if n > 0 then
    local batch = P .. ':sweep:' .. redis.call('INCR', P .. ':sweep_seq')
    redis.call('RENAME', ok, batch)
    redis.call('RPUSH', P .. ':sweep', batch)
  end
  return n
end

-- Hands node `id`'s pool objects to the sweep (the node is gone or registered again, which
-- lookup sees).
local function sweep_node_objects(id)
  return to_sweep(P .. ':objs:' .. id)
end

-- Starts node `id`'s NVMe tier over: its slots above a new floor (every object on it
-- unreadable at once), its free list and generations gone, its objects (P:tier_objs:<id>) handed
-- to the sweep. For a node whose device is not the tier the cell knew, or that is forgotten.
-- Returns how many objects that was.
local function sweep_tier_objects(id)
  local sk = P .. ':node:' .. slots_of(id)
  local floor = (redis.call('HINCRBY', sk, 'epochs', 1) - 1) * 4294967296
  redis.call('DEL', P .. ':free:' .. slots_of(id), P .. ':gen:' .. slots_of(id), P .. ':promote:' .. id)
  redis.call('HSET', sk, 'next_page', 0, 'free_pages', 0, 'gen_floor', floor)
  return to_sweep(P .. ':tier_objs:' .. id)
end

-- Releases up to `limit` objects from the sweep batches (each through lookup, which releases
-- only what is unreadable: a key written again since keeps its new object). Returns how many
-- keys were looked at.
local function sweep(limit)
  local done = 0
  while done < limit do
    local batch = redis.call('LINDEX', P .. ':sweep', 0)
    if not batch then break end
    local keys = redis.call('SPOP', batch, limit - done)
    for _, key in ipairs(keys) do lookup(key) end
    done = done + #keys
    if redis.call('EXISTS', batch) == 0 then redis.call('LPOP', P .. ':sweep') end
  end
  return done
end

local function present(key)
  return lookup(key) ~= nil
end

-- Replicas (PutOptions::replicas). Copy i > 0 of `key` is the object key .. '\31' .. i: an
-- object of its own (its pages on other nodes, its lease, generations, eviction and expiry).
-- A put of n copies commits copies 1..n-1 first and `key` itself last; that record says
-- `copies` = n, and its commit releases any copy numbered n or more (an earlier put's), so no
-- copy outlives the object that replaced it.
local MAX_COPIES = 4
local function copy_key(key, i)
  if i == 0 then return key end
  return key .. '\31' .. i
end
local function is_copy(key)
  return string.find(key, '\31', 1, true) ~= nil
end
local function release_copies(key, from)
  local keys = {}
  for i = math.max(from, 1), MAX_COPIES - 1 do keys[#keys + 1] = P .. ':obj:' .. copy_key(key, i) end
  if #keys == 0 or redis.call('EXISTS', unpack(keys)) == 0 then return end  -- one command, mostly
  for i = math.max(from, 1), MAX_COPIES - 1 do
    local ck = copy_key(key, i)
    if redis.call('EXISTS', P .. ':obj:' .. ck) == 1 then release(ck) end
  end
end

-- The readable copy of `key` with the fewest read leases (the object itself on a tie): its
-- fields and its key, or nil. Only `key` when its record names no other copy; every copy
-- number when `key` itself is gone (its node died: the copies still serve).
local function lookup_copy(key)
  local best, best_key = lookup(key), key
  local n = MAX_COPIES
  if best then n = tonumber(best[8] or '1') or 1 end
  if n <= 1 then return best, best_key end
  local best_readers = nil
  if best then best_readers = redis.call('ZCARD', P .. ':readers:' .. best[1]) end
  for i = 1, n - 1 do
    local ck = copy_key(key, i)
    local o = lookup(ck)
    if o then
      local r = redis.call('ZCARD', P .. ':readers:' .. o[1])
      if not best or r < best_readers then best, best_key, best_readers = o, ck, r end
    end
  end
  return best, best_key
end

-- `key` and the copies of it that are readable.
local function present_copies(key)
  local keys = {}
  for i = 0, MAX_COPIES - 1 do
    local ck = copy_key(key, i)
    if present(ck) then keys[#keys + 1] = ck end
  end
  return keys
end

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

-- Releases expired objects, oldest deadline first, at most `limit`.
local function sweep_expired(limit)
  local keys = redis.call('ZRANGEBYSCORE', P .. ':expiry', '-inf', now, 'LIMIT', 0, limit)
  for _, key in ipairs(keys) do release(key, 'expired') end
  if #keys > 0 then redis.call('HINCRBY', P .. ':stats', 'expired', #keys) end
  return #keys
end

-- Walks the LRU order, least recently used first, calling visit(key, last_access, extents,
-- size) for each object no reader leases: leased objects are never evicted. visit returns true
-- to stop. At most `max_visits` LRU entries are looked at, so the work is bounded by what
-- the caller needs, never by the cell's size. Returns the LRU entries whose record is gone
-- (deleted by hand). `lru`: another LRU order to walk (a quota's), instead of the cell's.
-- The record of `key` (token, extents, size) for an eviction's walk: nil when a reader leases
-- it, false when the record is gone (an order's entry left behind: deleted by hand).
local function unleased_record(key)
  local o = redis.call('HMGET', P .. ':obj:' .. key, 'token', 'extents', 'size')
  if not o[1] then return false end
  if redis.call('ZCOUNT', P .. ':readers:' .. o[1], now, '+inf') == 0 then return o end
  return nil
end

local function walk_unleased_lru(visit, max_visits, lru)
  local orphans, offset = {}, 0
  while offset < max_visits do
    local batch = redis.call('ZRANGE', lru or (P .. ':lru'), offset, math.min(offset + 63, max_visits - 1), 'WITHSCORES')
    if #batch == 0 then return orphans end
    offset = offset + #batch / 2
    for i = 1, #batch, 2 do
      local key = batch[i]
      local o = unleased_record(key)
      if o == false then
        orphans[#orphans + 1] = key
      elseif o and visit(key, tonumber(batch[i + 1]), o[2], o[3]) then
        return orphans
      end
    end
  end
  return orphans
end

-- Releases `victims` as evicted (counted in P:stats), `pressure` saying what made room
-- necessary (record_gone). Returns the pages freed now.
local function evict_keys(victims, pressure)
  local freed = 0
  for _, key in ipairs(victims) do freed = freed + release(key, 'evicted', pressure) end
  if #victims > 0 then redis.call('HINCRBY', P .. ':stats', 'evicted', #victims) end
  return freed
end

-- Walks the objects a policy chosen since they were stored does not hold (`holds(key)` false),
-- least recent first, as walk_unleased_lru does; they go first. Looks at most 256 (or
-- `max_visits`) entries. Returns the entries whose record is gone, whether visit stopped, and
-- the entries looked at.
local function walk_unadopted(visit, max_visits, holds)
  local visits, stop = 0, false
  local orphans = walk_unleased_lru(function(key, last, extents, size)
    visits = visits + 1
    if holds(key) then return visits >= 256 end
    stop = visit(key, last, extents, size)
    return stop or visits >= 256
  end, math.min(max_visits, 256))
  return orphans, stop, visits
end

-- Walks ARC's order of eviction as walk_unleased_lru walks LRU's: objects stored before arc
-- was chosen first (least recent first), then each time T1's least recent object while T1 holds
-- more than p (or T2 has none left), else T2's. Returns the entries whose record is gone, per
-- list.
local function walk_unleased_arc(visit, max_visits)
  local orphans = {}
  local visits = 0
  local held1, held2 = redis.call('ZCARD', ARC_T1), redis.call('ZCARD', ARC_T2)
  if redis.call('ZCARD', P .. ':lru') > held1 + held2 then
    local stop
    orphans[P .. ':lru'], stop, visits = walk_unadopted(visit, max_visits, function(key)
      return redis.call('ZSCORE', ARC_T1, key) or redis.call('ZSCORE', ARC_T2, key)
    end)
    if stop then return orphans end
  end
  local p = tonumber(redis.call('HGET', ARC, 'p') or '0') or 0
  local lists = {{key = ARC_T1, held = held1, at = 0, orphans = {}}, {key = ARC_T2, held = held2, at = 0, orphans = {}}}
  orphans[ARC_T1], orphans[ARC_T2] = lists[1].orphans, lists[2].orphans
  while visits < max_visits do
    local l = lists[2]
    if lists[1].held > 0 and (lists[1].held > p or lists[2].held <= 0) then l = lists[1] end
    if l.held <= 0 then return orphans end
    local e = redis.call('ZRANGE', l.key, l.at, l.at, 'WITHSCORES')
    if #e == 0 then
      l.held = 0  -- the rest of this list is leased
    else
      l.at = l.at + 1
      visits = visits + 1
      local key = e[1]
      local o = unleased_record(key)
      if o ~= nil then l.held = l.held - 1 end  -- gone, or visited: T1's share counts it out
      if o == false then
        l.orphans[#l.orphans + 1] = key
      elseif o and visit(key, tonumber(e[2]), o[2], o[3]) then
        return orphans
      end
    end
  end
  return orphans
end

-- Walks turn-ttl's order of eviction: objects stored before it was chosen first, then the
-- object due first.
local function walk_unleased_ttl(visit, max_visits)
  local orphans, stop, visits = {}, false, 0
  if redis.call('ZCARD', P .. ':lru') > redis.call('ZCARD', TTL_DUE) then
    orphans[P .. ':lru'], stop, visits = walk_unadopted(visit, max_visits, function(key)
      return redis.call('ZSCORE', TTL_DUE, key)
    end)
    if stop then return orphans end
  end
  orphans[TTL_DUE] = walk_unleased_lru(function(key, _, extents, size)
    return visit(key, nil, extents, size)
  end, max_visits - visits, TTL_DUE)
  return orphans
end

-- Walks the cell's policy's order of eviction (walk_unleased_lru's visit and bound); returns
-- the entries whose record is gone, per list.
local function walk_victims(visit, max_visits)
  if policy() == 'arc' then return walk_unleased_arc(visit, max_visits) end
  if policy() == 'turn-ttl' then return walk_unleased_ttl(visit, max_visits) end
  return {[P .. ':lru'] = walk_unleased_lru(visit, max_visits)}
end

-- Evicts objects that no reader leases, in the order of the cell's policy, until `need` pages
-- came free on the nodes in `usable` (id -> true: those that take allocations; pages on a
-- draining or dead node free nothing a put can use). All or nothing: when the unleased objects
-- cannot free enough, nothing is evicted (a put that fails anyway must not empty the cache).
-- Looks at most `need` + 256 objects: leased ones in front are skipped, a longer search fails.
-- Returns objects evicted and pages freed.
local function evict(need, usable)
  if need <= 0 then return 0, 0 end
  local victims, pages = {}, 0
  local orphans = walk_victims(function(key, _, extents)
    local n = 0
    for id, _, _, count in runs(extents) do
      if usable[id] then n = n + count end
    end
    if n > 0 then
      victims[#victims + 1] = key
      pages = pages + n
    end
    return pages >= need
  end, need + 256)
  for list, keys in pairs(orphans) do
    if #keys > 0 then call_chunked('ZREM', list, keys) end
  end
  if pages < need then return 0, 0 end
  return #victims, evict_keys(victims, 'the pool was full: a put needed ' .. need .. (need == 1 and ' page' or ' pages'))
end

-- Makes room under the quota of `key` for its next object, of `size` bytes, which replaces
-- the one `key` holds now (its pending puts' and reservations' pages count as held:
-- quota_reserve): evicts the quota's least recently used objects that no reader
-- leases (never `key` or its copies) until the quota holds it. All or nothing, as evict, unless
-- the quota is over its limits already (lowered since): then what the search found goes
-- anyway, so that the prefix comes down to its quota over the next puts. Looks at most 1,024
-- objects. Returns nil when it fits (or no quota governs `key`), else the refusal's text.
-- `old`: the quota and size `key`'s record holds now, when the caller read them already.
local function quota_fit(key, size, old)
  local q, prefix = quota_of(key)
  if not q or (q[2] == 0 and q[3] == 0) then return nil end
  local qk = P .. ':quota:' .. q[1]
  local use = redis.call('HMGET', qk, 'objects', 'bytes', 'reserved')
  local objects = tonumber(use[1] or '0') or 0
  local bytes = (tonumber(use[2] or '0') or 0) + math.max(0, tonumber(use[3] or '0') or 0)
  old = old or redis.call('HMGET', P .. ':obj:' .. key, 'quota', 'size')
  if old[1] == q[1] then objects, bytes = objects - 1, bytes - charged_bytes(old[2]) end
  local add = charged_bytes(size)
  local over = (q[2] > 0 and objects > q[2]) or (q[3] > 0 and bytes > q[3])
  local function fits() return (q[2] == 0 or objects + 1 <= q[2]) and (q[3] == 0 or bytes + add <= q[3]) end
  if fits() then return nil end
  local refusal = 'NO_SPACE quota of prefix ' .. prefix .. ' ('
  if q[3] > 0 and add > q[3] then
    redis.call('HINCRBY', qk, 'refused', 1)
    return refusal .. decimal(q[3]) .. ' bytes) is smaller than this object (' .. decimal(add) .. ' bytes in pages)'
  end
  local victims = {}
  local orphans = walk_unleased_lru(function(victim, _, _, vsize)
    if victim == key or string.sub(victim, 1, #key + 1) == key .. '\31' then return false end
    victims[#victims + 1] = victim
    objects, bytes = objects - 1, bytes - charged_bytes(vsize)
    return fits()
  end, 1024, qk .. ':lru')
  if #orphans > 0 then call_chunked('ZREM', qk .. ':lru', orphans) end
  if fits() or over then
    evict_keys(victims, 'the quota of prefix ' .. prefix .. ' was full')
    redis.call('HINCRBY', qk, 'evicted', #victims)
  end
  if fits() then return nil end
  redis.call('HINCRBY', qk, 'refused', 1)
  return 'NO_SPACE for now: quota of prefix ' .. prefix .. ' (' .. decimal(q[2]) .. ' objects, ' .. decimal(q[3]) ..
         ' bytes; 0: no limit) is full, and its objects that no reader leases cannot make room'
end

-- Grants (docs/operations.md, "Threat model"): a memory node serves a lease only under a
-- grant the cell signed for it. Each node hands the cell a fresh HMAC key whenever it
-- registers, and the next one every rotation period (heartbeat); the cell keeps the key's pads
-- in P:grant:<id> (a key of its own, so an ACL can keep read-only users away from it). A grant names the node, its epoch, the op, the
-- lease's deadline (its fence tag at the node) and the node's pages the lease may reach, and
-- is signed with HMAC-SHA1, the one hash scripts have (src/common/grant.h reads it).

-- The longest lease the cell grants (ms): every lease a script takes, and so every grant's
-- deadline, lies within it of Redis's clock; a memory node refuses a grant whose deadline lies
-- further past its idea of that clock (grant::kMaxLease, the same figure).
local MAX_LEASE_MS = 600000

-- ARGV text as a lease's length (ms), or nil and the INVALID error: a whole number of 1 to
-- MAX_LEASE_MS.
local function lease_ms_of(text)
  local ms = tonumber(text)
  if not ms or ms < 1 or ms > MAX_LEASE_MS or ms ~= math.floor(ms) then
    return nil, redis.error_reply('INVALID a lease lasts 1 to ' .. MAX_LEASE_MS .. ' ms, not ' .. tostring(text))
  end
  return ms
end

local function unhex(h)
  return (string.gsub(h, '%x%x', function(x) return string.char(tonumber(x, 16)) end))
end

-- Keep node `id`'s grant key (hex) as the one the cell signs with, named `word` in grants
-- (the epoch at registration, `<epoch>/<generation>` for the keys a heartbeat hands over): its
-- HMAC pads, so that a grant costs two SHA1s (keys of up to 64 bytes, as HMAC pads them). No
-- key, no grants.
local function keep_grant_key(id, key_hex, word)
  local gk = P .. ':grant:' .. id
  local key = unhex(key_hex)
  if #key == 0 or #key > 64 then
    redis.call('DEL', gk)
    return
  end
  local ipad, opad = {}, {}
  for i = 1, 64 do
    local b = string.byte(key, i) or 0
    ipad[i] = string.char(bit.bxor(b, 0x36))
    opad[i] = string.char(bit.bxor(b, 0x5c))
  end
  redis.call('HSET', gk, 'ipad', table.concat(ipad), 'opad', table.concat(opad), 'epoch', word)
end

-- The grant of `op` ('r' or 'w') over `runs` ("first+count,...", or '*' for the whole pool)
-- of node `id` until `deadline`; '' for a node that registered no key.
local function grant_for(id, op, deadline, runs_text)
  local g = grant_keys[id]
  if g == nil then
    local r = redis.call('HMGET', P .. ':grant:' .. id, 'ipad', 'opad', 'epoch')
    g = {ipad = r[1], opad = r[2], epoch = r[3]}
    grant_keys[id] = g
  end
  if not g.ipad or not g.opad or not g.epoch or runs_text == '' then return '' end
  local msg = 'g1 ' .. id .. ' ' .. g.epoch .. ' ' .. op .. ' ' .. string.format('%.0f', deadline) .. ' ' .. runs_text
  return msg .. ' ' .. redis.sha1hex(g.opad .. unhex(redis.sha1hex(g.ipad .. msg)))
end

-- The endpoints of nodes (space-separated ids) appended to `out`: id, address, key, and the
-- grant of `op` over the node's pages of `extents` until `deadline`.
local function endpoints(out, nodes, op, extents, deadline)
  local pages = {}
  for id, page, _, n in runs(extents) do
    local t = pages[id]
    if not t then
      t = {}
      pages[id] = t
    end
    t[#t + 1] = string.format('%d+%d', page, n)
  end
  for id in string.gmatch(nodes or '', '[^ ]+') do
    local v = node_view(id)
    out[#out + 1] = id
    out[#out + 1] = v.address
    out[#out + 1] = v.key
    out[#out + 1] = grant_for(id, op, deadline, table.concat(pages[id] or {}, ','))
  end
  return out
end

-- What a run's leases leave for lease_reads_done: hits, misses and LRU touches, so that many
-- leases cost one command of each.
local function new_read_batch()
  return {hits = 0, misses = 0, tier = 0, lru = {}, hints = {}, qkeys = {}, qgens = {}}
end

-- How long a queued promotion keeps others from queueing it again (a node that lost the job
-- in a crash: the next get after this queues it afresh).
local PROMOTE_MS = 5000
-- At most this many promotions wait per node (the oldest go; their gets queue them again).
local PROMOTE_QUEUE = 4096

-- Wakes the gets waiting for the promotion of `key` (object token `token`) to end, however it
-- ended: they ask again. At most 64 items; a waiter not woken asks again after its wait.
local function wake_waiters(key, token)
  local ok = P .. ':obj:' .. key
  local n = math.min(tonumber(redis.call('HGET', ok, 'waiters') or '0') or 0, 64)
  if n <= 0 then return end
  redis.call('HDEL', ok, 'waiters')
  local wk = P .. ':woken:' .. token
  local items = {}
  for i = 1, n do items[i] = '1' end
  redis.call('LPUSH', wk, unpack(items))
  redis.call('PEXPIRE', wk, 10000)
end

-- Queues the promotion of `key`, on the tier of node `id`, unless one is queued or running.
-- Returns whether it queued one now.
local function queue_promotion(key, id)
  local ok = P .. ':obj:' .. key
  if (tonumber(redis.call('HGET', ok, 'promoting') or '0') or 0) >= now then return false end
  redis.call('HSET', ok, 'promoting', now + PROMOTE_MS)
  local qk = P .. ':promote:' .. id
  redis.call('LPUSH', qk, key)
  redis.call('LTRIM', qk, 0, PROMOTE_QUEUE - 1)
  return true
end

-- Looks `key` up and leases its readable copy for `reader` until now + `lease_ms`: the reply
-- of begin_get, or nil when there is none (and, for an object on a tier that `no_promote`
-- leaves there, why). Its hit or miss and LRU touch (with `hint`, turn-ttl's) go into `batch`.
local function lease_read(key, reader, lease_ms, batch, no_promote, hint)
  local o, leased = lookup_copy(key)
  if not o then
    batch.misses = batch.misses + 1
    return nil
  end
  if o[10] == 'ssd' then
    -- On the tier: the node stages it back into pool pages (one more round trip for the get,
    -- which asks again), or, with no_promote, a miss that says where it is.
    if no_promote then
      batch.tier = batch.tier + 1
      return nil, 'ON_SSD ' .. o[6]
    end
    if queue_promotion(leased, o[6]) then batch.tier = batch.tier + 1 end
    -- The get waits on P:woken:<token> (BLPOP), where the promotion's end pushes one item per
    -- waiter (wake_waiters).
    redis.call('HINCRBY', P .. ':obj:' .. leased, 'waiters', 1)
    return {'PROMOTING', o[6], o[1]}
  end
  local deadline = now + lease_ms
  redis.call('ZADD', P .. ':readers:' .. o[1], deadline, reader)
  batch.hits = batch.hits + 1
  batch.lru[#batch.lru + 1] = leased
  batch.hints[#batch.lru] = hint
  if o[9] then
    batch.qkeys[#batch.qkeys + 1] = leased
    batch.qgens[#batch.qkeys] = o[9]
  end
  return endpoints({page_size(), o[1], o[2] or '', o[3] or '', o[4] or '', o[5] or '', deadline}, o[6], 'r', o[3],
                   deadline)
end

local function lease_reads_done(batch)
  if batch.hits > 0 then redis.call('HINCRBY', P .. ':stats', 'hits', batch.hits) end
  if batch.misses > 0 then redis.call('HINCRBY', P .. ':stats', 'misses', batch.misses) end
  if batch.tier > 0 then redis.call('HINCRBY', P .. ':stats', 'tier_hits', batch.tier) end
  mark_used(batch.lru, batch.hints)
  quota_touch(batch.qkeys, batch.qgens)
end

-- The node ids of an extent list, space-separated, in order of first appearance.
local function nodes_of(extents)
  local _, order = by_node(extents)
  return table.concat(order, ' ')
end

-- Why a commit's condition fails ('' none; '!' only if `key` holds no object; '=<token>'
-- only if it holds the object that put wrote), or nil when it holds.
local function condition_fails(key, cond)
  if (cond or '') == '' then return nil end
  local cur = redis.call('HGET', P .. ':obj:' .. key, 'token')
  if (cond == '!' and cur) or (cond ~= '!' and '=' .. (cur or '') ~= cond) then
    return 'STALE ' .. key .. ' changed since the version this put was based on'
  end
  return nil
end

-- Makes `key` the object put `token` wrote into `extents` on `nodes`, releasing the object it
-- replaces; a ttl_ms of 0 never expires. `copies` (an object, not a copy): how many copies its
-- put wrote; copies numbered that or more are released. `hint`: turn-ttl's (mark_stored).
local function publish(key, token, size, extents, nodes, checksum, layout, ttl_ms, copies, hint, exists)
  local ok = P .. ':obj:' .. key
  local replaced = false
  if exists == nil then exists = redis.call('EXISTS', ok) == 1 end
  if exists then
    replaced = policy_holds(key)
    release(key)
  end
  local expires = 0
  if ttl_ms > 0 then expires = now + ttl_ms end
  local fields = {'size', size, 'token', token, 'extents', extents, 'nodes', nodes, 'checksum', checksum,
                  'layout', layout, 'created', now, 'expires', expires}
  local q = quota_of(key)
  if q then
    fields[#fields + 1] = 'quota'
    fields[#fields + 1] = q[1]
  end
  redis.call('HSET', ok, unpack(fields))
  for id in string.gmatch(nodes, '[^ ]+') do redis.call('SADD', P .. ':objs:' .. id, key) end
  if not is_copy(key) then
    copies = math.min(math.max(tonumber(copies or '1') or 1, 1), MAX_COPIES)
    if copies > 1 then redis.call('HSET', ok, 'copies', copies) end
    release_copies(key, copies)
  end
  if (tonumber(size) or 0) > 0 then redis.call('HINCRBY', P .. ':stats', 'bytes', size) end
  mark_stored(key, replaced, hint)
  quota_charge(q, key, size, now_fine, true)
  if expires > 0 then redis.call('ZADD', P .. ':expiry', expires, key) end
end

-- Page reservations. P:put:<res>:pages lists the runs a reservation was given, in order: its
-- page i (what its puts name by position) is the i-th page of that list. Its record's
-- 'extents' are the runs it still holds.
--
-- Takes the reservation's pages [first, first + count) out of what it holds: each stretch of
-- them becomes a run with a generation of its own, and what the reservation keeps around it
-- too (a run is never partly freed). Returns the stretches' extents (in reservation order) and
-- how many of those pages it no longer held. With `all` (a commit), nothing changes unless
-- every page is held and on a node alive and serving: then it returns nil and why ('INVALID
-- ...' for pages past the reservation's end, 'STALE ...' for pages it lost). `rec`: the
-- reservation's 'ends' and 'extents', when the caller read them already.
local function carve(res, first, count, all, rec)
  local pk = P .. ':put:' .. res
  -- Pages from 'ends' on went back (release_reservation): past the reservation's end now.
  rec = rec or redis.call('HMGET', pk, 'ends', 'extents')
  local ends = tonumber(rec[1] or '') or math.huge
  local want, off = {}, 0
  for _, e in ipairs(redis.call('LRANGE', pk .. ':pages', 0, -1)) do
    for id, page, _, n in runs(e) do
      n = math.max(0, math.min(n, ends - off))
      local lo, hi = math.max(first, off), math.min(first + count, off + n)
      if lo < hi then want[#want + 1] = {id, page + lo - off, hi - lo} end
      off = off + n
    end
    if off >= first + count then break end
  end
  if all and count > 0 and off < first + count then return nil, 'INVALID the reservation holds no pages ' .. first .. '+' .. count end
  local held = {}
  each_run_state(rec[2], function(id, g, i, cur)
    if cur then held[#held + 1] = {id, g.pages[i], g.gens[i], g.counts[i]} end
  end)
  if all then
    for _, w in ipairs(want) do
      local v = node_view(w[1])
      if not v.alive or (v.state ~= 'up' and v.state ~= 'draining') then
        return nil, 'STALE a memory node of the put died, restarted or began leaving before the commit'
      end
    end
  end
  local missing, cut, renew = math.max(0, first + count - math.max(off, first)), {}, {}
  -- Each node's held runs by first page (disjoint, so their ends ascend too): a stretch finds
  -- the runs it cuts by binary search, and the work grows as runs * log(runs), never as
  -- stretches * runs (a put of 4,096 scattered pages took Redis 2 s that way).
  local by = {}
  for _, h in ipairs(held) do
    local l = by[h[1]]
    if not l then
      l = {}
      by[h[1]] = l
    end
    l[#l + 1] = h
  end
  for _, l in pairs(by) do table.sort(l, function(x, y) return x[2] < y[2] end) end
  for _, w in ipairs(want) do
    local id, a, k = w[1], w[2], w[3]
    local got, l = {}, by[id] or {}
    local i, j = 1, #l + 1
    while i < j do  -- the first run that ends past a
      local mid = math.floor((i + j) / 2)
      if l[mid][2] + l[mid][4] <= a then i = mid + 1 else j = mid end
    end
    while i <= #l and l[i][2] < a + k do
      local h = l[i]
      local lo, hi = math.max(a, h[2]), math.min(a + k, h[2] + h[4])
      if not h.gone and lo < hi then
        -- What precedes the stretch stays held as it is; what follows it gets a generation of
        -- its own (renew); the stretch itself is the put's.
        if hi < h[2] + h[4] then renew[#renew + 1] = {id, hi, h[2] + h[4] - hi} end
        got[#got + 1] = {lo, hi - lo}
        if lo > h[2] then h[4] = lo - h[2] else h.gone = true end
      end
      i = i + 1
    end
    table.sort(got, function(x, y) return x[1] < y[1] end)
    local n = 0
    for _, span in ipairs(got) do
      local last = cut[#cut]
      if last and last[1] == id and last[2] + last[3] == span[1] then
        last[3] = last[3] + span[2]
      else
        cut[#cut + 1] = {id, span[1], span[2]}
      end
      n = n + span[2]
    end
    missing = missing + k - n
  end
  if all and missing > 0 then
    return nil, 'STALE the reservation no longer holds pages ' .. first .. '+' .. count ..
                ' (reclaimed after its lease, or aborted)'
  end
  -- The new runs, one generation read and write per node: the stretches cut, then what the
  -- reservation keeps after them.
  local made, spans, at = {}, {}, {}
  for i, s in ipairs(cut) do made[i] = s end
  for _, s in ipairs(renew) do made[#made + 1] = s end
  for i, s in ipairs(made) do
    if not spans[s[1]] then spans[s[1]], at[s[1]] = {}, {} end
    spans[s[1]][#spans[s[1]] + 1] = {s[2], s[3]}
    at[s[1]][#at[s[1]] + 1] = i
  end
  for id, list in pairs(spans) do
    for j, text in ipairs(new_runs(id, node_view(id).floor, list)) do made[at[id][j]] = text end
  end
  local out, kept = {}, {}
  for i = 1, #cut do out[i] = made[i] end
  for _, h in ipairs(held) do
    if not h.gone then kept[#kept + 1] = run_text(h[1], h[2], h[3], h[4]) end
  end
  for i = #cut + 1, #made do kept[#kept + 1] = made[i] end
  redis.call('HSET', pk, 'extents', table.concat(kept, ';'))
  return table.concat(out, ';'), missing
end

-- A commit that reaches Redis after `by` (Redis ms; '' or 0: none) changes nothing: its client
-- stopped waiting for its answer by then and told its caller kTimeout, and puts of the key
-- may have followed (a commit held up in a partition that healed, or by a stalled Redis,
-- would otherwise make an older object the key's again). Returns the refusal, or nil.
local function late_commit(by)
  by = tonumber(by or '') or 0
  if by <= 0 or now_fine <= by then return nil end  -- to the microsecond: `now` rounds down
  return 'TIMEOUT the commit reached Redis ' .. string.format('%.1f', now_fine - by) ..
         ' ms after its client stopped waiting for it'
end

-- commit_reserved of the put whose arguments are a[base + 1] .. a[base + 13] (reservation,
-- first, count, token, key, size, checksum, layout, ttl_ms, condition, copies, keep hint,
-- commit by): nil once it is the object (or already was), else why not (an error reply's
-- text: STALE, INVALID, TIMEOUT).
local function commit_reserved_one(a, base)
  local res, first, count = a[base + 1], tonumber(a[base + 2]), tonumber(a[base + 3])
  local token, key, size, ttl = a[base + 4], a[base + 5], a[base + 6], tonumber(a[base + 9])
  -- What the commit reads of the object and of the reservation, each in one command.
  local o = redis.call('HMGET', P .. ':obj:' .. key, 'token', 'quota', 'size')
  if o[1] == token then return nil end
  local late = late_commit(a[base + 13])
  if late then return late end
  local r = redis.call('HMGET', P .. ':put:' .. res, 'key', 'ends', 'extents', 'qgen', 'qbytes')
  if r[1] ~= '' then
    return 'STALE the page reservation lost its lease before the commit; its pages were reclaimed'
  end
  local extents, why = carve(res, first, count, true, {r[2], r[3]})
  if not extents then return why end
  quota_unreserve(res, count * page_size(), {r[4], r[5]})  -- charged to the key's quota from here on
  local failed = condition_fails(key, a[base + 10]) or quota_fit(key, size, {o[2], o[3]})
  if failed then
    free_extents(extents)  -- the writes are done: nothing can land in them any more
    return failed
  end
  publish(key, token, size, extents, nodes_of(extents), a[base + 7], a[base + 8], ttl, a[base + 11], a[base + 12],
          o[1] ~= false)
  return nil
end

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
