-- announce.lua: an engine says what routers should know of objects it stored (KV events,
-- docs/events.md). Each object present now takes the event data and goes out as stored (again,
-- if it was announced before); its removal, whenever it comes, goes out as removed with the
-- same data. An object that is gone already (removed, evicted, never committed) is skipped:
-- a router never hears of a stored object after its removal.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     key, event data, key, event data... (the data: msgpack, as docs/events.md says)
-- Returns  how many objects were announced; -1 when the cell's events are off
-- Uses     call, events, objects

local maxlen = events_maxlen()
if not maxlen then return -1 end
local n = 0
for i = 1, #ARGV - 1, 2 do
  local key, ev = ARGV[i], ARGV[i + 1]
  if present(key) then
    record_event(key, ev, maxlen)
    n = n + 1
  end
end
return n
