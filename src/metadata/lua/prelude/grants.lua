-- prelude/grants.lua: grants: the longest lease, the nodes' keys and the grants the cell signs for
-- each lease.
-- Uses     call, nodes, pages

-- Grants (docs/operations.md, "Threat model"): a memory node serves a lease only under a
-- grant the cell signed for it. Each node hands the cell a fresh HMAC key whenever it
-- registers, and the next one every rotation period (heartbeat); the cell keeps the key's pads
-- in P:grant:<id> (a key of its own, so an ACL can keep read-only users away from it). A grant names the node, its epoch, the op, the
-- lease's deadline (its fence tag at the node) and the node's pages the lease may reach, and
-- is signed with HMAC-SHA1, the one hash scripts have (src/common/grant.h reads it).

-- The longest lease the cell grants (ms): every lease a script takes, and so every grant's
-- deadline, lies within it of Redis's clock; a memory node refuses a grant whose deadline lies
-- further past its idea of that clock (grant::kMaxLease, the same figure).
local MAX_LEASE_MS = 600000

-- ARGV text as a lease's length (ms), or nil and the INVALID error: a whole number of 1 to
-- MAX_LEASE_MS.
local function lease_ms_of(text)
  local ms = tonumber(text)
  if not ms or ms < 1 or ms > MAX_LEASE_MS or ms ~= math.floor(ms) then
    return nil, redis.error_reply('INVALID a lease lasts 1 to ' .. MAX_LEASE_MS .. ' ms, not ' .. tostring(text))
  end
  return ms
end

local function unhex(h)
  return (string.gsub(h, '%x%x', function(x) return string.char(tonumber(x, 16)) end))
end

-- Keep node `id`'s grant key (hex) as the one the cell signs with, named `word` in grants
-- (the epoch at registration, `<epoch>/<generation>` for the keys a heartbeat hands over): its
-- HMAC pads, so that a grant costs two SHA1s (keys of up to 64 bytes, as HMAC pads them). No
-- key, no grants.
local function keep_grant_key(id, key_hex, word)
  local gk = P .. ':grant:' .. id
  local key = unhex(key_hex)
  if #key == 0 or #key > 64 then
    redis.call('DEL', gk)
    return
  end
  local ipad, opad = {}, {}
  for i = 1, 64 do
    local b = string.byte(key, i) or 0
    ipad[i] = string.char(bit.bxor(b, 0x36))
    opad[i] = string.char(bit.bxor(b, 0x5c))
  end
  redis.call('HSET', gk, 'ipad', table.concat(ipad), 'opad', table.concat(opad), 'epoch', word)
end

-- The grant of `op` ('r' or 'w') over `runs` ("first+count,...", or '*' for the whole pool)
-- of node `id` until `deadline`; '' for a node that registered no key.
local function grant_for(id, op, deadline, runs_text)
  local g = grant_keys[id]
  if g == nil then
    local r = redis.call('HMGET', P .. ':grant:' .. id, 'ipad', 'opad', 'epoch')
    g = {ipad = r[1], opad = r[2], epoch = r[3]}
    grant_keys[id] = g
  end
  if not g.ipad or not g.opad or not g.epoch or runs_text == '' then return '' end
  local msg = 'g1 ' .. id .. ' ' .. g.epoch .. ' ' .. op .. ' ' .. string.format('%.0f', deadline) .. ' ' .. runs_text
  return msg .. ' ' .. redis.sha1hex(g.opad .. unhex(redis.sha1hex(g.ipad .. msg)))
end

-- The endpoints of nodes (space-separated ids) appended to `out`: id, address, key, and the
-- grant of `op` over the node's pages of `extents` until `deadline`.
local function endpoints(out, nodes, op, extents, deadline)
  local pages = {}
  for id, page, _, n in runs(extents) do
    local t = pages[id]
    if not t then
      t = {}
      pages[id] = t
    end
    t[#t + 1] = string.format('%d+%d', page, n)
  end
  for id in string.gmatch(nodes or '', '[^ ]+') do
    local v = node_view(id)
    out[#out + 1] = id
    out[#out + 1] = v.address
    out[#out + 1] = v.key
    out[#out + 1] = grant_for(id, op, deadline, table.concat(pages[id] or {}, ','))
  end
  return out
end
