-- recover_tier.lua: a node offers the objects its NVMe tier still holds to a cell that started
-- its tier over (its Redis lost them: restarted empty; or the node forgotten). Only keys under
-- the node's recoverable prefixes, whose names say their content (docs/metadata.md, "A cell
-- that lost its Redis"), are offered, each checked by the node against the sum in its header.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id, epoch, op, then by op:
--            begin                   -> RUN (recover now: the tier was started over) or NONE
--            offer, found, checked, bad (the node's counts of headers so far: found on the
--                   device, checked against their bytes, of those not matching), then per
--                   object: key, token, size, checksum, layout, expires (Redis ms; 0: never),
--                   slot runs ("first,count;..."), sum (the node's)
--                                    -> per object: ADMITTED, KEPT (a recovery before this one
--                                       of the same node admitted it at these slots), TAKEN
--                                       (the key holds an object: it is newer), EXPIRED, COPY
--            end, found, checked, bad (as above, final), claimed slot runs ("first,count;...",
--                   ascending, not overlapping)
--                                    -> OK
--          STALE (an error) when the node is not serving under `epoch` or no recovery runs.
--
-- register_node marks a tier it starts over 'pending'; nothing moves down while its recovery
-- is pending or running (begin_write_down), so no slot is handed out until `end` has made the
-- free list of the slots no admitted object holds. A node that dies during a recovery runs it
-- again when it registers: what it admitted is KEPT.
-- Uses     call, nodes, pages, quotas, tier, objects, replicas

local id, epoch, op = ARGV[1], ARGV[2], ARGV[3]
local sid = slots_of(id)
local sk = P .. ':node:' .. sid
if not serves(id, epoch) then return redis.error_reply('STALE node ' .. id .. ' is not serving under this epoch') end
local state = redis.call('HGET', sk, 'recovery')

if op == 'begin' then
  if state ~= 'pending' then return 'NONE' end
  redis.call('HSET', sk, 'recovery', 'running', 'recovery_started', now, 'recovery_found', 0, 'recovery_checked', 0,
             'recovery_bad', 0, 'recovery_admitted', 0, 'recovery_refused', 0)
  redis.call('HDEL', sk, 'recovery_ended')
  return 'RUN'
end
if state ~= 'running' then return redis.error_reply('STALE no recovery of the tier of ' .. id .. ' is running') end

-- "first,count;..." as {first, count} spans.
local function spans_of(text)
  local out = {}
  for first, count in string.gmatch(text or '', '(%d+),(%d+)') do out[#out + 1] = {tonumber(first), tonumber(count)} end
  return out
end

if op == 'offer' then
  local floor = tonumber(redis.call('HGET', sk, 'gen_floor') or '0') or 0
  local out, admitted, refused = {}, 0, 0
  redis.call('HSET', sk, 'recovery_found', tonumber(ARGV[4]) or 0, 'recovery_checked', tonumber(ARGV[5]) or 0,
             'recovery_bad', tonumber(ARGV[6]) or 0)
  for i = 7, #ARGV - 7, 8 do
    local key, token, size, checksum, layout = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
    local expires, runs_text, sum = tonumber(ARGV[i + 5]) or 0, ARGV[i + 6], ARGV[i + 7]
    local spans = spans_of(runs_text)
    local why = nil
    if expires > 0 and expires <= now then
      why = 'EXPIRED'
    elseif is_copy(key) then
      why = 'COPY'  -- a replica's copy is its object's business: the object itself recovers
    else
      local o = lookup(key)
      if o then
        why = 'TAKEN'
        if o[10] == 'ssd' and o[6] == id then
          local mine = {}
          for _, page, _, n in runs(o[11]) do mine[#mine + 1] = page .. ',' .. n end
          if table.concat(mine, ';') == runs_text then why = 'KEPT' end
        end
      end
    end
    if why == nil and #spans > 0 then
      local slots = table.concat(new_runs(sid, floor, spans), ';')
      local ok = P .. ':obj:' .. key
      redis.call('HSET', ok, 'size', size, 'token', token, 'extents', '', 'nodes', id, 'checksum', checksum,
                 'layout', layout, 'created', now, 'expires', expires, 'tier', 'ssd', 'ssd_extents', slots,
                 'ssd_sum', sum, 'recovered', now)
      redis.call('SADD', P .. ':tier_objs:' .. id, key)
      redis.call('ZADD', P .. ':lru_ssd:' .. id, now, key)
      if (tonumber(size) or 0) > 0 then redis.call('HINCRBY', P .. ':stats', 'bytes', size) end
      quota_charge(quota_of(key), key, size, now_fine)
      if expires > 0 then redis.call('ZADD', P .. ':expiry', expires, key) end
      admitted = admitted + 1
      why = 'ADMITTED'
    elseif why ~= 'KEPT' then
      refused = refused + 1
    end
    out[#out + 1] = why or 'TAKEN'
  end
  redis.call('HINCRBY', sk, 'recovery_admitted', admitted)
  redis.call('HINCRBY', sk, 'recovery_refused', refused)
  if admitted > 0 then redis.call('HINCRBY', P .. ':stats', 'recovered', admitted) end
  return out
end

if op == 'end' then
  -- The tier hands out slots again: every slot neither claimed (admitted or kept) nor already
  -- on the free list joins it. Objects admitted and then promoted, removed or replaced during
  -- the recovery freed their slots onto the list already (a slot is claimed and free then);
  -- so did objects of an earlier, interrupted recovery. Nothing took a slot meanwhile.
  local fk = P .. ':free:' .. sid
  local spans = spans_of(ARGV[7])
  local free = 0
  for _, e in ipairs(redis.call('LRANGE', fk, 0, -1)) do
    local page, n = string.match(e, '^(%d+),?(%d*)$')
    n = tonumber(n) or 1
    spans[#spans + 1] = {tonumber(page), n}
    free = free + n
  end
  table.sort(spans, function(a, b) return a[1] < b[1] end)
  local holes, at = {}, 0
  for _, sp in ipairs(spans) do
    if sp[1] > at then
      holes[#holes + 1] = string.format('%d,%d', at, sp[1] - at)
      free = free + sp[1] - at
    end
    at = math.max(at, sp[1] + sp[2])
  end
  call_chunked('RPUSH', fk, holes)
  redis.call('HSET', sk, 'next_page', at, 'free_pages', free, 'recovery', 'done', 'recovery_ended', now,
             'recovery_found', tonumber(ARGV[4]) or 0, 'recovery_checked', tonumber(ARGV[5]) or 0,
             'recovery_bad', tonumber(ARGV[6]) or 0)
  return 'OK'
end
return redis.error_reply('INVALID recover_tier: unknown op ' .. tostring(op))
