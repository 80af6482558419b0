#include "metadata/page_pool.h"

#include <hiredis/hiredis.h>

namespace kvstash::metadata {
namespace {

// Shared by the scripts: the time in ms from Redis itself.
#define KVS_NOW "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000) "

// KEYS[1] prefix; ARGV id, epoch, page_size, page_count, address, key, ttl_ms.
// Generations are kept across epochs, and marked free (negated) on a reset, so an extent from
// an old incarnation can never be freed into the new pool.
const Script kRegister(KVS_NOW R"lua(
local P, id, epoch = KEYS[1], ARGV[1], ARGV[2]
local page_size, page_count = tonumber(ARGV[3]), tonumber(ARGV[4])
if page_count == nil or page_count < 1 or page_size == nil or page_size < 1 then
  return redis.error_reply('INVALID page size and count must be positive')
end
local cell_size = redis.call('HGET', P .. ':cell', 'page_size')
if cell_size and tonumber(cell_size) ~= page_size then
  return redis.error_reply('INVALID page size ' .. page_size .. ' differs from the cell page size ' .. cell_size)
end
redis.call('HSET', P .. ':cell', 'page_size', page_size, 'schema', 1)
local nk = P .. ':node:' .. id
if redis.call('HGET', nk, 'epoch') ~= epoch then
  redis.call('DEL', P .. ':free:' .. id)
  local gens = redis.call('HGETALL', P .. ':gen:' .. id)
  for i = 1, #gens, 2 do
    local g = tonumber(gens[i + 1])
    if g > 0 then redis.call('HSET', P .. ':gen:' .. id, gens[i], -g) end
  end
  redis.call('HSET', nk, 'epoch', epoch, 'next_page', 0)
end
redis.call('HSET', nk, 'page_size', page_size, 'page_count', page_count, 'state', 'up',
           'address', ARGV[5], 'key', ARGV[6])
redis.call('ZADD', P .. ':nodes', now + tonumber(ARGV[7]), id)
return 'OK'
)lua");

// KEYS[1] prefix; ARGV id, epoch, ttl_ms.
const Script kHeartbeat(KVS_NOW R"lua(
local P, id = KEYS[1], ARGV[1]
if redis.call('HGET', P .. ':node:' .. id, 'epoch') ~= ARGV[2] then
  return redis.error_reply('STALE node ' .. id .. ' is not registered with this epoch')
end
redis.call('ZADD', P .. ':nodes', now + tonumber(ARGV[3]), id)
return 'OK'
)lua");

// KEYS[1] prefix; ARGV pages. Returns a flat array: node, page, generation, ...
const Script kAllocate(KVS_NOW R"lua(
local P, need = KEYS[1], tonumber(ARGV[1])
local live = redis.call('ZRANGEBYSCORE', P .. ':nodes', now, '+inf')
local cands, total = {}, 0
for _, id in ipairs(live) do
  local st = redis.call('HMGET', P .. ':node:' .. id, 'state', 'page_count', 'next_page')
  if st[1] == 'up' then
    local free = tonumber(st[2]) - tonumber(st[3]) + redis.call('LLEN', P .. ':free:' .. id)
    if free > 0 then
      cands[#cands + 1] = {id, free}
      total = total + free
    end
  end
end
if total < need then
  return redis.error_reply('NO_SPACE need ' .. need .. ' pages, live nodes have ' .. total .. ' free')
end
table.sort(cands, function(a, b) return a[2] > b[2] end)
local out, got = {}, 0
for _, c in ipairs(cands) do
  local id = c[1]
  local take = math.min(c[2], need - got)
  for _ = 1, take do
    local page = redis.call('RPOP', P .. ':free:' .. id)
    if not page then page = redis.call('HINCRBY', P .. ':node:' .. id, 'next_page', 1) - 1 end
    local old = tonumber(redis.call('HGET', P .. ':gen:' .. id, page) or '0')
    local gen = math.abs(old) + 1
    redis.call('HSET', P .. ':gen:' .. id, page, gen)
    out[#out + 1] = id
    out[#out + 1] = tonumber(page)
    out[#out + 1] = gen
  end
  got = got + take
  if got >= need then break end
end
return out
)lua");

// KEYS[1] prefix; ARGV node, page, generation, ... Returns how many pages were freed.
const Script kFree(R"lua(
local P, freed = KEYS[1], 0
for i = 1, #ARGV, 3 do
  local id, page, gen = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local gk = P .. ':gen:' .. id
  if tonumber(redis.call('HGET', gk, page) or '0') == gen and gen > 0 then
    redis.call('HSET', gk, page, -gen)
    redis.call('LPUSH', P .. ':free:' .. id, page)
    freed = freed + 1
  end
end
return freed
)lua");

// KEYS[1] prefix; ARGV node.
const Script kFreePages(R"lua(
local P, id = KEYS[1], ARGV[1]
local st = redis.call('HMGET', P .. ':node:' .. id, 'page_count', 'next_page')
if not st[1] then return redis.error_reply('NOT_FOUND no node ' .. id) end
return tonumber(st[1]) - tonumber(st[2]) + redis.call('LLEN', P .. ':free:' .. id)
)lua");

#undef KVS_NOW

std::string ms(std::chrono::milliseconds d) { return std::to_string(d.count()); }

}  // namespace

PagePool::PagePool(RedisClient& redis, std::string cell) : redis_(redis), prefix_("kvs:{kvs:" + cell + "}") {}

Status PagePool::register_node(const NodeRecord& n, std::chrono::milliseconds ttl) {
  if (n.id.empty() || n.epoch.empty()) return Status::invalid_argument("node id and epoch must be set");
  std::string size = std::to_string(n.page_size), count = std::to_string(n.page_count), t = ms(ttl);
  return redis_.eval(kRegister, {prefix_}, {n.id, n.epoch, size, count, n.address, n.key, t}).status();
}

Status PagePool::heartbeat(std::string_view id, std::string_view epoch, std::chrono::milliseconds ttl) {
  std::string t = ms(ttl);
  return redis_.eval(kHeartbeat, {prefix_}, {id, epoch, t}).status();
}

Result<std::vector<Extent>> PagePool::allocate(std::uint64_t pages) {
  if (pages == 0) return std::vector<Extent>{};
  std::string n = std::to_string(pages);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(kAllocate, {prefix_}, {n}));
  if (r.type() != Reply::Type::kArray || r.size() != pages * 3) {
    return Status::corrupt("page pool: unexpected reply to allocate");
  }
  std::vector<Extent> out;
  out.reserve(pages);
  for (std::size_t i = 0; i < r.size(); i += 3) {
    const redisReply* node = r.element(i);
    const redisReply* page = r.element(i + 1);
    const redisReply* gen = r.element(i + 2);
    if (node->type != REDIS_REPLY_STRING || page->type != REDIS_REPLY_INTEGER || gen->type != REDIS_REPLY_INTEGER ||
        page->integer < 0 || gen->integer <= 0) {
      return Status::corrupt("page pool: malformed extent in the reply to allocate");
    }
    Extent e;
    e.node = std::string(node->str, node->len);
    e.page = static_cast<std::uint64_t>(page->integer);
    e.generation = gen->integer;
    out.push_back(std::move(e));
  }
  return out;
}

Status PagePool::free(std::span<const Extent> extents) {
  if (extents.empty()) return {};
  std::vector<std::string> storage;
  storage.reserve(extents.size() * 3);
  for (const Extent& e : extents) {
    storage.push_back(e.node);
    storage.push_back(std::to_string(e.page));
    storage.push_back(std::to_string(e.generation));
  }
  std::vector<std::string_view> args(storage.begin(), storage.end());
  return redis_.eval(kFree, {prefix_}, args).status();
}

Result<std::uint64_t> PagePool::free_pages(std::string_view node) {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(kFreePages, {prefix_}, {node}));
  return static_cast<std::uint64_t>(r.integer());
}

}  // namespace kvstash::metadata
