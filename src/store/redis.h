// A small Redis client for the prompt store's shared tier (docs/store.md
// "Redis"): pipelines of binary-safe commands to one server or to a Redis
// Cluster. The sockets are driven here (non-blocking, poll()) and hiredis's
// reader (Debian's libhiredis 0.14) parses the replies: hiredis's own
// blocking calls bound each socket call, not a round trip, so a reply that
// trickles in would hold the caller indefinitely. hiredis has no cluster
// support either: the slot map (CLUSTER SLOTS), CRC16 key slots with hash
// tags, MOVED (remap, refresh the map, retry) and ASK (ASKING + retry at the
// importing node) are here.
//
// Time: every run() has one deadline, timeout_ms after it starts (or the
// caller's), for the whole exchange: name resolution, connecting (at most
// connect_timeout_ms of it), sending, every reply of every node, redirects
// and map refreshes. A host name is resolved by getaddrinfo on a helper
// thread the caller stops waiting for at the deadline (one per host at a
// time; an answer is reused for 60 s and renewed in the background after).
//
// Faults: a server that cannot be reached or does not finish answering by
// the deadline, a reply that does not parse, an AUTH/SELECT refused: every
// connection the exchange touched is closed (a later exchange never reads
// an earlier one's reply) and RedisDown is thrown; calls then fail at once
// (no network) for retry_ms. Error replies (OOM, WRONGTYPE, ...) come back
// as replies: the stream is still in step.
// Thread safety: one call at a time per Redis object (callers hold a lock
// or own the object per thread).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvtc/error.h"

namespace kvtc {
struct StoreOptions;
}

namespace kvtc::detail {

struct RedisError : Error {
  using Error::Error;
};
// The server (or a cluster node) could not be reached or timed out.
struct RedisDown : RedisError {
  using RedisError::RedisError;
};

struct RedisReply {
  enum class Type { kNil, kString, kStatus, kInteger, kArray, kError } type = Type::kNil;
  std::string str;  // kString, kStatus, kError
  long long integer = 0;
  std::vector<RedisReply> elements;  // kArray
  bool ok() const { return type != Type::kError; }
};

using RedisCommand = std::vector<std::string>;  // arguments, binary-safe; the key is argument 1

struct RedisOptions {
  // redis://[[user]:password@]host[:port][/db] for one server, or empty.
  std::string url;
  // host:port seeds of a Redis Cluster (any subset of its masters), or empty.
  std::vector<std::string> cluster;
  // AUTH [user] password on every new connection, to the one server or to
  // every cluster node; the URL's credentials are the same for one server
  // (giving both is refused).
  std::string user, password;
  int connect_timeout_ms = 500;  // resolving and connecting, within the deadline
  int timeout_ms = 2000;         // the deadline of one run(): the whole exchange
  int retry_ms = 1000;           // after a failure, calls fail fast this long
};

// The store's Redis settings (redis_url or redis_cluster, AUTH, connect
// timeout, redis_retry_ms); timeout_ms is left for the caller to set per use
// (lookups, writes, the shared calibration). Defined in redis_tier.cpp.
RedisOptions redis_options(const StoreOptions& o);

class Redis {
 public:
  // Parses the options (Error on a malformed URL or seed); connects lazily.
  explicit Redis(const RedisOptions& opt);
  ~Redis();
  Redis(const Redis&) = delete;
  Redis& operator=(const Redis&) = delete;

  // Sends the commands as one pipeline per server and returns the replies
  // in order: one round trip for many keys, also across a cluster's nodes.
  // Done by timeout_ms from now (the options' when 0), or RedisDown.
  std::vector<RedisReply> run(const std::vector<RedisCommand>& cmds, int timeout_ms = 0);
  RedisReply run1(const RedisCommand& cmd) { return run({cmd}).at(0); }
  // One command on every master (a command that names no key: CONFIG GET),
  // with the same deadline: each master's "host:port" and its reply.
  std::vector<std::pair<std::string, RedisReply>> run_each(const RedisCommand& cmd, int timeout_ms = 0);

  std::string describe() const;  // "redis://host:port/db" or "cluster host:port,..."
  bool cluster() const;
  uint64_t redirects() const;  // MOVED + ASK replies followed
  uint64_t map_refreshes() const;

  // The Redis Cluster key slot (CRC16-XMODEM mod 16384 of the key, or of
  // its {hash tag}).
  static uint16_t key_slot(const std::string& key);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtc::detail
