// Internal: the prompt store's key scheme and entry file (docs/store.md
// "Keys" and "Entry file"), written once for every tier. What two stores
// must agree on to share pieces lives here and nowhere else: how a prompt
// is cut into chunks and a tail, the salt that names a store's settings,
// the chained SHA-256 keys, and the bytes of an entry (.kvse) file.
// Thread safety: a Scheme is immutable after construction; its members
// are reentrant.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvtc::store {

using Bytes = std::vector<uint8_t>;
using BytesPtr = std::shared_ptr<const Bytes>;  // pieces are shared, never changed once coded

// Version 2 added the kv_settings line to the salt (version 1 stores are
// another salt, another directory and Redis namespace: never read).
constexpr const char* kStoreScheme = "kvtc-store/2";

// Little-endian integers of the store's byte formats (entry files, Redis index values).
inline uint32_t get_le32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(p[i]) << (8 * i);
  return v;
}
inline uint64_t get_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

// Leading tokens a and b have in common.
size_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b);

// A stored prompt as the tiers index it: its tokens (positions 0..n-1),
// the keys of its full chunks in order, its entry key, and the root of its
// key chain (its tenant's: Scheme::tenant_root). Tiers that compare tokens
// in memory match only pieces of the lookup's root.
struct Piece {
  std::string key;
  std::vector<int32_t> tokens;
  std::vector<std::string> chunks;  // keys of chunks 1..m
  std::string root;                 // c_0: Scheme::root() (tenant ""), or a tenant's root
};

// What names a store's pieces: the salt's fields (docs/store.md "Salt").
struct SchemeFields {
  std::string model_sha256, calibration_id;
  uint32_t container_version = 1;
  // The pieces' window bits: named apart (salt line, fingerprint key) only
  // from container version 4 on, where 8 and 16 share the version (before,
  // version 3 named the 8-bit window; those texts stay unchanged).
  uint32_t window_bits = 16;
  uint32_t chunk_tokens = 256;
  std::string ratio;  // ratio_key(ratio), "-ecsq" appended when entropy-coded, or "raw"
  uint32_t sink = 4, window = 128;
  std::string kv_settings;  // KvSettings::text(): the context's RoPE as llama.cpp resolved it
  // Sliding-window (iSWA) models: "end;n_swa=<n_swa>" (docs/store.md
  // "Sliding-window models": the window's state in the tail, the prompt's
  // end only); "" for single-block caches (the salt is then unchanged).
  std::string swa;
  // With a secret (store/seal.h): "hmac-sha256;key=<key id>" or
  // "aes-256-gcm;key=<key id>", the salt's last line; "" without one (the
  // salt is then exactly version 2's).
  std::string protection;
};

class Scheme {
 public:
  // chain_key: the key chain's key when the store has a secret (its links
  // are then HMAC-SHA256 under it, the root HMAC(chain_key, salt)); empty:
  // SHA-256 links from the salt.
  explicit Scheme(const SchemeFields& f, std::vector<uint8_t> chain_key = {});
  ~Scheme();  // wipes the chain key
  Scheme(const Scheme&) = delete;
  Scheme& operator=(const Scheme&) = delete;

  const std::string& salt() const { return salt_; }      // 64 hex digits: the store's public fingerprint
  const std::string& compat() const { return compat_; }  // its first 16: the store's directory and Redis namespace
  // The chain's root, c_0 (64 hex digits): the salt, or with a secret
  // HMAC-SHA256(chain key, salt), which nobody without the secret can compute.
  const std::string& root() const { return root_; }
  uint32_t chunk_tokens() const { return f_.chunk_tokens; }
  const SchemeFields& fields() const { return f_; }

  // The root of `tenant`'s key chain (docs/store.md "Tenants"): root()
  // itself for "" (every key and file exactly as without tenants), else
  // derived from it and the tenant's bytes (keyed as the links when there
  // is a secret), so that two tenants' chains never share a key.
  std::string tenant_root(std::string_view tenant) const;
  // c_1..c_m of `tokens` (at least m * chunk_tokens of them) on the chain from `root`.
  std::vector<std::string> chunk_keys(std::span<const int32_t> tokens, uint32_t m, const std::string& root) const;
  // The entry key of a prompt whose full chunks are `chunks` (`root`: c_0, for a prompt without one).
  std::string entry_key(std::span<const int32_t> tokens, const std::vector<std::string>& chunks, const std::string& root) const;
  // Full chunks of an n-token prompt: those that end at or before the raw
  // window, so a chunk never holds a token the tail keeps raw.
  uint32_t full_chunks(size_t n) const;
  // The Piece of a whole prompt (keys computed from its tokens and `root`).
  Piece piece_of(std::vector<int32_t> tokens, const std::string& root) const;

  // The salt's fields as JSON text (store.json, and every entry file's header).
  std::string fingerprint_json(int indent = -1) const;
  // An entry (.kvse) file: header, tokens, tail container.
  Bytes entry_file(const Piece& e, std::span<const uint8_t> tail) const;
  // An entry of a tenant names its root in the header (tenant_root); one
  // of tenant "" is byte for byte the file without tenants.
  // Parses and checks an entry file (checksum, salt, sizes, keys recomputed
  // from the tokens and the header's root); Error names `origin` and what
  // is wrong. `tail` receives the tail container when given.
  Piece parse_entry(std::span<const uint8_t> f, const std::string& origin, Bytes* tail) const;

 private:
  std::string link(char domain, const std::string& parent, std::span<const int32_t> tokens) const;
  SchemeFields f_;
  std::vector<uint8_t> chain_key_;
  std::string salt_, compat_, root_;
};

}  // namespace kvtc::store
