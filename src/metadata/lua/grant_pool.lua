-- grant_pool.lua: a grant over a node's whole pool, for the pool leases of a cell whose rkey
-- scope is 'connection' (one window per connection and node, shared by many operations, where
-- leasing asks the node: verbs). Under rkey scope 'lease' every lease is the operation's
-- own and no pool grant is given.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id, op ('r' or 'w'), deadline (ms of Redis time; 0: now + ttl), ttl_ms
-- Returns  the grant's deadline, the grant; NOT_FOUND for a node that is not live and up or
--          draining; INVALID under rkey scope 'lease', or for a deadline already past or
--          more than 10 minutes away
-- Uses     call, nodes, grants

local id, op = ARGV[1], ARGV[2]
local deadline, ttl = tonumber(ARGV[3]) or 0, tonumber(ARGV[4]) or 0
local scope = redis.call('HGET', P .. ':cell', 'rkey_scope')
if scope and scope ~= 'connection' then
  return redis.error_reply('INVALID the cell leases per operation (rkey_scope ' .. scope .. '): no pool grants')
end
if op ~= 'r' and op ~= 'w' then return redis.error_reply('INVALID op must be r or w') end
if deadline == 0 then deadline = now + ttl end
if deadline <= now or deadline > now + 600000 then
  return redis.error_reply('INVALID a pool grant ends within 10 minutes from now')
end
local v = node_view(id)
if not v.alive or (v.state ~= 'up' and v.state ~= 'draining') then
  return redis.error_reply('NOT_FOUND memory node ' .. id .. ' is not serving')
end
local g = grant_for(id, op, deadline, '*')
if g == '' then return redis.error_reply('NOT_FOUND memory node ' .. id .. ' registered no grant key') end
return {deadline, g}
