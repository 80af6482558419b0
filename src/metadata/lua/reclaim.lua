-- reclaim.lua: the cell's background sweep.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     limit
-- Returns  expired, puts, zombies, dead nodes, the objects the dead nodes held, the puts still
--          waiting for a node's fence, the objects swept, and more (1: a limit was reached)
--
-- Sweeps, at most `limit` of each: expired objects; puts past their lease whose live nodes
-- have all fenced through it (their writes can no longer land; a dead node's pages start over
-- when it registers again); zombies past their last read lease; nodes past their heartbeat
-- deadline (`state = dead`; their objects go to the sweep); and objects of the sweep (dead or
-- restarted nodes'). Each item costs a few dozen microseconds: a small limit keeps one run near
-- a millisecond, and the caller runs it again while `more` says work is left.
-- Uses     call, nodes, pages, quotas, objects, eviction

local limit = tonumber(ARGV[1])
local expired = sweep_expired(limit)
local puts = redis.call('ZRANGEBYSCORE', P .. ':pending', '-inf', '(' .. now, 'WITHSCORES', 'LIMIT', 0, limit)
local freed, waiting, fenced = 0, 0, {}
for i = 1, #puts, 2 do
  local tok, deadline = puts[i], tonumber(puts[i + 1])
  local pk = P .. ':put:' .. tok
  local p = redis.call('HMGET', pk, 'extents', 'nodes')
  quota_unreserve(tok)  -- its lease ended: it holds nothing of its quota while it waits
  local ready = true
  for id in string.gmatch(p[2] or '', '[^ ]+') do
    if fenced[id] == nil then
      fenced[id] = tonumber(redis.call('HGET', P .. ':node:' .. id, 'fenced') or '0') or 0
    end
    if live(id) and fenced[id] < deadline then ready = false end
  end
  if ready then
    drop_put(tok, p[1])
    freed = freed + 1
  else
    waiting = waiting + 1
  end
end
local zombies = redis.call('ZRANGEBYSCORE', P .. ':zombies', '-inf', '(' .. now, 'LIMIT', 0, limit)
for _, tok in ipairs(zombies) do
  free_extents(redis.call('GET', P .. ':zombie:' .. tok))
  redis.call('DEL', P .. ':zombie:' .. tok, P .. ':readers:' .. tok)
  redis.call('ZREM', P .. ':zombies', tok)
end
local dead = redis.call('ZRANGEBYSCORE', P .. ':nodes', '-inf', '(' .. now, 'LIMIT', 0, limit)
local orphans = 0
for _, id in ipairs(dead) do
  orphans = orphans + sweep_node_objects(id)
  redis.call('HSET', P .. ':node:' .. id, 'state', 'dead')
  redis.call('ZREM', P .. ':nodes', id)
end
local swept = sweep(limit)
local more = 0
if expired == limit or #puts / 2 == limit or #zombies == limit or #dead == limit or swept == limit then more = 1 end
return {expired, freed, #zombies, #dead, orphans, waiting, swept, more}
