-- abort_put.lua: ends a put that will not commit.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     token, then the nodes that confirmed that none of the put's writes can land on them any
--          more (Peer::revoke)
-- Returns  the pages left waiting
--
-- The put's pages on those nodes, and on nodes that are not alive, are freed now; the rest
-- stay with the pending put, and reclaim frees them once its lease has passed and their nodes
-- have fenced through it (a write still queued at a stalled node must never land in a page
-- another put was given). Idempotent.
-- Uses     call, nodes, pages, quotas

local tok = ARGV[1]
local pk = P .. ':put:' .. tok
local p = redis.call('HMGET', pk, 'extents', 'nodes')
if not p[1] then return 0 end
local confirmed = {}
for i = 2, #ARGV do confirmed[ARGV[i]] = true end
local free, keep, kept_nodes, seen, waiting = {}, {}, {}, {}, 0
for id, page, gen, n in runs(p[1]) do
  local e = run_text(id, page, gen, n)
  if confirmed[id] or not live(id) then
    free[#free + 1] = e
  else
    keep[#keep + 1] = e
    waiting = waiting + n
    if not seen[id] then
      seen[id] = true
      kept_nodes[#kept_nodes + 1] = id
    end
  end
end
quota_unreserve(tok)  -- the pages that wait for a fence are no longer the put's
if #keep == 0 then
  drop_put(tok, p[1])
else
  free_extents(table.concat(free, ';'))
  redis.call('HSET', pk, 'extents', table.concat(keep, ';'), 'nodes', table.concat(kept_nodes, ' '), 'aborted', now)
end
return waiting
