-- commit_put.lua: the pending put becomes the object.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     token, key, checksum, layout, ttl_ms, condition ('' none; '!' only if the key holds no
--          object; '=<token>' only if it holds the object that put wrote, else STALE and the
--          put's pages are freed), copies (optional, 1: the copies the put wrote, see prelude),
--          keep hint (optional: turn-ttl's, prelude's ttl_hint), commit by (optional: Redis time
--          in ms after which the commit changes nothing, its client having stopped waiting for
--          it; '' or 0 none: prelude's late_commit), event data (optional: KV events, recorded
--          with the object while the cell's events are on, as announce.lua does)
-- Returns  OK ('OK announced' when its event data was recorded), also for a commit repeated
--          after it succeeded; STALE when the put lost its lease,
--          was aborted, or a node of it died or restarted; TIMEOUT past its commit-by time
--
-- An object it replaces is released.
-- Uses     call, nodes, pages, quotas, eviction, publish

local token, key, ttl = ARGV[1], ARGV[2], tonumber(ARGV[5])
local pk = P .. ':put:' .. token
local p = redis.call('HMGET', pk, 'key', 'extents', 'nodes', 'size', 'aborted')
if not p[1] then
  if redis.call('HGET', P .. ':obj:' .. key, 'token') == token then return 'OK' end
  return redis.error_reply('STALE the put lost its lease before the commit; its pages were reclaimed')
end
local late = late_commit(ARGV[9])
if late then return redis.error_reply(late) end
if p[5] then return redis.error_reply('STALE the put was aborted') end
if p[1] ~= key then return redis.error_reply('INVALID put token belongs to another key') end
local gone = not current(p[2])
for id in string.gmatch(p[3] or '', '[^ ]+') do
  if not live(id) then gone = true end
end
if gone then
  drop_put(token, p[2])
  return redis.error_reply('STALE a memory node of the put died or restarted before the commit')
end
quota_unreserve(token)  -- the object is charged from here on
local failed = condition_fails(key, ARGV[6]) or quota_fit(key, p[4])
if failed then
  drop_put(token, p[2])
  return redis.error_reply(failed)
end
publish(key, token, p[4], p[2], p[3], ARGV[3], ARGV[4], ttl, ARGV[7], ARGV[8])
redis.call('DEL', pk)
redis.call('ZREM', P .. ':pending', token)
return committed_reply(commit_event(key, ARGV[10]))
