-- prelude/quotas.lua: quotas per key prefix and the cell's settings they charge by: objects and
-- whole pages charged at reservation and at commit, taken back at removal, abort or expiry; a
-- quota's LRU.
-- Uses     call

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
