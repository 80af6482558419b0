// kvstash events: KV events for cache-aware routers (docs/events.md). The cell's scripts log
// each announced object's stored and removed events to a capped Redis stream; `kvstash events
// serve` follows it and publishes them as vLLM does (KVEventBatch of BlockStored, BlockRemoved
// and AllBlocksCleared, msgpack over a ZMQ PUB socket, multipart topic / 8-byte big-endian
// sequence / payload, with vLLM's replay socket), so that a router's indexer takes the cell for
// one more instance. Whenever it cannot know that the stream continues what it published (its
// own start, a failover, a Redis that lost its data, entries trimmed before it read them) it
// publishes AllBlocksCleared and then every announced object present as BlockStored.
#include <hiredis/hiredis.h>
#include <msgpack.h>
#include <pthread.h>
#include <zmq.h>
#include <CLI/CLI.hpp>

#include <fmt/format.h>
#include <atomic>
#include <charconv>
#include <csignal>
#include <deque>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "cli.h"
#include "metadata/cell.h"
#include "metadata/redis_client.h"

namespace kvstash::cli {
namespace {

using metadata::RedisClient;
using metadata::Reply;
using std::chrono::milliseconds;

struct EventsOptions {
  std::string pub = "tcp://127.0.0.1:5557";
  std::string replay;  // vLLM's replay endpoint (ROUTER); none by default
  std::string topic;
  std::string medium = "CPU";
  std::string format = "map";  // vLLM's events as msgspec encodes them: "map" (0.32-0.34), "array" (older)
  int dp_rank = -1;            // KVEventBatch.data_parallel_rank; omitted when negative
  std::uint64_t maxlen = 100000;
  std::size_t buffer = 10000;  // batches kept for replay
  std::size_t batch = 256;     // events per batch at most
  double seconds = 0;          // serve for this long (0: until SIGINT or SIGTERM)
  bool token_ids = false;      // BlockStored carries the prompt's token ids (else an empty list)
  bool public_bind = false;    // --pub / --replay may bind beyond loopback
};

// Whether a ZMQ endpoint stays on this host: ipc:// and inproc://, or tcp:// on a loopback
// address. The relay's sockets have no authentication, and its events name prompts' blocks.
bool loopback_endpoint(std::string_view e) {
  if (e.starts_with("ipc://") || e.starts_with("inproc://")) return true;
  if (!e.starts_with("tcp://")) return false;
  std::string_view host = e.substr(6);
  host = host.substr(0, host.rfind(':'));
  if (host.starts_with("[") && host.ends_with("]")) host = host.substr(1, host.size() - 2);
  return host == "localhost" || host == "::1" || host.starts_with("127.");
}

// The relay's lines for its operator, on stderr.
void say(const std::string& line) { std::cerr << "kvstash events: " << line << "\n"; }

std::string_view text(const redisReply* r) {
  if (r == nullptr || (r->type != REDIS_REPLY_STRING && r->type != REDIS_REPLY_STATUS)) return {};
  return {r->str, r->len};
}

std::optional<std::int64_t> integer(const redisReply* r) {
  if (r == nullptr) return std::nullopt;
  if (r->type == REDIS_REPLY_INTEGER) return r->integer;
  const std::string_view t = text(r);
  if (t.empty()) return std::nullopt;
  std::int64_t v = 0;
  auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (ec != std::errc() || p != t.data() + t.size()) return std::nullopt;
  return v;
}

// ---- Encoding, as vLLM's msgspec structs (array_like, tagged, omit_defaults) ---------------

class Packer {
 public:
  Packer() {
    msgpack_sbuffer_init(&buf_);
    msgpack_packer_init(&pk_, &buf_, msgpack_sbuffer_write);
  }
  ~Packer() { msgpack_sbuffer_destroy(&buf_); }
  Packer(const Packer&) = delete;
  Packer& operator=(const Packer&) = delete;
  msgpack_packer* pk() { return &pk_; }
  void str(std::string_view s) {
    msgpack_pack_str(&pk_, s.size());
    msgpack_pack_str_body(&pk_, s.data(), s.size());
  }
  std::string take() const { return {buf_.data, buf_.size}; }

 private:
  msgpack_sbuffer buf_;
  msgpack_packer pk_;
};

// An object's event data as the client gave it: msgpack [block_hashes, parent_block_hash,
// token_ids, block_size, lora_id, lora_name], checked for the types BlockStored needs.
class EventData {
 public:
  explicit EventData(std::string_view bytes) {
    msgpack_unpacked_init(&u_);
    std::size_t off = 0;
    ok_ = msgpack_unpack_next(&u_, bytes.data(), bytes.size(), &off) == MSGPACK_UNPACK_SUCCESS &&
          off == bytes.size() && well_formed(u_.data);
  }
  ~EventData() { msgpack_unpacked_destroy(&u_); }
  EventData(const EventData&) = delete;
  EventData& operator=(const EventData&) = delete;
  bool ok() const { return ok_; }
  static constexpr std::uint32_t kFields = 6;
  // BlockStored's fields, in its order.
  static constexpr const char* kNames[kFields] = {"block_hashes", "parent_block_hash", "token_ids",
                                                  "block_size",   "lora_id",           "lora_name"};
  const msgpack_object& field(int i) const { return u_.data.via.array.ptr[i]; }

 private:
  static bool is_hash(const msgpack_object& o) {
    return o.type == MSGPACK_OBJECT_POSITIVE_INTEGER || o.type == MSGPACK_OBJECT_NEGATIVE_INTEGER ||
           o.type == MSGPACK_OBJECT_BIN || o.type == MSGPACK_OBJECT_STR;
  }
  static bool well_formed(const msgpack_object& o) {
    if (o.type != MSGPACK_OBJECT_ARRAY || o.via.array.size != kFields) return false;
    const msgpack_object* f = o.via.array.ptr;
    if (f[0].type != MSGPACK_OBJECT_ARRAY || f[0].via.array.size == 0) return false;
    for (std::uint32_t i = 0; i < f[0].via.array.size; ++i) {
      if (!is_hash(f[0].via.array.ptr[i])) return false;
    }
    if (f[1].type != MSGPACK_OBJECT_NIL && !is_hash(f[1])) return false;
    if (f[2].type != MSGPACK_OBJECT_ARRAY) return false;
    for (std::uint32_t i = 0; i < f[2].via.array.size; ++i) {
      if (f[2].via.array.ptr[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER) return false;
    }
    if (f[3].type != MSGPACK_OBJECT_POSITIVE_INTEGER || f[3].via.u64 == 0) return false;
    if (f[4].type != MSGPACK_OBJECT_NIL && f[4].type != MSGPACK_OBJECT_POSITIVE_INTEGER) return false;
    return f[5].type == MSGPACK_OBJECT_NIL || f[5].type == MSGPACK_OBJECT_STR;
  }
  msgpack_unpacked u_;
  bool ok_ = false;
};

// A batch's events, each already encoded.
struct Batch {
  std::vector<std::string> events;
};

// The events, as msgspec encodes vLLM's tagged structs: a map whose "type" is the tag (vLLM
// 0.32 to 0.34, the releases tested), or an array that starts with it (older releases, whose
// KVCacheEvent was array_like; no lora_name then).
class EventEncoder {
 public:
  explicit EventEncoder(const EventsOptions& o)
      : medium_(o.medium), map_(o.format == "map"), token_ids_(o.token_ids) {}

  std::string stored(const EventData& d) const {
    Packer p;
    // The token ids are the prompt's text, near enough: only with --token-ids.
    const auto field = [&](std::uint32_t i) {
      if (i == 2 && !token_ids_) {
        msgpack_pack_array(p.pk(), 0);
      } else {
        msgpack_pack_object(p.pk(), d.field(i));
      }
    };
    if (!map_) {
      msgpack_pack_array(p.pk(), 7);
      p.str("BlockStored");
      for (std::uint32_t i = 0; i < 5; ++i) field(i);
      p.str(medium_);
      return p.take();
    }
    msgpack_pack_map(p.pk(), 2 + EventData::kFields + 1);
    p.str("type");
    p.str("BlockStored");
    for (std::uint32_t i = 0; i < EventData::kFields; ++i) {
      p.str(EventData::kNames[i]);
      field(i);
    }
    p.str("medium");
    p.str(medium_);
    p.str("group_idx");  // kvstash keeps a model's one group of full-attention layers
    msgpack_pack_int(p.pk(), 0);
    return p.take();
  }

  std::string removed(const EventData& d) const {
    Packer p;
    if (!map_) {
      msgpack_pack_array(p.pk(), 3);
      p.str("BlockRemoved");
      msgpack_pack_object(p.pk(), d.field(0));
      p.str(medium_);
      return p.take();
    }
    msgpack_pack_map(p.pk(), 4);
    p.str("type");
    p.str("BlockRemoved");
    p.str("block_hashes");
    msgpack_pack_object(p.pk(), d.field(0));
    p.str("medium");
    p.str(medium_);
    p.str("group_idx");
    msgpack_pack_int(p.pk(), 0);
    return p.take();
  }

  std::string cleared() const {
    Packer p;
    if (map_) {
      msgpack_pack_map(p.pk(), 1);
      p.str("type");
    } else {
      msgpack_pack_array(p.pk(), 1);
    }
    p.str("AllBlocksCleared");
    return p.take();
  }

 private:
  std::string medium_;
  bool map_;
  bool token_ids_;
};

// KVEventBatch [ts, events] (+ data_parallel_rank when there is one).
std::string event_batch(const Batch& b, int dp_rank) {
  Packer p;
  msgpack_pack_array(p.pk(), dp_rank >= 0 ? 3 : 2);
  const double ts =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  msgpack_pack_double(p.pk(), ts);
  msgpack_pack_array(p.pk(), b.events.size());
  std::string out = p.take();
  for (const auto& e : b.events) out += e;
  if (dp_rank >= 0) {
    Packer r;
    msgpack_pack_int64(r.pk(), dp_rank);
    out += r.take();
  }
  return out;
}

// ---- The ZMQ side ------------------------------------------------------------------------

std::string big_endian(std::int64_t v) {
  std::string s(8, '\0');
  for (int i = 7; i >= 0; --i, v >>= 8) s[i] = static_cast<char>(v & 0xff);
  return s;
}

// The PUB socket and vLLM's replay service: a ROUTER that answers [client, "", start seq] with
// every kept batch from that sequence on, each as [client, "", topic, seq, payload], then
// [client, "", "", -1, ""].
class Publisher {
 public:
  static Result<std::unique_ptr<Publisher>> open(const EventsOptions& o) {
    auto p = std::unique_ptr<Publisher>(new Publisher(o));
    KVSTASH_RETURN_IF_ERROR(p->bind());
    return p;
  }
  ~Publisher() {
    stop_ = true;
    if (replay_thread_.joinable()) replay_thread_.join();
    if (pub_ != nullptr) zmq_close(pub_);
    if (replay_ != nullptr) zmq_close(replay_);
    zmq_ctx_term(ctx_);
  }
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  void publish(const Batch& b) {
    if (b.events.empty()) return;
    const std::string payload = event_batch(b, o_.dp_rank);
    std::lock_guard lock(mu_);
    const std::int64_t seq = next_seq_++;
    const std::string s = big_endian(seq);
    zmq_send(pub_, o_.topic.data(), o_.topic.size(), ZMQ_SNDMORE);
    zmq_send(pub_, s.data(), s.size(), ZMQ_SNDMORE);
    zmq_send(pub_, payload.data(), payload.size(), 0);
    kept_.emplace_back(seq, payload);
    while (kept_.size() > o_.buffer) kept_.pop_front();
    ++batches_;
    events_ += b.events.size();
  }
  std::uint64_t batches() const { return batches_; }
  std::uint64_t events() const { return events_; }

 private:
  explicit Publisher(const EventsOptions& o) : o_(o), ctx_(zmq_ctx_new()) {}

  Status bind() {
    pub_ = zmq_socket(ctx_, ZMQ_PUB);
    const int linger = 0;
    zmq_setsockopt(pub_, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_bind(pub_, o_.pub.c_str()) != 0) {
      return Status::invalid_argument("--pub " + o_.pub + ": " + zmq_strerror(zmq_errno()));
    }
    if (o_.replay.empty()) return {};
    replay_ = zmq_socket(ctx_, ZMQ_ROUTER);
    zmq_setsockopt(replay_, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_bind(replay_, o_.replay.c_str()) != 0) {
      return Status::invalid_argument("--replay " + o_.replay + ": " + zmq_strerror(zmq_errno()));
    }
    replay_thread_ = std::thread([this] { serve_replay(); });
    return {};
  }

  static std::optional<std::vector<std::string>> receive(void* socket) {
    std::vector<std::string> frames;
    int more = 1;
    while (more) {
      zmq_msg_t m;
      zmq_msg_init(&m);
      if (zmq_msg_recv(&m, socket, 0) < 0) {
        zmq_msg_close(&m);
        return std::nullopt;
      }
      frames.emplace_back(static_cast<const char*>(zmq_msg_data(&m)), zmq_msg_size(&m));
      more = zmq_msg_more(&m);
      zmq_msg_close(&m);
    }
    return frames;
  }

  void reply(const std::string& client, std::string_view topic, const std::string& seq,
             const std::string& payload) {
    zmq_send(replay_, client.data(), client.size(), ZMQ_SNDMORE);
    zmq_send(replay_, "", 0, ZMQ_SNDMORE);
    zmq_send(replay_, topic.data(), topic.size(), ZMQ_SNDMORE);
    zmq_send(replay_, seq.data(), seq.size(), ZMQ_SNDMORE);
    zmq_send(replay_, payload.data(), payload.size(), 0);
  }

  void serve_replay() {
    zmq_pollitem_t item{replay_, 0, ZMQ_POLLIN, 0};
    while (!stop_) {
      if (zmq_poll(&item, 1, 100) <= 0 || !(item.revents & ZMQ_POLLIN)) continue;
      auto frames = receive(replay_);
      if (!frames) continue;
      if (frames->size() != 3 || (*frames)[2].size() != 8) {
        say(fmt::format("a replay request of {} frames, not [id, '', start seq]: ignored", frames->size()));
        continue;
      }
      std::int64_t start = 0;
      for (unsigned char c : (*frames)[2]) start = (start << 8) | c;
      std::vector<std::pair<std::int64_t, std::string>> out;
      {
        std::lock_guard lock(mu_);
        for (const auto& [seq, payload] : kept_) {
          if (seq >= start) out.emplace_back(seq, payload);
        }
      }
      for (const auto& [seq, payload] : out) reply((*frames)[0], o_.topic, big_endian(seq), payload);
      reply((*frames)[0], "", big_endian(-1), "");
    }
  }

  const EventsOptions& o_;
  void* ctx_;
  void* pub_ = nullptr;
  void* replay_ = nullptr;
  std::mutex mu_;  // next_seq_, kept_, the PUB socket
  std::int64_t next_seq_ = 0;
  std::deque<std::pair<std::int64_t, std::string>> kept_;
  std::atomic<bool> stop_{false};
  std::thread replay_thread_;
  std::atomic<std::uint64_t> batches_{0}, events_{0};
};

// ---- Following the cell's stream ---------------------------------------------------------

// The stream's position: its last id, and how many entries it had taken (XINFO STREAM's
// last-generated-id and entries-added; "0-0" and 0 for a stream that does not exist).
struct StreamPos {
  std::string last_id = "0-0";
  std::int64_t added = 0, length = 0;
};

class Relay {
 public:
  Relay(metadata::Cell& cell, Publisher& pub, const EventsOptions& o)
      : redis_(cell.redis()), pub_(pub), o_(o), enc_(o), p_(cell.prefix()) {}

  // One step: a resync when the stream cannot be trusted to go on from where this relay read,
  // else the entries since (waiting up to `wait`).
  Status step(milliseconds wait) {
    KVSTASH_ASSIGN_OR_RETURN(std::optional<std::string> epoch, current_epoch());
    if (!synced_ || epoch != epoch_) {
      if (synced_) {
        say(fmt::format("the cell's epoch changed ({} -> {}): all cleared, resync", epoch_.value_or("none"),
                        epoch.value_or("none")));
      }
      return resync();
    }
    KVSTASH_ASSIGN_OR_RETURN(
        Reply r, redis_.command({"XREAD", "COUNT", std::to_string(o_.batch), "BLOCK",
                                 std::to_string(wait.count()), "STREAMS", p_ + ":events:log", pos_.last_id}));
    Batch b;
    if (r.type() == Reply::Type::kArray && r.size() == 1) {
      const redisReply* entries = r.element(0)->element[1];
      for (std::size_t i = 0; i < entries->elements; ++i) {
        const redisReply* e = entries->element[i];
        if (Status added = add(b, e->element[1]); !added.is_ok()) {
          pub_.publish(b);  // what was read and checked so far; this entry comes again
          return added;
        }
        pos_.last_id = std::string(text(e->element[0]));
        ++read_;
      }
    }
    pub_.publish(b);  // before anything else can fail: these entries are read
    // Entries trimmed before this relay read them, or the log gone (turned off and on again
    // between two steps, in the same epoch): what routers know may have gaps. Checked when
    // nothing came too.
    KVSTASH_ASSIGN_OR_RETURN(StreamPos now, position());
    if (now.added - base_added_ - read_ > now.length || now.added < base_added_) {
      say(fmt::format("{} events were trimmed before they were read (raise --maxlen): all cleared, resync",
                      now.added - base_added_ - read_ - now.length));
      return resync();
    }
    return {};
  }

  std::uint64_t resyncs() const { return resyncs_; }
  std::uint64_t malformed() const { return malformed_; }
  std::uint64_t unbacked() const { return unbacked_; }

 private:
  // The cell's events epoch; events turned on (maxlen) when they are off.
  Result<std::optional<std::string>> current_epoch() {
    const std::string k = p_ + ":events";
    KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.command({"HMGET", k, "maxlen", "epoch"}));
    if (r.type() != Reply::Type::kArray || r.size() != 2)
      return Status::corrupt("unexpected reply to HMGET " + k);
    if (r.element(0)->type == REDIS_REPLY_NIL) {
      // Off (never on, or a Redis that lost its data): on again, in a new epoch.
      say(fmt::format("events were off in the cell: on, keeping about {} events", o_.maxlen));
      KVSTASH_RETURN_IF_ERROR(redis_.command({"HSET", k, "maxlen", std::to_string(o_.maxlen)}).status());
      KVSTASH_RETURN_IF_ERROR(redis_.command({"HINCRBY", k, "epoch", "1"}).status());
      return current_epoch();
    }
    if (r.element(1)->type == REDIS_REPLY_NIL) return std::optional<std::string>{};
    return std::optional<std::string>{std::string(text(r.element(1)))};
  }

  Result<StreamPos> position() {
    StreamPos pos;
    auto r = redis_.command({"XINFO", "STREAM", p_ + ":events:log"});
    if (!r.is_ok()) {
      if (r.status().message().find("no such key") != std::string_view::npos) return pos;
      return r.status();
    }
    for (std::size_t i = 0; i + 1 < r->size(); i += 2) {
      const std::string_view name = text(r->element(i));
      if (name == "last-generated-id") pos.last_id = std::string(text(r->element(i + 1)));
      if (name == "entries-added") pos.added = integer(r->element(i + 1)).value_or(0);
      if (name == "length") pos.length = integer(r->element(i + 1)).value_or(0);
    }
    return pos;
  }

  // An entry's fields (t, k, ev, why) as an event of the batch, if the cell's record agrees:
  // a stored object holds that event data now, a removed one does not. The log is a stream a
  // client with XADD can write to; an entry no script made (a chunk that does not exist, data
  // another object's record does not hold) is skipped, counted and said once.
  Status add(Batch& b, const redisReply* fields) {
    std::string_view kind, key, ev;
    for (std::size_t i = 0; i + 1 < fields->elements; i += 2) {
      const std::string_view f = text(fields->element[i]);
      if (f == "t") kind = text(fields->element[i + 1]);
      if (f == "k") key = text(fields->element[i + 1]);
      if (f == "ev") ev = text(fields->element[i + 1]);
    }
    KVSTASH_ASSIGN_OR_RETURN(Reply held, redis_.command({"HGET", p_ + ":obj:" + std::string(key), "ev"}));
    const bool holds = !held.is_nil() && held.str() == ev;
    if ((kind == "stored" && !holds) || (kind == "removed" && holds)) {
      if (unbacked_++ == 0) {
        say(fmt::format(
            "a {} event of {} that the cell's record does not back was skipped (a stream entry no "
            "script wrote, or one overtaken since)",
            kind, key));
      }
      return {};
    }
    push(b, kind, ev);
    return {};
  }

  // A stored or removed event of `ev` (an object's event data) into the batch, which goes out
  // once full; false, counted and said once, for anything malformed.
  bool push(Batch& b, std::string_view kind, std::string_view ev) {
    EventData d(ev);
    if (!d.ok() || (kind != "stored" && kind != "removed")) {
      if (malformed_++ == 0) say("an event with malformed data was skipped (docs/events.md)");
      return false;
    }
    b.events.push_back(kind == "stored" ? enc_.stored(d) : enc_.removed(d));
    if (b.events.size() >= o_.batch) flush(b);
    return true;
  }

  void flush(Batch& b) {
    pub_.publish(b);
    b.events.clear();
  }

  // AllBlocksCleared, then every announced object present as BlockStored, then on from the
  // stream position taken before the scan (what changed during it comes again, in order).
  Status resync() {
    synced_ = false;  // until the restatement is whole: a failure part way starts it over
    KVSTASH_ASSIGN_OR_RETURN(epoch_, current_epoch());
    KVSTASH_ASSIGN_OR_RETURN(pos_, position());
    base_added_ = pos_.added;
    read_ = 0;
    Batch b;
    b.events.push_back(enc_.cleared());
    flush(b);
    std::string cursor = "0";
    std::size_t objects = 0;
    do {
      KVSTASH_ASSIGN_OR_RETURN(Reply r,
                               redis_.command({"SSCAN", p_ + ":events:objs", cursor, "COUNT", "512"}));
      if (r.type() != Reply::Type::kArray || r.size() != 2)
        return Status::corrupt("unexpected reply to SSCAN");
      cursor = std::string(text(r.element(0)));
      const redisReply* keys = r.element(1);
      for (std::size_t i = 0; i < keys->elements; ++i) {
        KVSTASH_ASSIGN_OR_RETURN(
            Reply ev, redis_.command({"HGET", p_ + ":obj:" + std::string(text(keys->element[i])), "ev"}));
        if (ev.is_nil()) continue;  // removed since: its removed event follows
        objects += push(b, "stored", ev.str());
      }
    } while (cursor != "0");
    flush(b);
    synced_ = true;
    ++resyncs_;
    say(fmt::format("all cleared, then {} objects stored; following from {}", objects, pos_.last_id));
    return {};
  }

  RedisClient& redis_;
  Publisher& pub_;
  const EventsOptions& o_;
  const EventEncoder enc_;
  const std::string p_;
  bool synced_ = false;
  std::optional<std::string> epoch_;
  StreamPos pos_;
  std::int64_t base_added_ = 0, read_ = 0;
  std::uint64_t resyncs_ = 0, malformed_ = 0, unbacked_ = 0;
};

int serve(Session& s, const EventsOptions& o) {
  // SIGINT and SIGTERM end the relay: blocked here (every thread inherits the mask), taken by
  // one thread that asks the loop to stop.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  std::atomic<bool> stop{false};
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    stop = true;
  });
  auto finish = [&](int code) {
    if (!stop.exchange(true)) pthread_kill(waiter.native_handle(), SIGTERM);
    waiter.join();
    return code;
  };

  for (const auto& [flag, endpoint] : {std::pair{"--pub", o.pub}, std::pair{"--replay", o.replay}}) {
    if (!endpoint.empty() && !o.public_bind && !loopback_endpoint(endpoint)) {
      return finish(
          fail(Status::invalid_argument(std::string(flag) + " " + endpoint +
                                        " binds beyond loopback, and the relay's ZMQ sockets have no "
                                        "authentication: anyone who reaches them reads every event. "
                                        "Bind loopback (and tunnel), or say --public"),
               "events serve", &s));
    }
  }
  auto cell = s.cell();
  if (!cell.is_ok()) return finish(fail(cell.status(), "events serve", &s));
  auto pub = Publisher::open(o);
  if (!pub.is_ok()) return finish(fail(pub.status(), "events serve", &s));
  Relay relay(**cell, **pub, o);
  std::cerr << "kvstash events: publishing cell " << (*cell)->name() << "'s KV events on " << o.pub
            << (o.replay.empty() ? "" : ", replay on " + o.replay) << "\n";
  const auto until =
      o.seconds > 0 ? std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<milliseconds>(std::chrono::duration<double>(o.seconds))
                    : std::chrono::steady_clock::time_point::max();
  milliseconds backoff{100};
  while (!stop && std::chrono::steady_clock::now() < until) {
    Status st = relay.step(milliseconds(200));
    if (st.is_ok()) {
      backoff = milliseconds(100);
      continue;
    }
    // Redis away (a restart, a failover in progress): keep the sockets, try again.
    say(fmt::format("{}: again in {} ms", st.to_string(), backoff.count()));
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, milliseconds(2000));
  }
  std::cerr << "kvstash events: published " << (*pub)->events() << " events in " << (*pub)->batches()
            << " batches; " << relay.resyncs() << " resyncs, " << relay.malformed() << " malformed, "
            << relay.unbacked() << " not backed by the cell\n";
  return finish(kExitOk);
}

int show(Session& s) {
  auto cell = s.cell();
  if (!cell.is_ok()) return fail(cell.status(), "events", &s);
  RedisClient& r = (*cell)->redis();
  const std::string p = (*cell)->prefix();
  auto cfg = r.command({"HMGET", p + ":events", "maxlen", "epoch"});
  auto objs = r.command({"SCARD", p + ":events:objs"});
  auto len = r.command({"XLEN", p + ":events:log"});
  for (const Status& st : {cfg.status(), objs.status(), len.status()}) {
    if (!st.is_ok()) return fail(st, "events", &s);
  }
  const bool on = cfg->size() == 2 && cfg->element(0)->type != REDIS_REPLY_NIL;
  nlohmann::json j{{"on", on},
                   {"maxlen", on ? integer(cfg->element(0)).value_or(0) : 0},
                   {"epoch", on ? integer(cfg->element(1)).value_or(0) : 0},
                   {"announced_objects", objs->integer()},
                   {"log_entries", len->integer()}};
  if (s.json()) {
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << "events:            "
              << (on ? "on" : "off (`kvstash events on`, or a running `kvstash events serve`)") << "\n";
    if (on)
      std::cout << "log:               " << j["log_entries"] << " entries, about " << j["maxlen"] << " kept\n"
                << "epoch:             " << j["epoch"] << "\n";
    std::cout << "announced objects: " << j["announced_objects"] << "\n";
  }
  return kExitOk;
}

int turn(Session& s, bool on, std::uint64_t maxlen) {
  auto cell = s.cell();
  if (!cell.is_ok()) return fail(cell.status(), on ? "events on" : "events off", &s);
  RedisClient& r = (*cell)->redis();
  const std::string p = (*cell)->prefix();
  Status st = on ? r.command({"HSET", p + ":events", "maxlen", std::to_string(maxlen)}).status()
                 : r.command({"DEL", p + ":events", p + ":events:log", p + ":events:objs"}).status();
  if (!st.is_ok()) return fail(st, on ? "events on" : "events off", &s);
  std::cout << "events " << (on ? "on, keeping about " + std::to_string(maxlen) + " events" : "off") << "\n";
  return kExitOk;
}

}  // namespace

void add_events_command(Registry& r) {
  Session& s = r.session;
  auto o = std::make_shared<EventsOptions>();
  auto* ev = r.app.add_subcommand("events",
                                  "KV events for cache-aware routers: state, on/off, and the relay (serve)");
  ev->final_callback([&r, &s, ev] {
    if (ev->get_subcommands().empty()) r.action = [&s] { return show(s); };
  });
  auto* on = ev->add_subcommand("on", "Log announced objects' stored and removed events in the cell");
  on->add_option("--maxlen", o->maxlen, "Events the cell's log keeps, about")->capture_default_str();
  on->final_callback([&r, &s, o] { r.action = [&s, o] { return turn(s, true, o->maxlen); }; });
  auto* off =
      ev->add_subcommand("off", "Stop logging events and drop the log (a running relay turns them on again)");
  off->final_callback([&r, &s] { r.action = [&s] { return turn(s, false, 0); }; });
  auto* sv = ev->add_subcommand(
      "serve", "Publish the cell's KV events as vLLM does (msgpack KVEventBatch over ZMQ PUB)");
  sv->add_option("--pub", o->pub, "ZMQ endpoint the PUB socket binds")->capture_default_str();
  sv->add_option("--replay", o->replay, "ZMQ endpoint of vLLM's replay socket (ROUTER); none when empty");
  sv->add_option("--topic", o->topic, "Topic frame of every message (vLLM's default: empty)");
  sv->add_option("--medium", o->medium, "BlockStored/BlockRemoved medium")->capture_default_str();
  sv->add_option("--format", o->format,
                 "Events as vLLM encodes them: map (vLLM 0.32-0.34), array (older releases)")
      ->capture_default_str()
      ->check(CLI::IsMember({"map", "array"}));
  sv->add_option("--dp-rank", o->dp_rank, "KVEventBatch data_parallel_rank (omitted when negative)")
      ->capture_default_str();
  sv->add_option("--maxlen", o->maxlen,
                 "When events are off in the cell: turn them on keeping about this many")
      ->capture_default_str();
  sv->add_option("--buffer", o->buffer, "Batches kept for replay")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sv->add_option("--batch", o->batch, "Events per batch at most")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sv->add_option("--seconds", o->seconds, "Serve this long (0: until SIGINT or SIGTERM)")
      ->capture_default_str();
  sv->add_flag("--token-ids", o->token_ids,
               "BlockStored carries each block's token ids (the prompt's text, near enough); without it, an "
               "empty list (routers match blocks by their hashes)");
  sv->add_flag("--public", o->public_bind,
               "Let --pub and --replay bind beyond loopback: ZMQ here has no authentication, so anyone who "
               "reaches them reads every event");
  sv->footer(
      "Examples:\n"
      "  kvstash events serve --pub tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558\n"
      "  kvstash events serve --pub tcp://10.0.0.5:5557 --public   # a router on another host\n"
      "  kvstash events --json");
  sv->final_callback([&r, &s, o] { r.action = [&s, o] { return serve(s, *o); }; });
}

}  // namespace kvstash::cli
