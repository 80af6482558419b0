-- register_node.lua: a memory node joins the cell, or registers again.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id, epoch, page_size, page_count, address, key, ttl_ms, grant key (hex; the node's
--          HMAC key for the grants its leases need, prelude: grant_for; fresh per registration),
--          slots (of its NVMe tier, one page each; 0 or absent: none), the tier's low water
--          (pages: objects move down while fewer are free; prelude: nudge_tier), the tier's id
--          (its superblock's)
-- Returns  Redis's clock (ms); IN_USE while another epoch of the id is alive (two daemons sharing
--          an id would drop each other's objects); INVALID for a new id in a cell that knows
--          1,024 nodes already
--
-- A new epoch means the old incarnation's pages can no longer be written by anyone: a new
-- process has new memory, and a node that registers again from the same process has first
-- deregistered its pool from every transport (which fences every lease and request of the old
-- keys). So its objects are dropped (swept in batches; unreadable at once) and its pool starts
-- over.
-- Uses     call, nodes, quotas, tier, objects, grants

local id, epoch = ARGV[1], ARGV[2]
local ps, count = tonumber(ARGV[3]), tonumber(ARGV[4])
if not count or count < 1 or not ps or ps < 1 then
  return redis.error_reply('INVALID page size and count must be positive')
end
-- The cell's node lists (P:known, P:nodes) bound what fence_master, known_nodes and list_nodes
-- walk in one script: a node id the cell has never seen joins only while it knows fewer than
-- MAX_NODES (forgetting dead ones, `kvstash node rm`, makes room).
local MAX_NODES = 1024
if redis.call('SISMEMBER', P .. ':known', id) == 0 and redis.call('SCARD', P .. ':known') >= MAX_NODES then
  return redis.error_reply('INVALID the cell knows ' .. MAX_NODES .. ' nodes already, its most: forget dead ones ' ..
                           '(kvstash node rm) or start another cell')
end
local cell = page_size()
if cell > 0 and cell ~= ps then
  return redis.error_reply('INVALID page size ' .. ps .. ' differs from the cell page size ' .. cell)
end
redis.call('HSET', P .. ':cell', 'page_size', ps, 'schema', 4)
cell_settings().page_size = tonumber(ps)
local nk = P .. ':node:' .. id
local held = redis.call('HMGET', nk, 'epoch', 'state')
if held[1] and held[1] ~= epoch and (held[2] == 'up' or held[2] == 'draining') and live(id) then
  return redis.error_reply('IN_USE node id ' .. id .. ' is held by a live node (another kvstashd with the same id?)')
end
if held[1] ~= epoch then
  sweep_node_objects(id)
  redis.call('DEL', P .. ':free:' .. id)
  -- Every generation of the new incarnation starts above every generation of the old ones
  -- (the floor), so an old extent can never match a page again, without touching each page.
  redis.call('DEL', P .. ':gen:' .. id)
  -- 2^32 allocations of a page per incarnation, 2^21 incarnations within Lua's exact integers.
  local floor = (redis.call('HINCRBY', nk, 'epochs', 1) - 1) * 4294967296
  -- Nothing granted before now can still write here: the pool was fenced as a whole.
  redis.call('HSET', nk, 'epoch', epoch, 'next_page', 0, 'free_pages', 0, 'registered', now, 'gen_floor', floor,
             'fenced', now)
end
-- The NVMe tier outlives the pool: a node that finds the same tier again (its superblock's id,
-- as many slots) keeps it, and its objects become readable again as soon as it serves (every
-- promotion checks their bytes against the sum the write-down recorded). Any other device, or
-- none, starts the tier over (its objects swept, its slots above a new floor), and the node
-- may then offer what its device holds of the cell's recoverable keys (recover_tier.lua): a
-- cell that lost its Redis gets them back.
local sk = P .. ':node:' .. slots_of(id)
local slots, tier_id = tonumber(ARGV[9] or '0') or 0, ARGV[11] or ''
local known = redis.call('HMGET', sk, 'tier_id', 'page_count')
if held[1] ~= epoch and (slots > 0 or known[2]) then  -- a node that never had a tier has nothing here
  if slots == 0 or tier_id == '' or known[1] ~= tier_id or tonumber(known[2] or '0') ~= slots then
    sweep_tier_objects(id)
    -- The node may offer what its device holds (recover_tier.lua): nothing moves down before.
    if slots > 0 then redis.call('HSET', sk, 'recovery', 'pending') end
  elseif redis.call('HGET', sk, 'recovery') == 'running' then
    redis.call('HSET', sk, 'recovery', 'pending')  -- the node died during it: it runs again
  end
  redis.call('DEL', P .. ':promote:' .. id)  -- queued before: their gets queue them again
end
if slots > 0 then
  redis.call('HSET', sk, 'page_count', slots, 'low', tonumber(ARGV[10] or '1') or 1, 'tier_id', tier_id)
elseif held[1] ~= epoch and known[2] then
  redis.call('HDEL', sk, 'gen_floor', 'low', 'tier_id', 'page_count', 'recovery')  -- no tier now: nothing moves down
end
redis.call('HSET', nk, 'page_size', ps, 'page_count', count, 'state', 'up', 'address', ARGV[5], 'key', ARGV[6])
keep_grant_key(id, ARGV[8] or '', epoch)
redis.call('ZADD', P .. ':nodes', now + tonumber(ARGV[7]), id)
redis.call('SADD', P .. ':known', id)
return now
