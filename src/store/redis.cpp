// The store's Redis client (src/store/redis.h): hiredis for the wire
// protocol, the cluster routing written here.
#include "store/redis.h"

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <map>
#include <mutex>

namespace kvtc::detail {
namespace {

using Clock = std::chrono::steady_clock;

struct Endpoint {
  std::string host;
  int port = 6379;
  bool operator<(const Endpoint& o) const { return host != o.host ? host < o.host : port < o.port; }
  bool operator==(const Endpoint& o) const { return host == o.host && port == o.port; }
  std::string str() const { return host + ":" + std::to_string(port); }
};

int parse_port(const std::string& s, const std::string& what) {
  size_t used = 0;
  int p = -1;
  try {
    p = std::stoi(s, &used);
  } catch (const std::exception&) {
  }
  require(used == s.size() && p > 0 && p < 65536, what + ": port '" + s + "' is not a number in 1..65535");
  return p;
}

Endpoint parse_hostport(const std::string& s, const std::string& what) {
  const size_t c = s.rfind(':');
  Endpoint e;
  e.host = s.substr(0, c);
  if (c != std::string::npos) e.port = parse_port(s.substr(c + 1), what);
  if (e.host.size() > 2 && e.host.front() == '[' && e.host.back() == ']') e.host = e.host.substr(1, e.host.size() - 2);
  require(!e.host.empty(), what + ": no host in '" + s + "'");
  return e;
}

timeval tv_of(int ms) {
  return timeval{ms / 1000, (ms % 1000) * 1000};
}

RedisReply convert(const redisReply* r) {
  RedisReply o;
  switch (r->type) {
    case REDIS_REPLY_STRING:
      o.type = RedisReply::Type::kString;
      o.str.assign(r->str, r->len);
      break;
    case REDIS_REPLY_STATUS:
      o.type = RedisReply::Type::kStatus;
      o.str.assign(r->str, r->len);
      break;
    case REDIS_REPLY_ERROR:
      o.type = RedisReply::Type::kError;
      o.str.assign(r->str, r->len);
      break;
    case REDIS_REPLY_INTEGER:
      o.type = RedisReply::Type::kInteger;
      o.integer = r->integer;
      break;
    case REDIS_REPLY_ARRAY:
      o.type = RedisReply::Type::kArray;
      for (size_t i = 0; i < r->elements; ++i) o.elements.push_back(convert(r->element[i]));
      break;
    default: o.type = RedisReply::Type::kNil;
  }
  return o;
}

// One connection to one server.
struct Conn {
  Endpoint at;
  redisContext* c = nullptr;
  ~Conn() { close(); }
  void close() {
    if (c) redisFree(c);
    c = nullptr;
  }
};

// Writing to a connection the server closed raises SIGPIPE, which kills the
// process unless the program ignores it; a library must not change the
// program's handlers, so the calling thread blocks it while it talks to
// Redis and takes back a SIGPIPE raised meanwhile (the error itself comes
// back from hiredis as EPIPE).
class NoSigpipe {
 public:
  NoSigpipe() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~NoSigpipe() {
    if (!was_pending_) {
      sigset_t pending;
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        const timespec zero{0, 0};
        (void)sigtimedwait(&pipe_, nullptr, &zero);
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }

 private:
  sigset_t pipe_, old_;
  bool was_pending_ = false;
};

}  // namespace

struct Redis::Impl {
  RedisOptions opt;
  bool is_cluster = false;
  std::string user, password;
  int db = 0;
  std::vector<Endpoint> seeds;  // the one server, or the cluster's seeds
  std::map<Endpoint, std::unique_ptr<Conn>> conns;
  std::vector<int16_t> slot_node;  // cluster: slot -> index in `nodes`, -1 unknown
  std::vector<Endpoint> nodes;
  bool map_stale = true;
  Clock::time_point down_until{};
  std::string down_why;
  std::atomic<uint64_t> redirects{0}, refreshes{0};  // read by stats() from other threads

  [[noreturn]] void down(const std::string& why) {
    down_until = Clock::now() + std::chrono::milliseconds(opt.retry_ms);
    down_why = why;
    map_stale = true;
    throw RedisDown("redis " + describe() + ": " + why);
  }

  std::string describe() const {
    if (!is_cluster) return "redis://" + seeds[0].str() + "/" + std::to_string(db);
    std::string s = "cluster ";
    for (size_t i = 0; i < seeds.size(); ++i) s += (i ? "," : "") + seeds[i].str();
    return s;
  }

  // A connected context for `e`; throws RedisDown when it cannot connect.
  Conn& conn(const Endpoint& e) {
    auto& p = conns[e];
    if (!p) p = std::make_unique<Conn>();
    Conn& k = *p;
    k.at = e;
    if (k.c) return k;
    k.c = redisConnectWithTimeout(e.host.c_str(), e.port, tv_of(opt.connect_timeout_ms));
    if (!k.c || k.c->err) {
      const std::string why = k.c ? k.c->errstr : "out of memory";
      k.close();
      down(e.str() + ": cannot connect: " + why);
    }
    redisSetTimeout(k.c, tv_of(opt.timeout_ms));
    std::vector<RedisCommand> hello;
    if (!password.empty()) hello.push_back(user.empty() ? RedisCommand{"AUTH", password} : RedisCommand{"AUTH", user, password});
    if (db != 0) hello.push_back({"SELECT", std::to_string(db)});
    if (!hello.empty()) {
      const auto r = exchange(k, hello);
      for (const RedisReply& x : r)
        if (!x.ok()) {
          k.close();
          throw RedisError("redis " + e.str() + ": " + x.str);
        }
    }
    return k;
  }

  // Sends a pipeline on one connection and reads every reply.
  std::vector<RedisReply> exchange(Conn& k, const std::vector<RedisCommand>& cmds) {
    send(k, cmds);
    return receive(k, cmds.size());
  }
  void send(Conn& k, const std::vector<RedisCommand>& cmds) {
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const RedisCommand& c : cmds) {
      argv.clear();
      lens.clear();
      for (const std::string& a : c) {
        argv.push_back(a.data());
        lens.push_back(a.size());
      }
      if (redisAppendCommandArgv(k.c, int(argv.size()), argv.data(), lens.data()) != REDIS_OK) {
        const std::string why = k.c->errstr;
        k.close();
        down(k.at.str() + ": " + why);
      }
    }
  }
  std::vector<RedisReply> receive(Conn& k, size_t n) {
    std::vector<RedisReply> out;
    out.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      void* r = nullptr;
      if (redisGetReply(k.c, &r) != REDIS_OK || !r) {
        const std::string why = k.c->err ? k.c->errstr : "no reply";
        k.close();  // the stream is out of step now: a fresh connection next time
        down(k.at.str() + ": " + why);
      }
      out.push_back(convert(static_cast<redisReply*>(r)));
      freeReplyObject(r);
    }
    return out;
  }

  // ---------------------------------------------------------------- cluster
  int node_index(const Endpoint& e) {
    for (size_t i = 0; i < nodes.size(); ++i)
      if (nodes[i] == e) return int(i);
    nodes.push_back(e);
    return int(nodes.size() - 1);
  }

  // CLUSTER SLOTS from the first node that answers (known nodes, then seeds).
  void refresh_map() {
    std::vector<Endpoint> ask = nodes;
    for (const Endpoint& s : seeds) ask.push_back(s);
    std::string why = "no node to ask";
    for (const Endpoint& e : ask) {
      RedisReply r;
      try {
        r = exchange(conn(e), {{"CLUSTER", "SLOTS"}}).at(0);
      } catch (const RedisDown& x) {
        why = x.what();
        down_until = {};  // try the next node now
        continue;
      }
      if (r.type != RedisReply::Type::kArray) {
        why = e.str() + ": CLUSTER SLOTS: " + (r.ok() ? "not an array" : r.str);
        continue;
      }
      std::vector<int16_t> map(16384, -1);
      for (const RedisReply& range : r.elements) {
        if (range.elements.size() < 3 || range.elements[2].elements.size() < 2) continue;
        const long long a = range.elements[0].integer, b = range.elements[1].integer;
        Endpoint m;
        m.host = range.elements[2].elements[0].str;
        m.port = int(range.elements[2].elements[1].integer);
        if (m.host.empty() || m.host == "?") m.host = e.host;  // a node that does not know its own address
        const int idx = node_index(m);
        for (long long s = std::max(0LL, a); s <= std::min(16383LL, b); ++s) map[size_t(s)] = int16_t(idx);
      }
      slot_node = std::move(map);
      map_stale = false;
      ++refreshes;
      return;
    }
    down("cannot read the cluster's slot map: " + why);
  }

  // Follows MOVED/ASK up to this many times per command before giving up.
  static constexpr int kMaxRedirects = 5;

  std::vector<RedisReply> run_cluster(const std::vector<RedisCommand>& cmds) {
    try {
      return route(cmds);
    } catch (const RedisDown&) {
      // Pipelines sent to other nodes may wait unread: start every
      // connection afresh rather than read a stale reply later.
      for (auto& [e, k] : conns) k->close();
      throw;
    }
  }
  std::vector<RedisReply> route(const std::vector<RedisCommand>& cmds) {
    std::vector<RedisReply> out(cmds.size());
    struct Todo {
      size_t i;
      bool asking = false;
      Endpoint at;  // set for an ASK target (or a MOVED target before the map is refreshed)
      bool fixed = false;
    };
    std::vector<Todo> todo;
    for (size_t i = 0; i < cmds.size(); ++i) todo.push_back(Todo{i, false, Endpoint{}, false});
    for (int round = 0; !todo.empty(); ++round) {
      if (round > kMaxRedirects) {
        for (const Todo& t : todo) {
          out[t.i].type = RedisReply::Type::kError;
          out[t.i].str = "kvtc: too many cluster redirects";
        }
        break;
      }
      if (map_stale) refresh_map();
      // Group by node, keeping each node's commands in their order.
      std::map<Endpoint, std::vector<Todo>> by;
      for (const Todo& t : todo) {
        Endpoint e = t.at;
        if (!t.fixed) {
          const int n = slot_node[key_slot(cmds[t.i].size() > 1 ? cmds[t.i][1] : std::string())];
          if (n < 0) {
            out[t.i].type = RedisReply::Type::kError;
            out[t.i].str = "CLUSTERDOWN kvtc: the slot has no node";
            continue;
          }
          e = nodes[size_t(n)];
        }
        by[e].push_back(t);
      }
      // Send everything, then read: the nodes work in parallel.
      std::vector<std::pair<Conn*, std::vector<Todo>*>> sent;
      for (auto& [e, ts] : by) {
        Conn& k = conn(e);
        std::vector<RedisCommand> batch;
        for (const Todo& t : ts) {
          if (t.asking) batch.push_back({"ASKING"});
          batch.push_back(cmds[t.i]);
        }
        send(k, batch);
        sent.push_back({&k, &ts});
      }
      std::vector<Todo> again;
      for (auto& [k, ts] : sent) {
        size_t n = 0;
        for (const Todo& t : *ts) n += t.asking ? 2 : 1;
        std::vector<RedisReply> rs = receive(*k, n);
        size_t at = 0;
        for (const Todo& t : *ts) {
          if (t.asking) ++at;  // ASKING's +OK
          RedisReply& r = rs[at++];
          if (r.type == RedisReply::Type::kError && (r.str.rfind("MOVED ", 0) == 0 || r.str.rfind("ASK ", 0) == 0)) {
            // "MOVED <slot> <host>:<port>" / "ASK <slot> <host>:<port>"
            const bool moved = r.str[0] == 'M';
            const size_t sp2 = r.str.find(' ', r.str.find(' ') + 1);
            Endpoint to = parse_hostport(r.str.substr(sp2 + 1), "redis cluster redirect");
            if (to.host.empty()) to.host = k->at.host;
            ++redirects;
            Todo n2{t.i, !moved, to, true};
            if (moved) {
              const long slot = std::strtol(r.str.c_str() + 6, nullptr, 10);
              if (slot >= 0 && slot < 16384) slot_node[size_t(slot)] = int16_t(node_index(to));
              map_stale = true;  // the topology changed: read it again before the next round
            }
            again.push_back(n2);
            continue;
          }
          out[t.i] = std::move(r);
        }
      }
      todo = std::move(again);
    }
    return out;
  }
};

uint16_t Redis::key_slot(const std::string& key) {
  // Redis Cluster spec: hash only the part between the first '{' and the
  // next '}' when it is not empty.
  size_t a = 0, n = key.size();
  const size_t open = key.find('{');
  if (open != std::string::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string::npos && close > open + 1) {
      a = open + 1;
      n = close - open - 1;
    }
  }
  uint16_t crc = 0;  // CRC16-CCITT (XMODEM): polynomial 0x1021, initial 0
  for (size_t i = a; i < a + n; ++i) {
    crc ^= uint16_t(uint8_t(key[i])) << 8;
    for (int b = 0; b < 8; ++b) crc = (crc & 0x8000) ? uint16_t((crc << 1) ^ 0x1021) : uint16_t(crc << 1);
  }
  return crc & 16383;
}

Redis::Redis(const RedisOptions& opt) : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  I.opt = opt;
  require(opt.url.empty() != opt.cluster.empty(), "redis: give either a redis:// URL or cluster seeds");
  require(opt.connect_timeout_ms > 0 && opt.timeout_ms > 0 && opt.retry_ms >= 0, "redis: timeouts must be positive");
  if (!opt.url.empty()) {
    const std::string& u = opt.url;
    const std::string what = "redis URL '" + u + "'";
    require(u.rfind("redis://", 0) == 0, what + ": expected redis://[[user]:password@]host[:port][/db]");
    std::string rest = u.substr(8);
    const size_t at = rest.rfind('@');
    if (at != std::string::npos) {
      const std::string cred = rest.substr(0, at);
      rest = rest.substr(at + 1);
      const size_t c = cred.find(':');
      if (c == std::string::npos) {
        I.password = cred;
      } else {
        I.user = cred.substr(0, c);
        I.password = cred.substr(c + 1);
      }
    }
    const size_t slash = rest.find('/');
    if (slash != std::string::npos) {
      const std::string d = rest.substr(slash + 1);
      rest = rest.substr(0, slash);
      if (!d.empty()) {
        size_t used = 0;
        try {
          I.db = std::stoi(d, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        require(used == d.size() && I.db >= 0, what + ": database '" + d + "' is not a number");
      }
    }
    I.seeds.push_back(parse_hostport(rest, what));
  } else {
    I.is_cluster = true;
    for (const std::string& s : opt.cluster) I.seeds.push_back(parse_hostport(s, "redis cluster seed '" + s + "'"));
  }
}

Redis::~Redis() = default;

std::vector<RedisReply> Redis::run(const std::vector<RedisCommand>& cmds) {
  Impl& I = *impl_;
  if (cmds.empty()) return {};
  NoSigpipe no_sigpipe;
  if (Clock::now() < I.down_until) throw RedisDown("redis " + I.describe() + ": down (" + I.down_why + "); retrying later");
  if (I.is_cluster) return I.run_cluster(cmds);
  return I.exchange(I.conn(I.seeds[0]), cmds);
}

std::string Redis::describe() const {
  return impl_->describe();
}
bool Redis::cluster() const {
  return impl_->is_cluster;
}
uint64_t Redis::redirects() const {
  return impl_->redirects;
}
uint64_t Redis::map_refreshes() const {
  return impl_->refreshes;
}

}  // namespace kvtc::detail
