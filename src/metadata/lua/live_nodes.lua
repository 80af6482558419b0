-- live_nodes.lua: the nodes a client may connect to now: live, and up or draining (their
-- objects readable).
--
-- KEYS[1]  the cell's key prefix (P)
-- ARGV     (none)
-- Returns  {id, address, key, id, address, key, ...}
-- Uses     call, nodes

local out = {}
for _, id in ipairs(redis.call('ZRANGE', P .. ':nodes', 0, -1)) do
  if live(id) then
    local n = redis.call('HMGET', P .. ':node:' .. id, 'state', 'address', 'key')
    if (n[1] == 'up' or n[1] == 'draining') and n[2] and n[3] then
      out[#out + 1] = id
      out[#out + 1] = n[2]
      out[#out + 1] = n[3]
    end
  end
end
return out
