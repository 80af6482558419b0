-- prelude/replicas.lua: replicas of hot objects: copy keys, their release, the least leased
-- readable copy.
-- Uses     call, objects

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
