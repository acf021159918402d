// A small Redis client for the prompt store's shared tier (docs/store.md
// "Redis"): pipelines of binary-safe commands over hiredis (Debian's
// libhiredis 0.14), to one server or to a Redis Cluster. hiredis has no
// cluster support, so the cluster part is here: the slot map (CLUSTER
// SLOTS), CRC16 key slots with hash tags, MOVED (remap, refresh the map,
// retry) and ASK (ASKING + retry at the importing node).
//
// Faults: a server that cannot be reached, or does not answer within the
// timeout, throws RedisDown; calls then fail fast (no connection attempt)
// for retry_ms, so a dead Redis costs one timeout per retry_ms, not one per
// request. Error replies (OOM, WRONGTYPE, ...) come back as replies.
// Thread safety: one call at a time per Redis object (callers hold a lock
// or own the object per thread).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvtc/error.h"

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
  int connect_timeout_ms = 500;
  int timeout_ms = 2000;  // per command round trip
  int retry_ms = 1000;    // after a failure, calls fail fast this long
};

class Redis {
 public:
  // Parses the options (Error on a malformed URL or seed); connects lazily.
  explicit Redis(const RedisOptions& opt);
  ~Redis();
  Redis(const Redis&) = delete;
  Redis& operator=(const Redis&) = delete;

  // Sends the commands as one pipeline per server and returns the replies
  // in order: one round trip for many keys, also across a cluster's nodes.
  std::vector<RedisReply> run(const std::vector<RedisCommand>& cmds);
  RedisReply run1(const RedisCommand& cmd) { return run({cmd}).at(0); }

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
