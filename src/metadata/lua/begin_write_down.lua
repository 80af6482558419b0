-- begin_write_down.lua: a node with an NVMe tier picks cold objects to move down to it.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id, epoch, low water (pages: act while fewer are free), most pages to move, lease_ms,
--          high water (pages: move enough to free this many; default the low water)
-- Returns  the write-down's deadline (ms of Redis time), then per object: key, token, size,
--          extents (its pool pages, all on this node), slots (ssd extents), checksum, layout,
--          expires (what the tier's header of it records: docs/nvme-tier.md); just the deadline
--          when nothing needs to move; STALE when the node is not this epoch, alive and up
--
-- Picks least recently used objects no reader leases, wholly on this node's pool (an object
-- that spans nodes is evicted as before), and takes slots for each, evicting the tier's own
-- least recently used objects when it is full. Each object is marked moving (its slots, until
-- the deadline): its pages are untouched, and it serves gets as before. commit_write_down
-- moves it; a put or remove meanwhile simply releases it, slots and all.
-- Uses     call, nodes, pages, tier, objects, eviction, grants

local id, epoch = ARGV[1], ARGV[2]
local low, most = tonumber(ARGV[3]), tonumber(ARGV[4])
local lease, refused = lease_ms_of(ARGV[5])
if not lease then return refused end
local n = redis.call('HMGET', P .. ':node:' .. id, 'epoch', 'state')
if n[1] ~= epoch or n[2] ~= 'up' or not live(id) then
  return redis.error_reply('STALE node ' .. id .. ' is not up under this epoch')
end
local deadline = now + lease
local sid = slots_of(id)
local t = redis.call('HMGET', P .. ':node:' .. sid, 'gen_floor', 'recovery')
local floor = tonumber(t[1] or '')
if not floor then return {deadline} end  -- no tier
if t[2] == 'pending' or t[2] == 'running' then return {deadline} end  -- no slot is handed out before it ends
redis.call('HDEL', P .. ':node:' .. sid, 'nudged')  -- the node looks now (prelude: nudge_tier)
local free = free_pages(id)
if free >= low then return {deadline} end
local want = math.min(math.max(tonumber(ARGV[6] or '') or low, low) - free, most)

local picked, pages = {}, 0
walk_unleased_lru(function(key, _, extents, size)
  local count = 0
  for node, _, _, c in runs(extents) do
    if node ~= id then return false end
    count = count + c
  end
  if count == 0 then return false end
  local o = redis.call('HMGET', P .. ':obj:' .. key, 'moving', 'moving_until', 'token', 'checksum', 'layout',
                       'expires')
  if o[1] and (tonumber(o[2] or '0') or 0) >= now then return false end  -- one is running
  if o[1] then
    free_extents(o[1])  -- an earlier write-down that never committed
    redis.call('HDEL', P .. ':obj:' .. key, 'moving', 'moving_until')
  end
  picked[#picked + 1] = {key, o[3], size, extents, count, o[4] or '', o[5] or '', o[6] or '0'}
  pages = pages + count
  return pages >= want
end, want + 1024)
if #picked == 0 then return {deadline} end

-- Room on the tier: its least recently used objects go (none is leased: a get promotes first).
free = free_pages(sid)
if free < pages then
  local lk = P .. ':lru_ssd:' .. id
  local victims = redis.call('ZRANGE', lk, 0, 255)
  local gone = 0
  for _, key in ipairs(victims) do
    if free >= pages then break end
    if redis.call('EXISTS', P .. ':obj:' .. key) == 1 then
      release(key, 'evicted', 'the NVMe tier was full')  -- its slots return at once
      free = free_pages(sid)
      gone = gone + 1
    else
      redis.call('ZREM', lk, key)
    end
  end
  if gone > 0 then redis.call('HINCRBY', P .. ':stats', 'tier_evicted', gone) end
end

local out = {deadline}
for _, p in ipairs(picked) do
  if free_pages(sid) < p[5] then break end
  local slots = table.concat(new_runs(sid, floor, take_pages(sid, p[5])), ';')
  redis.call('HSET', P .. ':obj:' .. p[1], 'moving', slots, 'moving_until', deadline)
  out[#out + 1] = p[1]
  out[#out + 1] = p[2]
  out[#out + 1] = p[3]
  out[#out + 1] = p[4]
  out[#out + 1] = slots
  out[#out + 1] = p[6]
  out[#out + 1] = p[7]
  out[#out + 1] = p[8]
end
return out
