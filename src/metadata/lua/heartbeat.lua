-- heartbeat.lua: a node renews its place in the cell.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id, epoch, ttl_ms, fenced (ms of Redis time: the node has fenced every lease whose tag,
--          the deadline of the put or read it serves, is at most this; it only moves up),
--          optionally the node's next grant key (hex) and its word (`<epoch>/<generation>`):
--          the cell signs with it from now on (prelude: keep_grant_key)
-- Returns  Redis's clock (ms), from which the node estimates how far it may fence; STALE when the
--          node must register again
--
-- STALE when another epoch holds the id, or its deadline passed (readers have been told its
-- objects are gone, and puts' pages may have been freed without its fence: only a new
-- registration, after fencing the whole pool, may serve again).
-- Uses     call, nodes, grants

local id = ARGV[1]
local nk = P .. ':node:' .. id
local n = redis.call('HMGET', nk, 'epoch', 'state', 'fenced')
if n[1] ~= ARGV[2] or (n[2] ~= 'up' and n[2] ~= 'draining' and n[2] ~= 'leaving') then
  return redis.error_reply('STALE node ' .. id .. ' is not registered with this epoch')
end
if not live(id) then
  return redis.error_reply('STALE node ' .. id .. ' missed its heartbeat deadline')
end
redis.call('ZADD', P .. ':nodes', now + tonumber(ARGV[3]), id)
local fenced = tonumber(ARGV[4]) or 0
if fenced > (tonumber(n[3] or '0') or 0) then redis.call('HSET', nk, 'fenced', fenced) end
local key, word = ARGV[5], ARGV[6]
if key and key ~= '' then
  if not word or string.sub(word, 1, #ARGV[2] + 1) ~= ARGV[2] .. '/' then
    return redis.error_reply('INVALID a grant key is named <epoch>/<generation> of its registration')
  end
  keep_grant_key(id, key, word)
end
return now
