-- abort_promote.lua: a node's promotion failed; its pages go back (the node's reads into them
-- are done), and an object whose bytes on the tier are bad goes too.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     id, key, token (the object's), put token (the promotion's), bad ('1': the device
--          failed or the bytes did not match their sum: the object is removed, counted as
--          tier_lost; '0': it stays on the tier, and the next get queues it again)
-- Returns  DROPPED when the object went (bad, and still the one promoted), else OK
-- Uses     call, pages, objects, reads

local id, key, token, ptoken, bad = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5] == '1'
local pk = P .. ':put:' .. ptoken
local extents = redis.call('HGET', pk, 'extents')
if extents then drop_put(ptoken, extents) end
local ok = P .. ':obj:' .. key
if redis.call('HGET', ok, 'token') == token then
  wake_waiters(key, token)
  if bad then
    release(key, 'corrupt', 'its bytes on the NVMe tier of ' .. id .. ' failed their sum, or the device failed')
    redis.call('HINCRBY', P .. ':stats', 'tier_lost', 1)
    return 'DROPPED'
  else
    redis.call('HDEL', ok, 'promoting')
  end
end
return 'OK'
