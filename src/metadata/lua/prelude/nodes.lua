-- prelude/nodes.lua: memory nodes as a script sees them: which serve under which epoch, read once
-- per call.
-- Uses     call

local function live(id)
  local d = redis.call('ZSCORE', P .. ':nodes', id)
  return d ~= false and d ~= nil and tonumber(d) >= now
end

-- Whether node `id` serves under `epoch`: its record holds that epoch, it is up or draining,
-- and its heartbeat is current (the tier's scripts run for the node itself).
local function serves(id, epoch)
  local n = redis.call('HMGET', P .. ':node:' .. id, 'epoch', 'state')
  return n[1] == epoch and (n[2] == 'up' or n[2] == 'draining') and live(id)
end

-- What a script reads of a node to serve its objects, read once per run (a get, a
-- contains_prefix of many keys on few nodes): alive, state, generation floor, address, key.
-- Scripts that change a node's record read it directly, never through here.
local function node_view(id)
  local v = node_views[id]
  if v == nil then
    local n = redis.call('HMGET', P .. ':node:' .. id, 'state', 'gen_floor', 'address', 'key')
    v = {alive = live(id), state = n[1], floor = tonumber(n[2] or '0') or 0, address = n[3] or '', key = n[4] or ''}
    node_views[id] = v
  end
  return v
end
