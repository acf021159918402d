// Internal: the prompt store's secrets (docs/store.md "Secrets"). With a
// secret (StoreOptions::secret) every value a tier keeps outside the
// process — disk files, Redis values — is sealed at the tier's boundary:
// authenticated with HMAC-SHA256, or with StoreOptions::encrypt encrypted
// and authenticated with AES-256-GCM; bound to the value's kind and key, so
// a value copied under another key fails as a forged one does. A value that
// fails to open is foreign: the tier drops it and never decodes it. The RAM
// tier and the queue of puts live in the process and hold plain bytes.
//
// Keys come from the secret by HKDF-SHA256 with one label each: the key
// chain's (the chain's links become HMACs, so nobody without the secret can
// compute a prompt's keys), authentication, encryption and a public key id
// (the salt's protection line names it: another secret or mode is another
// store). Without a secret nothing is sealed and the store is exactly as
// before (same salt, keys and bytes).
// Thread safety: a Sealer is immutable after construction; its members are
// reentrant (each call makes its own OpenSSL context).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvtc/error.h"

namespace kvtc::store {

// A value that failed to open: written without the secret, with another
// secret or mode, under another key, or changed since (a flipped bit fails
// the tag as a forgery does; the two cannot be told apart).
struct ForeignValue : Error {
  using Error::Error;
};

// RFC 5869 HKDF with SHA-256: extract with `salt`, expand `info` to `n`
// bytes (n <= 8160).
std::vector<uint8_t> hkdf_sha256(std::span<const uint8_t> ikm, std::span<const uint8_t> salt, std::span<const uint8_t> info, size_t n);
std::vector<uint8_t> hmac_sha256(std::span<const uint8_t> key, std::span<const uint8_t> data);
// Lower-case hex of `b` (keys, key ids).
std::string hex(std::span<const uint8_t> b);

// The kinds of sealed values (one byte of the authenticated data).
constexpr char kSealChunk = 'c';  // a chunk container (disk chunks/<key>.kvtc, Redis c:<key>)
constexpr char kSealEntry = 'e';  // an entry file (disk entries/<key>.kvse, Redis e:<key>)
constexpr char kSealIndex = 'x';  // a Redis index value (key: "<level key>/<entry key>")

class Sealer {
 public:
  // No secret: off (seal and open pass the bytes through). A secret shorter
  // than kMinSecretBytes, or encrypt without a secret: Error.
  Sealer(std::span<const uint8_t> secret, bool encrypt);
  ~Sealer();
  Sealer(const Sealer&) = delete;
  Sealer& operator=(const Sealer&) = delete;

  static constexpr size_t kMinSecretBytes = 32;  // 256 bits: the keys derived from it are no stronger than it

  bool on() const { return mode_ != 0; }
  bool encrypts() const { return mode_ == 2; }
  // The salt's protection line's value ("hmac-sha256;key=<16 hex>" or
  // "aes-256-gcm;key=<16 hex>"); "" when off.
  const std::string& protection() const { return protection_; }
  const std::string& key_id() const { return key_id_; }  // 16 hex digits; "" when off
  // The key chain's key (32 bytes; empty when off): keys.cpp's links.
  const std::vector<uint8_t>& chain_key() const { return chain_; }

  // Bytes a sealed value adds to its plain bytes (0 when off).
  size_t overhead() const;
  // `plain` sealed for (kind, key); a copy of it when off.
  std::vector<uint8_t> seal(char kind, const std::string& key, std::span<const uint8_t> plain) const;
  // Opens a value sealed for (kind, key) in place: `v` becomes its plain
  // bytes; ForeignValue naming `origin` and why when it does not open (`v`
  // is then left as it was). Nothing to do when off.
  void open(char kind, const std::string& key, std::vector<uint8_t>& v, const std::string& origin) const;
  // The same, returning the plain bytes (`v` moved in).
  std::vector<uint8_t> opened(char kind, const std::string& key, std::vector<uint8_t> v, const std::string& origin) const {
    open(kind, key, v, origin);
    return v;
  }

 private:
  std::vector<uint8_t> ad(char kind, const std::string& key) const;  // the authenticated data before the plain bytes
  int mode_ = 0;                                                     // 0 off, 1 hmac-sha256, 2 aes-256-gcm (the trailer's mode byte)
  std::vector<uint8_t> chain_, auth_, enc_;
  std::string key_id_, protection_;
};

}  // namespace kvtc::store
