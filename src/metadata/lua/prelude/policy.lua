-- prelude/policy.lua: the eviction policy's state (LRU, ARC, turn-ttl): what each use, store and
-- removal tells it.
-- Uses     call, quotas

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
-- and the NVMe tier's write-down. tools/kvstash/replay_model.cc runs the same rules in process.
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
