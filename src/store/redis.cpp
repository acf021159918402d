// The store's Redis client (src/store/redis.h): the sockets driven with
// poll() to one deadline per exchange, hiredis's reader for the replies,
// the cluster routing written here.
#include "store/redis.h"

#include <arpa/inet.h>
#include <hiredis/hiredis.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>

namespace kvtc::detail {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

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

// A cluster redirect, "MOVED <slot> <host>:<port>" or "ASK ...": its slot
// and target, false when it does not parse (then it is left as an error
// reply). An empty host (":7001": Redis 7 with
// cluster-preferred-endpoint-type unknown-endpoint) means the node that
// sent it.
bool parse_redirect(const std::string& r, const Endpoint& from, long& slot, Endpoint& to) {
  const size_t sp1 = r.find(' '), sp2 = sp1 == std::string::npos ? sp1 : r.find(' ', sp1 + 1);
  if (sp2 == std::string::npos) return false;
  char* end = nullptr;
  slot = std::strtol(r.c_str() + sp1 + 1, &end, 10);
  if (end != r.c_str() + sp2 || slot < 0 || slot > 16383) return false;
  const std::string hp = r.substr(sp2 + 1);
  const size_t c = hp.rfind(':');
  if (c == std::string::npos || c + 1 == hp.size() || c + 6 < hp.size()) return false;
  int port = 0;
  for (size_t i = c + 1; i < hp.size(); ++i) {
    if (hp[i] < '0' || hp[i] > '9') return false;
    port = port * 10 + (hp[i] - '0');
  }
  if (port < 1 || port > 65535) return false;
  to.host = hp.substr(0, c);
  if (to.host.size() > 2 && to.host.front() == '[' && to.host.back() == ']') to.host = to.host.substr(1, to.host.size() - 2);
  if (to.host.empty()) to.host = from.host;
  to.port = port;
  return true;
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

// A command in the wire protocol (RESP): an array of bulk strings.
void append_command(std::string& out, const RedisCommand& c) {
  out += '*';
  out += std::to_string(c.size());
  out += "\r\n";
  for (const std::string& a : c) {
    out += '$';
    out += std::to_string(a.size());
    out += "\r\n";
    out += a;
    out += "\r\n";
  }
}

std::string errno_text(int e) {
  char buf[128];
  return strerror_r(e, buf, sizeof buf);  // GNU: returns the message
}

struct Addr {
  sockaddr_storage sa{};
  socklen_t len = 0;
};

// A host's addresses. getaddrinfo cannot be given a deadline, so it runs on
// a helper thread that owns its share of this: the caller stops waiting at
// its deadline, and the answer still lands here for the next attempt.
struct Resolution {
  std::mutex mu;
  bool done = false;
  std::string error;  // set when done without an address
  std::vector<Addr> addrs;
  Clock::time_point at;  // when it finished
};

std::shared_ptr<Resolution> numeric(const Endpoint& e) {
  Addr a;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&a.sa);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&a.sa);
  if (inet_pton(AF_INET, e.host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(uint16_t(e.port));
    a.len = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, e.host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(uint16_t(e.port));
    a.len = sizeof(sockaddr_in6);
  } else {
    return nullptr;
  }
  auto r = std::make_shared<Resolution>();
  r->done = true;
  r->addrs.push_back(a);
  r->at = Clock::now();
  return r;
}

std::shared_ptr<Resolution> start_resolving(const Endpoint& e) {
  auto r = std::make_shared<Resolution>();
  try {
    std::thread([r, host = e.host, port = std::to_string(e.port)] {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* res = nullptr;
      const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
      std::vector<Addr> found;
      for (addrinfo* p = rc == 0 ? res : nullptr; p; p = p->ai_next) {
        if (p->ai_addrlen > sizeof(sockaddr_storage)) continue;
        Addr a;
        std::memcpy(&a.sa, p->ai_addr, p->ai_addrlen);
        a.len = socklen_t(p->ai_addrlen);
        found.push_back(a);
      }
      if (res) freeaddrinfo(res);
      std::lock_guard<std::mutex> g(r->mu);
      r->done = true;
      r->error = rc ? gai_strerror(rc) : found.empty() ? "no address" : "";
      r->addrs = std::move(found);
      r->at = Clock::now();
    }).detach();
  } catch (const std::system_error& x) {
    std::lock_guard<std::mutex> g(r->mu);
    r->done = true;
    r->error = std::string("cannot start a resolver thread: ") + x.what();
  }
  return r;
}

// One connection to one server: a non-blocking socket and its reply parser.
struct Conn {
  Endpoint at;
  int fd = -1;
  redisReader* rd = nullptr;  // set once connected
  ~Conn() { close(); }
  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
    if (rd) redisReaderFree(rd);
    rd = nullptr;
  }
};

// One connection's part of an exchange: the bytes to send, the replies.
struct Link {
  Conn* k = nullptr;
  std::string out;
  size_t sent = 0;
  size_t hello = 0;  // leading replies that answer AUTH/SELECT on a new connection
  size_t want = 0;   // replies expected, hello's included
  std::vector<RedisReply> got;
  enum class St { kResolve, kConnect, kTalk, kDone, kFailed } st = St::kTalk;
  std::shared_ptr<Resolution> res;
  std::vector<Addr> addrs;
  size_t next = 0;          // the address being tried
  std::string connect_why;  // the last address's failure
  std::string why;          // kFailed: what went wrong, naming the server
  void add(const RedisCommand& c) {
    append_command(out, c);
    ++want;
  }
};

// A resolved name is used this long, then renewed in the background (the
// old addresses serve meanwhile): a connection attempt never waits on DNS
// once a name has resolved, and a moved server is found within a minute.
constexpr auto kDnsReuse = std::chrono::seconds(60);
// While a name resolves, the exchange checks for the answer this often.
constexpr auto kResolvePoll = milliseconds(5);
// Cluster map refreshes ask this many nodes at once.
constexpr size_t kRefreshFanout = 16;

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
  size_t refresh_turn = 0;  // which nodes a refresh asks first: turns round
  Clock::time_point down_until{};
  std::string down_why;
  int budget_ms = 0;  // the current call's deadline, in ms from its start (for messages)
  struct Dns {
    std::shared_ptr<Resolution> good, pending;
  };
  std::map<Endpoint, Dns> dns;
  std::vector<char> buf = std::vector<char>(256 * 1024);  // what one recv() reads at most
  std::atomic<uint64_t> redirects{0}, refreshes{0};       // read by stats() from other threads

  [[noreturn]] void down(const std::string& why) {
    down_until = Clock::now() + milliseconds(opt.retry_ms);
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

  void close_all() {
    for (auto& [e, k] : conns) k->close();
  }

  // The connection to `e`, closed first when it has something to read
  // between exchanges: the server closed it (idle timeout) or sent what no
  // command asked for; either way it is not to be trusted with the next
  // exchange's replies.
  Conn& conn(const Endpoint& e) {
    auto& p = conns[e];
    if (!p) p = std::make_unique<Conn>();
    p->at = e;
    if (p->fd >= 0) {
      pollfd f{p->fd, POLLIN, 0};
      if (::poll(&f, 1, 0) != 0) p->close();
    }
    return *p;
  }
  // A link on `k`; AUTH and SELECT go first when it is not connected yet.
  Link link(Conn& k) {
    Link l;
    l.k = &k;
    if (k.fd < 0) {
      if (!password.empty()) l.add(user.empty() ? RedisCommand{"AUTH", password} : RedisCommand{"AUTH", user, password});
      if (db != 0) l.add({"SELECT", std::to_string(db)});
      l.hello = l.want;
    }
    return l;
  }

  // Addresses for `e`: at once for a numeric address or a name resolved
  // before (the last good answer, renewed in the background after
  // kDnsReuse), else a resolution in progress (one per name at a time).
  std::shared_ptr<Resolution> resolve(const Endpoint& e) {
    if (auto r = numeric(e)) return r;
    Dns& d = dns[e];
    std::shared_ptr<Resolution> failed;
    if (d.pending) {
      std::unique_lock<std::mutex> g(d.pending->mu);
      if (d.pending->done) {
        auto r = std::move(d.pending);
        g.unlock();
        (r->error.empty() ? d.good : failed) = std::move(r);
      }
    }
    const Clock::time_point now = Clock::now();
    if (!d.pending && !failed && (!d.good || now - d.good->at > kDnsReuse)) d.pending = start_resolving(e);
    if (d.good) return d.good;
    return failed ? failed : d.pending;
  }

  void fail(Link& l, const std::string& why) {
    l.st = Link::St::kFailed;
    l.why = l.k->at.str() + ": " + why;
    l.k->close();
  }
  void connected(Link& l) {
    const int one = 1;
    (void)setsockopt(l.k->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // a pipeline is written at once: no Nagle wait for the tail
    l.k->rd = redisReaderCreate();
    if (!l.k->rd) return fail(l, "out of memory");
    l.st = Link::St::kTalk;
  }
  void try_connect(Link& l) {
    for (; l.next < l.addrs.size(); ++l.next) {
      const Addr& a = l.addrs[l.next];
      const int fd = ::socket(a.sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) {
        l.connect_why = errno_text(errno);
        continue;
      }
      if (::connect(fd, reinterpret_cast<const sockaddr*>(&a.sa), a.len) == 0 || errno == EINPROGRESS) {
        l.k->fd = fd;
        l.st = Link::St::kConnect;
        return;
      }
      l.connect_why = errno_text(errno);
      ::close(fd);
    }
    fail(l, "cannot connect: " + l.connect_why);
  }
  void resolved(Link& l) {
    {
      std::lock_guard<std::mutex> g(l.res->mu);
      if (!l.res->done) return;
      if (!l.res->error.empty()) return fail(l, "cannot resolve '" + l.k->at.host + "': " + l.res->error);
      l.addrs = l.res->addrs;
    }
    l.res.reset();
    try_connect(l);
  }
  // Parses what arrived; kDone when every reply is in and nothing else.
  void parse(Link& l) {
    while (l.got.size() < l.want) {
      void* r = nullptr;
      if (redisReaderGetReply(l.k->rd, &r) != REDIS_OK) return fail(l, std::string("reply does not parse: ") + l.k->rd->errstr);
      if (!r) return;
      l.got.push_back(convert(static_cast<const redisReply*>(r)));
      freeReplyObject(r);
    }
    if (l.k->rd->pos < l.k->rd->len) return fail(l, "more bytes than replies: the connection is out of step");
    for (size_t i = 0; i < l.hello; ++i)
      if (!l.got[i].ok()) return fail(l, (i == 0 && !password.empty() ? "AUTH: " : "SELECT: ") + l.got[i].str);
    l.got.erase(l.got.begin(), l.got.begin() + std::ptrdiff_t(l.hello));
    l.st = Link::St::kDone;
  }
  void talk(Link& l, short revents) {
    if ((revents & POLLOUT) && l.sent < l.out.size()) {
      const ssize_t w = ::send(l.k->fd, l.out.data() + l.sent, l.out.size() - l.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w >= 0)
        l.sent += size_t(w);
      else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
        return fail(l, "send: " + errno_text(errno));
    }
    if (!(revents & (POLLIN | POLLERR | POLLHUP))) return;
    // A few reads per wake-up, so that one fast server does not keep the
    // others (and the deadline check) waiting.
    for (int i = 0; i < 16 && l.st == Link::St::kTalk; ++i) {
      const ssize_t n = ::recv(l.k->fd, buf.data(), buf.size(), MSG_DONTWAIT);
      if (n > 0) {
        if (redisReaderFeed(l.k->rd, buf.data(), size_t(n)) != REDIS_OK) return fail(l, "out of memory reading a reply");
        parse(l);
        if (size_t(n) < buf.size()) return;
        continue;
      }
      if (n == 0)
        return fail(l, "the server closed the connection (" + std::to_string(l.got.size()) + " of " + std::to_string(l.want) + " replies read)");
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno != EINTR) return fail(l, "recv: " + errno_text(errno));
    }
  }
  // Why a link that is still busy at its deadline failed.
  static std::string late(const Link& l, int budget) {
    const std::string ms = std::to_string(budget) + " ms";
    switch (l.st) {
      case Link::St::kResolve: return "cannot resolve '" + l.k->at.host + "' within " + ms;
      case Link::St::kConnect: return "cannot connect within " + ms;
      default:
        if (l.sent < l.out.size()) return "cannot send the commands within " + ms;
        return "no complete answer within " + ms + " (" + std::to_string(l.got.size()) + " of " + std::to_string(l.want) + " replies)";
    }
  }

  // Runs the links' exchanges at once, to `deadline`. All of them must
  // succeed (`good` empty): else every link's connection is closed and
  // RedisDown thrown. Or the first whose replies are `good` wins: its
  // index is returned (-1: none), and the links still talking are closed.
  int pump(std::vector<Link>& ls, Clock::time_point deadline, const std::function<bool(const Link&)>& good = {}) {
    const Clock::time_point connect_by = std::min(deadline, Clock::now() + milliseconds(opt.connect_timeout_ms));
    for (Link& l : ls)
      if (l.k->fd < 0) {
        l.st = Link::St::kResolve;
        l.res = resolve(l.k->at);
      }
    std::vector<pollfd> pfd;
    std::vector<size_t> who;
    for (;;) {
      for (Link& l : ls)
        if (l.st == Link::St::kResolve) resolved(l);
      size_t done = 0, failed = 0;
      const Link* first_failed = nullptr;
      for (size_t i = 0; i < ls.size(); ++i) {
        if (ls[i].st == Link::St::kDone) {
          if (good && good(ls[i])) {
            for (Link& l : ls)
              if (l.st != Link::St::kDone) l.k->close();
            return int(i);
          }
          ++done;
        } else if (ls[i].st == Link::St::kFailed) {
          ++failed;
          if (!first_failed) first_failed = &ls[i];
        }
      }
      if (!good && first_failed) {
        for (Link& l : ls) l.k->close();
        down(first_failed->why);
      }
      if (done + failed == ls.size()) return good ? -1 : int(ls.size());
      const Clock::time_point now = Clock::now();
      bool waiting_dns = false, connecting = false, late_ones = false;
      for (Link& l : ls) {
        if (l.st == Link::St::kDone || l.st == Link::St::kFailed) continue;
        if (now >= deadline || (l.st != Link::St::kTalk && now >= connect_by)) {
          fail(l, late(l, now >= deadline ? budget_ms : opt.connect_timeout_ms));
          late_ones = true;
          continue;
        }
        waiting_dns |= l.st == Link::St::kResolve;
        connecting |= l.st != Link::St::kTalk;
      }
      if (late_ones) continue;
      pfd.clear();
      who.clear();
      for (size_t i = 0; i < ls.size(); ++i) {
        const Link& l = ls[i];
        if (l.st == Link::St::kConnect) {
          pfd.push_back({l.k->fd, POLLOUT, 0});
        } else if (l.st == Link::St::kTalk) {
          pfd.push_back({l.k->fd, short(POLLIN | (l.sent < l.out.size() ? POLLOUT : 0)), 0});
        } else {
          continue;
        }
        who.push_back(i);
      }
      Clock::duration wait = (connecting ? std::min(deadline, connect_by) : deadline) - now;
      if (waiting_dns) wait = std::min<Clock::duration>(wait, kResolvePoll);
      const long long wait_ms = std::max<long long>(0, (std::chrono::duration_cast<std::chrono::microseconds>(wait).count() + 999) / 1000);
      const int n = ::poll(pfd.data(), nfds_t(pfd.size()), int(wait_ms));
      if (n < 0 && errno != EINTR) {
        for (size_t j : who) fail(ls[j], "poll: " + errno_text(errno));
        continue;
      }
      for (size_t j = 0; n > 0 && j < pfd.size(); ++j) {
        if (!pfd[j].revents) continue;
        Link& l = ls[who[j]];
        if (l.st == Link::St::kConnect) {
          int err = 0;
          socklen_t len = sizeof err;
          if (getsockopt(l.k->fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
          if (err == 0) {
            connected(l);
            continue;
          }
          l.connect_why = errno_text(err);
          ::close(l.k->fd);
          l.k->fd = -1;
          ++l.next;
          try_connect(l);
        } else {
          talk(l, pfd[j].revents);
        }
      }
    }
  }

  // One pipeline to one server.
  std::vector<RedisReply> exchange(const Endpoint& e, const std::vector<RedisCommand>& cmds, Clock::time_point deadline) {
    std::vector<Link> ls;
    ls.push_back(link(conn(e)));
    for (const RedisCommand& c : cmds) ls[0].add(c);
    pump(ls, deadline);
    return std::move(ls[0].got);
  }

  // ---------------------------------------------------------------- cluster
  int node_index(const Endpoint& e) {
    for (size_t i = 0; i < nodes.size(); ++i)
      if (nodes[i] == e) return int(i);
    nodes.push_back(e);
    return int(nodes.size() - 1);
  }

  // CLUSTER SLOTS from the first node that answers: up to kRefreshFanout
  // of the known nodes and seeds asked at once (a frozen node costs no more
  // than a live one), starting at a different one each time.
  void refresh_map(Clock::time_point deadline) {
    std::vector<Endpoint> ask;
    for (const auto* list : {&nodes, &seeds})
      for (const Endpoint& e : *list)
        if (std::find(ask.begin(), ask.end(), e) == ask.end()) ask.push_back(e);
    if (ask.empty()) down("no node to ask for the cluster's slot map");
    std::rotate(ask.begin(), ask.begin() + std::ptrdiff_t(refresh_turn++ % ask.size()), ask.end());
    if (ask.size() > kRefreshFanout) ask.resize(kRefreshFanout);
    std::vector<Link> ls;
    for (const Endpoint& e : ask) {
      ls.push_back(link(conn(e)));
      ls.back().add({"CLUSTER", "SLOTS"});
    }
    const int w = pump(ls, deadline, [](const Link& l) { return l.got.size() == 1 && l.got[0].type == RedisReply::Type::kArray; });
    if (w < 0) {
      std::string why;
      for (const Link& l : ls)
        why += (why.empty() ? "" : "; ") +
               (l.st == Link::St::kDone ? l.k->at.str() + ": CLUSTER SLOTS: " + (l.got.at(0).ok() ? "not an array" : l.got.at(0).str) : l.why);
      down("cannot read the cluster's slot map: " + why);
    }
    const Endpoint from = ls[size_t(w)].k->at;
    std::vector<int16_t> map(16384, -1);
    for (const RedisReply& range : ls[size_t(w)].got[0].elements) {
      if (range.elements.size() < 3 || range.elements[2].elements.size() < 2) continue;
      const long long a = range.elements[0].integer, b = range.elements[1].integer, port = range.elements[2].elements[1].integer;
      if (port < 1 || port > 65535) continue;
      Endpoint m;
      m.host = range.elements[2].elements[0].str;
      m.port = int(port);
      // "" or "?": a node that does not know its address, or Redis 7's
      // unknown-endpoint mode; the address this client reached the cluster at.
      if (m.host.empty() || m.host == "?") m.host = from.host;
      const int idx = node_index(m);
      for (long long s = std::max(0LL, a); s <= std::min(16383LL, b); ++s) map[size_t(s)] = int16_t(idx);
    }
    slot_node = std::move(map);
    map_stale = false;
    ++refreshes;
  }

  // Follows MOVED/ASK up to this many times per command before giving up.
  static constexpr int kMaxRedirects = 5;

  std::vector<RedisReply> route(const std::vector<RedisCommand>& cmds, Clock::time_point deadline) {
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
      if (map_stale) refresh_map(deadline);
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
      // Every node's pipeline at once, all of each read before any reply is
      // looked at: a redirect never leaves another node's replies unread.
      std::vector<Link> ls;
      std::vector<const std::vector<Todo>*> whose;
      for (const auto& [e, ts] : by) {
        ls.push_back(link(conn(e)));
        for (const Todo& t : ts) {
          if (t.asking) ls.back().add({"ASKING"});
          ls.back().add(cmds[t.i]);
        }
        whose.push_back(&ts);
      }
      pump(ls, deadline);
      std::vector<Todo> again;
      for (size_t j = 0; j < ls.size(); ++j) {
        size_t at = 0;
        for (const Todo& t : *whose[j]) {
          if (t.asking) ++at;  // ASKING's +OK
          RedisReply& r = ls[j].got[at++];
          const bool moved = r.str.rfind("MOVED ", 0) == 0;
          long slot = -1;
          Endpoint to;
          if (r.type == RedisReply::Type::kError && (moved || r.str.rfind("ASK ", 0) == 0) && parse_redirect(r.str, ls[j].k->at, slot, to)) {
            ++redirects;
            if (moved) {
              slot_node[size_t(slot)] = int16_t(node_index(to));
              map_stale = true;  // the topology changed: read it again before the next round
            }
            again.push_back(Todo{t.i, !moved, to, true});
            continue;
          }
          out[t.i] = std::move(r);
        }
      }
      todo = std::move(again);
    }
    return out;
  }

  std::vector<std::pair<std::string, RedisReply>> each(const RedisCommand& cmd, Clock::time_point deadline) {
    std::vector<Endpoint> to;
    if (!is_cluster) {
      to.push_back(seeds[0]);
    } else {
      if (map_stale) refresh_map(deadline);
      std::set<int16_t> owners(slot_node.begin(), slot_node.end());
      for (int16_t n : owners)
        if (n >= 0) to.push_back(nodes[size_t(n)]);
    }
    std::vector<Link> ls;
    for (const Endpoint& e : to) {
      ls.push_back(link(conn(e)));
      ls.back().add(cmd);
    }
    pump(ls, deadline);
    std::vector<std::pair<std::string, RedisReply>> out;
    for (Link& l : ls) out.emplace_back(l.k->at.str(), std::move(l.got.at(0)));
    return out;
  }

  // The common frame of a call: fail fast while down, one deadline, and
  // any failure leaves no connection that could hold an unread reply.
  template <class F>
  auto call(int timeout_ms, F&& f) {
    if (Clock::now() < down_until) throw RedisDown("redis " + describe() + ": down (" + down_why + "); retrying later");
    budget_ms = timeout_ms > 0 ? timeout_ms : opt.timeout_ms;
    const Clock::time_point deadline = Clock::now() + milliseconds(budget_ms);
    try {
      return f(deadline);
    } catch (const RedisDown&) {
      close_all();
      throw;
    } catch (const std::exception& x) {  // out of memory, say: the streams may be out of step
      close_all();
      down(x.what());
    }
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
  require(!opt.password.empty() || opt.user.empty(), "redis: a user without a password");
  I.user = opt.user;
  I.password = opt.password;
  if (!opt.url.empty()) {
    const std::string& u = opt.url;
    // Messages name the URL without its password.
    const size_t at_sign = u.rfind('@'), scheme_end = u.find("://");
    const std::string shown = at_sign != std::string::npos && scheme_end != std::string::npos && scheme_end < at_sign
                                  ? u.substr(0, scheme_end + 3) + "***@" + u.substr(at_sign + 1)
                                  : u;
    const std::string what = "redis URL '" + shown + "'";
    // Debian 12's libhiredis 0.14.1 is built without TLS (no hiredis_ssl),
    // and the client here speaks plain TCP.
    require(u.rfind("rediss://", 0) != 0,
            what +
                ": TLS (rediss://) is not supported by this build (Debian 12's hiredis 0.14 has no TLS); reach Redis "
                "over a private network, or through a TLS tunnel (stunnel or spiped on loopback) and give its local end as "
                "redis://127.0.0.1:PORT");
    require(u.rfind("redis://", 0) == 0, what + ": expected redis://[[user]:password@]host[:port][/db]");
    std::string rest = u.substr(8);
    const size_t at = rest.rfind('@');
    if (at != std::string::npos) {
      require(opt.password.empty(), what + ": carries a password, and one is given apart (redis_password): give one of them");
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

std::vector<RedisReply> Redis::run(const std::vector<RedisCommand>& cmds, int timeout_ms) {
  Impl& I = *impl_;
  if (cmds.empty()) return {};
  return I.call(timeout_ms,
                [&](Clock::time_point deadline) { return I.is_cluster ? I.route(cmds, deadline) : I.exchange(I.seeds[0], cmds, deadline); });
}

std::vector<std::pair<std::string, RedisReply>> Redis::run_each(const RedisCommand& cmd, int timeout_ms) {
  Impl& I = *impl_;
  return I.call(timeout_ms, [&](Clock::time_point deadline) { return I.each(cmd, deadline); });
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
