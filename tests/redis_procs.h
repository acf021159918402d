// Real redis-server processes for the tests (Debian's redis-server, which
// the bootstrap installs): one instance, or a 3-master cluster made with
// `redis-cli --cluster create`, on free loopback ports, stopped at the end;
// and a TCP proxy in front of one that can send its replies on a byte at a
// time.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <list>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "store/redis.h"

namespace kvtc::testing {

// A free loopback port; for a cluster node, one whose bus port (+10000)
// is free too.
inline bool port_free(int port) {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(uint16_t(port));
  const bool ok = ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(s);
  return ok;
}
inline int free_cluster_port() {
  static uint32_t next = 20000 + uint32_t(::getpid()) % 20000;
  for (int i = 0; i < 20000; ++i) {
    const int p = int(20000 + (next++ % 35000));
    if (port_free(p) && port_free(p + 10000)) return p;
  }
  throw std::runtime_error("no free port pair for a cluster node");
}
inline int free_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(s);
    throw std::runtime_error("free_port: cannot bind");
  }
  ::close(s);
  return ntohs(a.sin_port);
}

// Starts a program (looked up on PATH) with its output thrown away, killed
// when the test process dies (a crashed test leaves no server behind).
inline pid_t spawn(const std::vector<std::string>& args) {
  std::string path;
  const char* env_path = std::getenv("PATH");
  std::string dirs = env_path ? env_path : "/usr/bin:/bin";
  for (size_t a = 0; path.empty();) {
    const size_t b = dirs.find(':', a);
    const std::string cand = dirs.substr(a, b == std::string::npos ? std::string::npos : b - a) + "/" + args[0];
    if (::access(cand.c_str(), X_OK) == 0) path = cand;
    if (b == std::string::npos) break;
    a = b + 1;
  }
  if (path.empty()) throw std::runtime_error("cannot find " + args[0] + " on PATH (the bootstrap installs redis-server and redis-tools)");
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {  // only async-signal-safe calls until exec
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    const int null = ::open("/dev/null", O_RDWR);
    ::dup2(null, 1);
    ::dup2(null, 2);
    ::execv(path.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

inline int run_wait(const std::vector<std::string>& args) {
  int st = 0;
  ::waitpid(spawn(args), &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// One redis-server on 127.0.0.1, without persistence, in its own directory.
class RedisServer {
 public:
  // password: requirepass and masterauth (a cluster's nodes authenticate to
  // each other with it); url() and cmd() then AUTH with it.
  RedisServer(const std::filesystem::path& dir, std::vector<std::string> extra = {}, int port = 0, std::string password = "")
      : dir_(dir), extra_(std::move(extra)), port_(port ? port : free_port()), password_(std::move(password)) {
    if (!password_.empty()) extra_.insert(extra_.end(), {"--requirepass", password_, "--masterauth", password_});
    start();
  }
  ~RedisServer() {
    stop();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  void start() {
    std::filesystem::create_directories(dir_);
    std::vector<std::string> a = {
        "redis-server", "--port",    std::to_string(port_),        "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir",
        dir_.string(),  "--logfile", (dir_ / "redis.log").string()};
    a.insert(a.end(), extra_.begin(), extra_.end());
    pid_ = spawn(a);
    for (int i = 0; i < 500; ++i) {  // up to 5 s
      try {
        detail::RedisOptions o;
        o.url = url();
        detail::Redis r(o);
        (void)r.run1({"PING"});  // any answer (NOAUTH too): it is up
        return;
      } catch (const std::exception&) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    throw std::runtime_error("redis-server on port " + std::to_string(port_) + " did not answer; see " + (dir_ / "redis.log").string());
  }
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  // SIGSTOP / SIGCONT: a Redis that hangs (swapping, a long fork, a debugger):
  // the kernel still accepts connections and takes the commands, nothing answers.
  void freeze() { ::kill(pid_, SIGSTOP); }
  void thaw() { ::kill(pid_, SIGCONT); }
  int port() const { return port_; }
  std::string url() const { return "redis://" + (password_.empty() ? "" : ":" + password_ + "@") + "127.0.0.1:" + std::to_string(port_); }
  const std::string& password() const { return password_; }
  std::string hostport() const { return "127.0.0.1:" + std::to_string(port_); }
  // A direct connection (admin commands; in a cluster, this node only).
  detail::RedisReply cmd(const detail::RedisCommand& c) const {
    detail::RedisOptions o;
    o.url = url();
    o.retry_ms = 0;
    detail::Redis r(o);
    return r.run1(c);
  }

 private:
  std::filesystem::path dir_;
  std::vector<std::string> extra_;
  int port_;
  std::string password_;
  pid_t pid_ = -1;
};

// Three masters, slots spread by redis-cli --cluster create.
class RedisCluster {
 public:
  ~RedisCluster() {
    nodes.clear();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  explicit RedisCluster(const std::filesystem::path& dir, const std::vector<std::string>& extra = {}, const std::string& password = "") : dir_(dir) {
    std::filesystem::create_directories(dir);
    for (int i = 0; i < 3; ++i) {
      const int port = free_cluster_port();
      std::vector<std::string> args{"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000"};
      args.insert(args.end(), extra.begin(), extra.end());
      nodes.push_back(std::make_unique<RedisServer>(dir / ("node" + std::to_string(i)), args, port, password));
    }
    std::vector<std::string> a = {"redis-cli", "--cluster", "create"};
    if (!password.empty()) a.insert(a.end(), {"-a", password, "--no-auth-warning"});
    for (auto& n : nodes) a.push_back(n->hostport());
    a.insert(a.end(), {"--cluster-replicas", "0", "--cluster-yes"});
    // redis-cli prints its plan; keep the test's output readable.
    a.insert(a.begin(), {"sh", "-c", "\"$0\" \"$@\" >" + (dir / "create.log").string() + " 2>&1"});
    if (run_wait(a) != 0) throw std::runtime_error("redis-cli --cluster create failed; see " + (dir / "create.log").string());
    for (int i = 0; i < 1000; ++i) {  // until every node agrees the cluster is up (10 s at most)
      bool ok = true;
      for (auto& n : nodes) ok = ok && n->cmd({"CLUSTER", "INFO"}).str.find("cluster_state:ok") != std::string::npos;
      if (ok) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    throw std::runtime_error("the redis cluster did not come up");
  }
  std::vector<std::unique_ptr<RedisServer>> nodes;

 private:
  std::filesystem::path dir_;
};

// A TCP proxy on a loopback port in front of a server (one thread, poll()):
// the commands pass at once, the replies too (kPass), or one byte every
// `byte_ms` (kTrickle: a server that answers, but slower than any deadline),
// or so only once the connection has sent a GET (kTrickleAfterGet: a take's
// lookup passes, its fetch trickles). Switching back to kPass sends what is
// held at once. `garbage`: the next reply is preceded by bytes that are not
// the protocol.
class TrickleProxy {
 public:
  enum Mode { kPass, kTrickle, kTrickleAfterGet };
  explicit TrickleProxy(int upstream_port, int byte_ms = 20) : upstream_(upstream_port), byte_ms_(byte_ms) {
    listen_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(listen_, 64) != 0 ||
        ::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      throw std::runtime_error("TrickleProxy: cannot listen");
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { loop(); });
  }
  ~TrickleProxy() {
    stop_ = true;
    thread_.join();
    for (Pair& p : pairs_) p.close();
    ::close(listen_);
  }
  TrickleProxy(const TrickleProxy&) = delete;
  TrickleProxy& operator=(const TrickleProxy&) = delete;
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }
  std::atomic<int> mode{kPass};
  std::atomic<bool> garbage{false};
  std::atomic<int> gets_seen{0};  // connections that sent a GET

 private:
  using Clock = std::chrono::steady_clock;
  struct Pair {
    int c = -1, s = -1;           // the client's socket, the server's
    std::string to_c, to_s;       // bytes held for each side
    bool saw_get = false;         // the client sent a GET
    Clock::time_point next_byte;  // trickling: when the next byte may go
    void close() {
      if (c >= 0) ::close(c);
      if (s >= 0) ::close(s);
      c = s = -1;
    }
  };
  bool trickling(const Pair& p) const { return mode == kTrickle || (mode == kTrickleAfterGet && p.saw_get); }
  static bool pull(int fd, std::string& into) {  // false: closed or failed
    char buf[65536];
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) into.append(buf, size_t(n));
    return n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR));
  }
  static bool push(int fd, std::string& from, size_t most) {
    const ssize_t n = ::send(fd, from.data(), std::min(most, from.size()), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) from.erase(0, size_t(n));
    return n >= 0 || errno == EAGAIN || errno == EINTR;
  }
  void loop() {
    while (!stop_) {
      std::vector<pollfd> f{{listen_, POLLIN, 0}};
      for (Pair& p : pairs_) {
        f.push_back({p.c, short(POLLIN | (!p.to_c.empty() && !trickling(p) ? POLLOUT : 0)), 0});
        f.push_back({p.s, short(POLLIN | (!p.to_s.empty() ? POLLOUT : 0)), 0});
      }
      ::poll(f.data(), nfds_t(f.size()), 2);  // 2 ms: the trickle's clock, and the stop flag
      if (f[0].revents & POLLIN) {
        Pair p;
        p.c = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
        p.s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        a.sin_port = htons(uint16_t(upstream_));
        if (p.c >= 0 && ::connect(p.s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0)
          pairs_.push_back(p);
        else
          p.close();
      }
      size_t i = 1;
      for (auto it = pairs_.begin(); it != pairs_.end(); i += 2) {
        Pair& p = *it;
        bool ok = true;
        if (f.size() > i && (f[i].revents & (POLLIN | POLLHUP | POLLERR))) ok = pull(p.c, p.to_s);
        if (ok && f.size() > i + 1 && (f[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) {
          const bool was_empty = p.to_c.empty();
          ok = pull(p.s, p.to_c);
          if (was_empty && !p.to_c.empty() && garbage.exchange(false)) p.to_c = "?garbage\r\n" + p.to_c;
        }
        if (!p.saw_get && p.to_s.find("$3\r\nGET\r\n") != std::string::npos) {
          p.saw_get = true;
          ++gets_seen;
        }
        if (ok && !p.to_s.empty()) ok = push(p.s, p.to_s, p.to_s.size());
        if (ok && !p.to_c.empty()) {
          if (!trickling(p)) {
            ok = push(p.c, p.to_c, p.to_c.size());
          } else if (Clock::now() >= p.next_byte) {
            ok = push(p.c, p.to_c, 1);
            p.next_byte = Clock::now() + std::chrono::milliseconds(byte_ms_);
          }
        }
        if (ok) {
          ++it;
        } else {
          p.close();
          it = pairs_.erase(it);
        }
      }
    }
  }
  int upstream_, byte_ms_, port_ = 0, listen_ = -1;
  std::list<Pair> pairs_;  // the proxy's thread only
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace kvtc::testing
