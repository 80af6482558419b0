-- node_status.lua: one node's record, and where its pages are.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id
-- Returns  state, epoch, page_size, page_count, free pages, objects, heartbeat deadline (ms, -1
--          when not in the cell), now, reserved pages, pages in limbo, then its NVMe tier's
--          slots, free slots and objects (0, 0, 0: no tier), and its recovery (recover_tier.lua):
--          state ('' when none ran), headers found, checked, bad, objects admitted, refused;
--          NOT_FOUND for an unknown id
--
-- Reserved: pages of pending puts and page reservations within their lease (being written,
-- or waiting for a client's next puts). Limbo: pages no object holds that are not free yet:
-- a released object's pages while a reader still leases them (zombies), and the pages of
-- puts past their lease or aborted, until their nodes have fenced them. Counted over the
-- first SCAN pending records and zombies, so a run stays short whatever piles up.
-- Uses     call, pages, tier

local SCAN = 1000
local id = ARGV[1]
local n = redis.call('HMGET', P .. ':node:' .. id, 'state', 'epoch', 'page_size', 'page_count')
if not n[1] then return redis.error_reply('NOT_FOUND no node ' .. id) end
local free = free_pages(id)
local d = redis.call('ZSCORE', P .. ':nodes', id)
local reserved, limbo = 0, 0
local pending = redis.call('ZRANGE', P .. ':pending', 0, SCAN - 1, 'WITHSCORES')
for i = 1, #pending, 2 do
  local p = redis.call('HMGET', P .. ':put:' .. pending[i], 'extents', 'aborted')
  local held = held_pages(p[1], id)
  if tonumber(pending[i + 1]) >= now and not p[2] then
    reserved = reserved + held
  else
    limbo = limbo + held
  end
end
for _, tok in ipairs(redis.call('ZRANGE', P .. ':zombies', 0, SCAN - 1)) do
  limbo = limbo + held_pages(redis.call('GET', P .. ':zombie:' .. tok), id)
end
local rec = redis.call('HMGET', P .. ':node:' .. slots_of(id), 'recovery', 'recovery_found', 'recovery_checked',
                      'recovery_bad', 'recovery_admitted', 'recovery_refused')
return {n[1], n[2] or '', tonumber(n[3]) or 0, tonumber(n[4]) or 0, free,
        redis.call('SCARD', P .. ':objs:' .. id) + redis.call('SCARD', P .. ':tier_objs:' .. id),
        d and tonumber(d) or -1, now, reserved, limbo,
        tonumber(redis.call('HGET', P .. ':node:' .. slots_of(id), 'page_count') or '0') or 0,
        free_pages(slots_of(id)), redis.call('ZCARD', P .. ':lru_ssd:' .. id),
        rec[1] or '', tonumber(rec[2] or '0') or 0, tonumber(rec[3] or '0') or 0, tonumber(rec[4] or '0') or 0,
        tonumber(rec[5] or '0') or 0, tonumber(rec[6] or '0') or 0}
