// One calibration for a fleet (kvtc/store.h, docs/store.md "Shared
// calibration"): a calibration file's bytes under one Redis key, sealed with
// the store's secret.
#include <string>

#include "codec/calibration_io.h"
#include "kvtc/error.h"
#include "kvtc/store.h"
#include "store/redis.h"
#include "store/seal.h"

namespace kvtc {

namespace {

constexpr char kSealCalibration = 'k';  // the seal kind of a shared calibration (docs/store.md "Sealed values")

void log(const StoreOptions& o, const std::string& s) {
  if (o.log) o.log("kvtc store: shared calibration: " + s);
}

store::Sealer sealer_of(const StoreOptions& o) {
  require(!o.secret.empty(),
          "kvtc store: a calibration is shared through Redis only with a secret (StoreOptions::secret, --kvtc-secret-file): without one, "
          "whoever can write to Redis would choose every replica's calibration");
  return store::Sealer(o.secret, o.encrypt);
}

std::string key_of(const StoreOptions& o, const std::string& model_sha256, const store::Sealer& seal) {
  const std::string what = "kvtc shared calibration 1\n" + model_sha256 + "\n" + o.kv_settings.text();
  const std::vector<uint8_t> h = store::hmac_sha256(seal.chain_key(), std::span(reinterpret_cast<const uint8_t*>(what.data()), what.size()));
  return "kvtc:calib:1:" + store::hex(std::span(h).first(16));
}

// A connection with a deadline for `bytes` at the tier's slowest expected
// rate (redis_min_mib_s), as the tier's own writes have.
detail::Redis connect(const StoreOptions& o, uint64_t bytes) {
  require(!o.redis_url.empty() || !o.redis_cluster.empty(), "kvtc store: a shared calibration needs redis_url or redis_cluster");
  detail::RedisOptions ro = detail::redis_options(o);
  ro.retry_ms = 0;
  ro.timeout_ms = o.redis_timeout_ms + int(double(bytes) / (o.redis_min_mib_s * 1048576.0) * 1e3);
  return detail::Redis(ro);
}

std::optional<Calibration> parse(const StoreOptions& o, const store::Sealer& seal, const std::string& key, const std::string& value) {
  try {
    std::vector<uint8_t> v(value.begin(), value.end());
    seal.open(kSealCalibration, key, v, "Redis " + key);
    return calibration_parse(v, "Redis " + key, /*decoder_only=*/false);
  } catch (const std::exception& e) {
    log(o, std::string("not used: ") + e.what());
    return std::nullopt;
  }
}

}  // namespace

std::string shared_calibration_key(const StoreOptions& o, const std::string& model_sha256) {
  return key_of(o, model_sha256, sealer_of(o));
}

std::optional<Calibration> fetch_shared_calibration(const StoreOptions& o, const std::string& model_sha256) {
  const store::Sealer seal = sealer_of(o);
  const std::string key = key_of(o, model_sha256, seal);
  try {
    // A calibration is ~4 p^2 bytes (K and V bases, f32): 265 MB for p = 5,760.
    detail::Redis r = connect(o, uint64_t(512) << 20);
    std::vector<detail::RedisCommand> q{{"GET", key}};
    if (o.redis_ttl_s > 0) q.push_back({"EXPIRE", key, std::to_string(o.redis_ttl_s)});
    const std::vector<detail::RedisReply> got = r.run(q);
    const detail::RedisReply& v = got.at(0);
    if (v.type == detail::RedisReply::Type::kNil) return std::nullopt;
    if (v.type != detail::RedisReply::Type::kString) {
      log(o, "GET " + key + ": " + (v.ok() ? "not a string" : v.str));
      return std::nullopt;
    }
    return parse(o, seal, key, v.str);
  } catch (const std::exception& e) {
    log(o, std::string("Redis: ") + e.what());
    return std::nullopt;
  }
}

std::optional<Calibration> publish_shared_calibration(const StoreOptions& o, const std::string& model_sha256, const Calibration& cal) {
  const store::Sealer seal = sealer_of(o);
  const std::string key = key_of(o, model_sha256, seal);
  try {
    const std::vector<uint8_t> sealed = seal.seal(kSealCalibration, key, calibration_serialize(cal));
    detail::Redis r = connect(o, sealed.size());
    detail::RedisCommand set{"SET", key, std::string(sealed.begin(), sealed.end()), "NX"};
    if (o.redis_ttl_s > 0) {
      set.push_back("EX");
      set.push_back(std::to_string(o.redis_ttl_s));
    }
    const detail::RedisReply put = r.run1(set);
    if (!put.ok()) {
      log(o, "SET " + key + ": " + put.str);
      return std::nullopt;
    }
    if (put.type == detail::RedisReply::Type::kStatus) return cal;  // OK: ours is the fleet's
  } catch (const std::exception& e) {
    log(o, std::string("Redis: ") + e.what());
    return std::nullopt;
  }
  // Nil: another process published first; that one is the fleet's.
  return fetch_shared_calibration(o, model_sha256);
}

}  // namespace kvtc
