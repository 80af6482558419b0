-- prelude/tier.lua: the NVMe tier's slots: which slot runs are the tier's current incarnation's.
-- Uses     call, pages

-- The NVMe tier (docs/nvme-tier.md). A node's tier is cut into slots of one page each, handed
-- out exactly as its pool's pages are (take_pages, new_runs, free_extents), under the pseudo
-- node id <id>!ssd ('!' is in no node id): P:node:<id>!ssd (page_count, next_page, free_pages,
-- gen_floor), P:free:<id>!ssd, P:gen:<id>!ssd. So every invariant of pages holds for slots: a
-- slot is handed out once, and only the holder of its current generation frees it. An object
-- on the tier has tier = ssd, its slots in ssd_extents and no pool page (extents ''), the
-- node's own xxh3 of its bytes in ssd_sum, and sits in P:lru_ssd:<id> instead of P:lru. Only
-- an object wholly on one node moves down. A write-down in progress is 'moving' (the slots it
-- took) until 'moving_until'; a promotion queued or running is 'promoting' (until when).
local function slots_of(id)
  return id .. '!ssd'
end

-- Whether the slot runs of `list` are still the tier's current incarnation's (a node that
-- registered again started its slots over, above a new floor).
local function slots_live(list)
  for id, _, gen in runs(list) do
    local floor = tonumber(redis.call('HGET', P .. ':node:' .. id, 'gen_floor') or '') or math.huge
    return gen > floor
  end
  return false
end
