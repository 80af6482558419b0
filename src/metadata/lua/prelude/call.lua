-- prelude/call.lua: the start of every script. The prelude is the modules of lua/prelude, each one
-- concern, joined in the order src/metadata/meson.build gives (docs/metadata.md, "The scripts'
-- prelude"); this one holds the prefix, the time from Redis itself (client clocks never matter) and
-- the batching of long commands. scripts.cc makes of it and the bodies one function library (each
-- script a function, `enter` called first), or, where Redis has no Functions, puts it in front of
-- each body (one EVAL text per script, `enter(KEYS, ARGV)` between).
--
-- KEYS[1]  the cell's key prefix, bound to P by enter
-- Defines  P, now (ms of Redis time), KEYS, ARGV and the helpers the scripts call
--
-- Extent lists are text, runs of pages in object order (see RUN below). Only the holder of a
-- run's current generation can free it.
-- Uses     nothing of the prelude

-- What one call sees, set by enter: its keys and arguments, the cell's prefix, Redis's clock
-- (now_fine keeps the microseconds as a fraction: the order of uses, P:lru, which uses a
-- millisecond apart keep), the keys named after the prefix, and what a call reads once.
local KEYS, ARGV, P, now, now_fine
local ARC_T1, ARC_T2, ARC_B1, ARC_B2, ARC
local TTL, TTL_DUE, TTL_GHOST, TTL_TRACK, TTL_TRACKED, TTL_PENDING, TTL_STATS
local node_views, quota_lens, quota_seen, cell_view, ttl_state, ttl_evicted_here, grant_keys

local function enter(keys, args)
  KEYS, ARGV = keys, args
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  now_fine = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
  if P ~= keys[1] then  -- a function library serves call after call of one cell: named once
    P = keys[1]
    ARC_T1, ARC_T2, ARC_B1, ARC_B2, ARC = P .. ':arc:t1', P .. ':arc:t2', P .. ':arc:b1', P .. ':arc:b2', P .. ':arc'
    TTL, TTL_DUE, TTL_GHOST = P .. ':ttl', P .. ':ttl:due', P .. ':ttl:ghost'
    TTL_TRACK, TTL_TRACKED, TTL_PENDING, TTL_STATS =
      P .. ':ttl:track', P .. ':ttl:tracked', P .. ':ttl:pending', P .. ':ttl:stats'
  end
  node_views, quota_lens, quota_seen, cell_view = {}, nil, {}, nil
  ttl_state, ttl_evicted_here, grant_keys = nil, 0, {}
end

-- Commands in one script cost a few microseconds each: the helpers below touch a node's
-- pages with one command per node (chunked under Lua's unpack limit), never one per page.
local CHUNK = 1000

local function call_chunked(cmd, key, items, step)
  local n = #items
  local i = 1
  while i <= n do
    local j = math.min(n, i + CHUNK * (step or 1) - 1)
    redis.call(cmd, key, unpack(items, i, j))
    i = j + 1
  end
end

local function hmget_chunked(key, fields)
  local out = {}
  for i = 1, #fields, CHUNK do
    local part = redis.call('HMGET', key, unpack(fields, i, math.min(#fields, i + CHUNK - 1)))
    for _, v in ipairs(part) do out[#out + 1] = v end
  end
  return out
end
