-- prelude/publish.lua: publishing a put: its conditions, the record that makes it the object,
-- carving a page reservation, commits that arrive too late.
-- Uses     call, nodes, pages, quotas, events, policy, objects, replicas, eviction, reads

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

-- A commit's event data (KV events, docs/events.md; '' or nil: none), recorded with the object
-- it just published while the cell's events are on, in the commit's own script: a router hears
-- of the object exactly when it became one. Returns whether it was recorded.
local function commit_event(key, ev)
  if (ev or '') == '' then return false end
  local maxlen = events_maxlen()
  if not maxlen then return false end
  record_event(key, ev, maxlen)
  return true
end

-- What a commit replies: OK, or 'OK announced' when its event data was recorded.
local function committed_reply(announced)
  return announced and 'OK announced' or 'OK'
end

-- commit_reserved of the put whose arguments are a[base + 1] .. a[base + 14] (reservation,
-- first, count, token, key, size, checksum, layout, ttl_ms, condition, copies, keep hint,
-- commit by, event data): nil once it is the object (or already was) and whether its event
-- data was recorded, else why not (an error reply's text: STALE, INVALID, TIMEOUT).
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
  return nil, commit_event(key, a[base + 14])
end
