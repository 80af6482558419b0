-- prelude/events.lua: why objects left the cell (kvstash explain) and the KV events stream routers
-- read.
-- Uses     call

-- Why objects left the cell (`kvstash explain`): P:gone:why maps a key to '<ms> <why>
-- <detail>' of its last removal (expired, evicted, removed, corrupt, node_down,
-- node_restarted, node_left, tier_lost). Bounded by generations: once it holds GONE_KEEP keys
-- it becomes P:gone:old (the generation before is unlinked, freed off Redis's thread), so the
-- record holds the last GONE_KEEP to 2 x GONE_KEEP removals whatever the churn, at two
-- commands per removal. A key put again keeps its record until explain sees it present.
local GONE_KEEP = 50000
local function record_gone(key, why, detail)
  local gk = P .. ':gone:why'
  redis.call('HSET', gk, key, now .. ' ' .. why .. ' ' .. (detail or ''))
  if redis.call('HLEN', gk) >= GONE_KEEP then
    redis.call('UNLINK', P .. ':gone:old')
    redis.call('RENAME', gk, P .. ':gone:old')
  end
end

-- KV events for cache-aware routers (docs/events.md). Off until `kvstash events` turns them on
-- (P:events: maxlen, epoch). An object a client announced (announce.lua) carries `ev`, the
-- event data its engine gave (msgpack: block hashes, parent hash, token ids, block size, LoRA
-- id), and is in P:events:objs; its stored and removed events go to the stream P:events:log,
-- capped at about maxlen entries, in the order the scripts ran. The relay (`kvstash events
-- serve`) publishes them; epoch changes whenever the stream cannot be trusted to continue what
-- the relay read (a failover), and the relay then starts over from P:events:objs.
local function events_maxlen()
  return tonumber(redis.call('HGET', P .. ':events', 'maxlen') or '')
end
-- `maxlen`: events_maxlen() when the caller has it already.
local function emit_event(kind, key, ev, why, maxlen)
  maxlen = maxlen or events_maxlen()
  if not maxlen then return end
  redis.call('XADD', P .. ':events:log', 'MAXLEN', '~', maxlen, '*', 't', kind, 'k', key, 'ev', ev, 'why', why or '')
end

-- An object present now takes its event data `ev` and goes out as stored (again, if it was
-- announced before); its removal, whenever it comes, goes out with the same data. `maxlen`:
-- events_maxlen(), which the caller checked.
local function record_event(key, ev, maxlen)
  redis.call('HSET', P .. ':obj:' .. key, 'ev', ev)
  redis.call('SADD', P .. ':events:objs', key)
  emit_event('stored', key, ev, nil, maxlen)
end
