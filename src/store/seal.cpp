#include "store/seal.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include <algorithm>
#include <cstring>
#include <memory>

namespace kvtc::store {
namespace {

// The byte formats (docs/store.md "Secrets"). A sealed value ends in an
// 8-byte trailer: magic, format version, mode, two reserved zero bytes.
constexpr uint8_t kMagic[4] = {'K', 'V', 'S', 'L'};
constexpr uint8_t kVersion = 1;
constexpr size_t kTrailer = 8;
constexpr size_t kHmacTag = 32;  // HMAC-SHA256, whole
constexpr size_t kNonce = 12;    // GCM's 96-bit nonce: random per value (RAND_bytes)
constexpr size_t kGcmTag = 16;   // GCM's full 128-bit tag
// The authenticated data's domain tag: no other use of these keys can
// produce the same MAC input.
constexpr char kDomain[] = "kvtc-seal/1";
// HKDF's salt and the four labels, one per derived key.
constexpr char kHkdfSalt[] = "kvtc-store-secret/1";
constexpr char kLabelChain[] = "kvtc key chain";
constexpr char kLabelAuth[] = "kvtc authentication";
constexpr char kLabelEnc[] = "kvtc encryption";
constexpr char kLabelId[] = "kvtc key id";

std::span<const uint8_t> str_bytes(const char* s) {
  return {reinterpret_cast<const uint8_t*>(s), std::strlen(s)};
}

// Incremental HMAC-SHA256 (OpenSSL 3's EVP_MAC): the MAC input is the
// authenticated data and then the value, without concatenating them.
class Hmac {
 public:
  explicit Hmac(std::span<const uint8_t> key) {
    mac_ = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
    ctx_ = mac_ ? EVP_MAC_CTX_new(mac_) : nullptr;
    char digest[] = "SHA256";
    OSSL_PARAM p[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0), OSSL_PARAM_construct_end()};
    require(ctx_ && EVP_MAC_init(ctx_, key.data(), key.size(), p) == 1, "kvtc store: HMAC-SHA256: OpenSSL init failed");
  }
  ~Hmac() {
    EVP_MAC_CTX_free(ctx_);
    EVP_MAC_free(mac_);
  }
  Hmac& update(std::span<const uint8_t> b) {
    require(EVP_MAC_update(ctx_, b.data(), b.size()) == 1, "kvtc store: HMAC-SHA256: OpenSSL update failed");
    return *this;
  }
  std::vector<uint8_t> final() {
    std::vector<uint8_t> out(kHmacTag);
    size_t n = 0;
    require(EVP_MAC_final(ctx_, out.data(), &n, out.size()) == 1 && n == kHmacTag, "kvtc store: HMAC-SHA256: OpenSSL final failed");
    return out;
  }

 private:
  EVP_MAC* mac_ = nullptr;
  EVP_MAC_CTX* ctx_ = nullptr;
};

struct CipherCtx {
  EVP_CIPHER_CTX* c = EVP_CIPHER_CTX_new();
  ~CipherCtx() { EVP_CIPHER_CTX_free(c); }
};

// EVP's lengths are int: values are fed in pieces of at most 1 GiB.
template <class F>
void in_pieces(size_t n, F&& f) {
  constexpr size_t kPiece = size_t(1) << 30;
  for (size_t at = 0; at < n; at += kPiece) f(at, int(std::min(kPiece, n - at)));
}

}  // namespace

std::vector<uint8_t> hmac_sha256(std::span<const uint8_t> key, std::span<const uint8_t> data) {
  return Hmac(key).update(data).final();
}

std::vector<uint8_t> hkdf_sha256(std::span<const uint8_t> ikm, std::span<const uint8_t> salt, std::span<const uint8_t> info, size_t n) {
  require(n <= 255 * kHmacTag, "kvtc store: HKDF-SHA256: at most 8160 bytes");
  const std::vector<uint8_t> prk = hmac_sha256(salt, ikm);  // extract
  std::vector<uint8_t> out, t;
  for (uint8_t i = 1; out.size() < n; ++i) {  // expand: T(i) = HMAC(PRK, T(i-1) | info | i)
    const uint8_t c = i;
    t = Hmac(prk).update(t).update(info).update(std::span(&c, 1)).final();
    out.insert(out.end(), t.begin(), t.end());
  }
  out.resize(n);
  return out;
}

Sealer::Sealer(std::span<const uint8_t> secret, bool encrypt) {
  require(!encrypt || !secret.empty(), "kvtc store: encrypt needs a secret (StoreOptions::secret)");
  if (secret.empty()) return;
  require(secret.size() >= kMinSecretBytes, "kvtc store: the secret is " + std::to_string(secret.size()) + " bytes, expected at least " +
                                                std::to_string(kMinSecretBytes) + " (e.g. openssl rand 32 > secret)");
  const auto salt = str_bytes(kHkdfSalt);
  chain_ = hkdf_sha256(secret, salt, str_bytes(kLabelChain), 32);
  auth_ = hkdf_sha256(secret, salt, str_bytes(kLabelAuth), 32);
  enc_ = hkdf_sha256(secret, salt, str_bytes(kLabelEnc), 32);
  key_id_ = hex(hkdf_sha256(secret, salt, str_bytes(kLabelId), 8));
  mode_ = encrypt ? 2 : 1;
  protection_ = std::string(encrypt ? "aes-256-gcm" : "hmac-sha256") + ";key=" + key_id_;
}

Sealer::~Sealer() {
  for (std::vector<uint8_t>* k : {&chain_, &auth_, &enc_})
    if (!k->empty()) OPENSSL_cleanse(k->data(), k->size());
}

size_t Sealer::overhead() const {
  return mode_ == 0 ? 0 : mode_ == 1 ? kHmacTag + kTrailer : kNonce + kGcmTag + kTrailer;
}

std::vector<uint8_t> Sealer::ad(char kind, const std::string& key) const {
  require(key.size() <= 0xffff, "kvtc store: a value's key of " + std::to_string(key.size()) + " bytes, expected at most 65535");
  std::vector<uint8_t> a(kDomain, kDomain + std::strlen(kDomain));
  a.push_back(uint8_t(kind));
  a.push_back(uint8_t(key.size()));  // u16 LE: the store's keys are 64 or 129 characters
  a.push_back(uint8_t(key.size() >> 8));
  a.insert(a.end(), key.begin(), key.end());
  a.insert(a.end(), kMagic, kMagic + 4);
  a.insert(a.end(), {kVersion, uint8_t(mode_), 0, 0});
  return a;
}

std::vector<uint8_t> Sealer::seal(char kind, const std::string& key, std::span<const uint8_t> plain) const {
  if (mode_ == 0) return {plain.begin(), plain.end()};
  const std::vector<uint8_t> a = ad(kind, key);
  std::vector<uint8_t> out;
  out.reserve(plain.size() + overhead());
  if (mode_ == 1) {
    out.assign(plain.begin(), plain.end());
    const std::vector<uint8_t> tag = Hmac(auth_).update(a).update(plain).final();
    out.insert(out.end(), tag.begin(), tag.end());
  } else {
    out.resize(kNonce + plain.size() + kGcmTag);
    require(RAND_bytes(out.data(), int(kNonce)) == 1, "kvtc store: RAND_bytes failed: no nonce to encrypt with");
    CipherCtx x;
    int len = 0;
    require(x.c && EVP_EncryptInit_ex(x.c, EVP_aes_256_gcm(), nullptr, nullptr, nullptr) == 1 &&
                EVP_CIPHER_CTX_ctrl(x.c, EVP_CTRL_GCM_SET_IVLEN, int(kNonce), nullptr) == 1 &&
                EVP_EncryptInit_ex(x.c, nullptr, nullptr, enc_.data(), out.data()) == 1 &&
                EVP_EncryptUpdate(x.c, nullptr, &len, a.data(), int(a.size())) == 1,
            "kvtc store: AES-256-GCM: OpenSSL init failed");
    in_pieces(plain.size(), [&](size_t at, int n) {
      require(EVP_EncryptUpdate(x.c, out.data() + kNonce + at, &len, plain.data() + at, n) == 1 && len == n,
              "kvtc store: AES-256-GCM: encryption failed");
    });
    require(EVP_EncryptFinal_ex(x.c, out.data() + kNonce + plain.size(), &len) == 1 && len == 0 &&
                EVP_CIPHER_CTX_ctrl(x.c, EVP_CTRL_GCM_GET_TAG, int(kGcmTag), out.data() + kNonce + plain.size()) == 1,
            "kvtc store: AES-256-GCM: encryption failed");
  }
  out.insert(out.end(), a.end() - kTrailer, a.end());
  return out;
}

void Sealer::open(char kind, const std::string& key, std::vector<uint8_t>& v, const std::string& origin) const {
  if (mode_ == 0) return;
  auto foreign = [&](const std::string& why) { return ForeignValue(origin + ": " + why + " (foreign: dropped, never decoded)"); };
  if (v.size() < overhead() || std::memcmp(v.data() + v.size() - kTrailer, kMagic, 4) != 0)
    throw foreign("not sealed (no kvtc seal trailer): written without the store's secret");
  if (key.size() > 0xffff) throw foreign("a key of " + std::to_string(key.size()) + " bytes (none is longer than 65535)");
  const uint8_t* t = v.data() + v.size() - kTrailer;
  if (t[4] != kVersion) throw foreign("seal version " + std::to_string(t[4]) + ", expected " + std::to_string(kVersion));
  if (t[5] != mode_ || t[6] || t[7])
    throw foreign(std::string("sealed in mode ") + std::to_string(t[5]) + ", expected " + std::to_string(mode_) +
                  (mode_ == 1 ? " (hmac-sha256)" : " (aes-256-gcm)"));
  const std::vector<uint8_t> a = ad(kind, key);
  if (mode_ == 1) {
    const size_t n = v.size() - overhead();
    const std::vector<uint8_t> tag = Hmac(auth_).update(a).update(std::span(v).first(n)).final();
    if (CRYPTO_memcmp(tag.data(), v.data() + n, kHmacTag) != 0)
      throw foreign("HMAC-SHA256 tag mismatch: another secret, another key, or changed bytes");
    v.resize(n);
    return;
  }
  const size_t n = v.size() - overhead();
  std::vector<uint8_t> out(n);
  CipherCtx x;
  int len = 0;
  require(x.c && EVP_DecryptInit_ex(x.c, EVP_aes_256_gcm(), nullptr, nullptr, nullptr) == 1 &&
              EVP_CIPHER_CTX_ctrl(x.c, EVP_CTRL_GCM_SET_IVLEN, int(kNonce), nullptr) == 1 &&
              EVP_DecryptInit_ex(x.c, nullptr, nullptr, enc_.data(), v.data()) == 1 &&
              EVP_DecryptUpdate(x.c, nullptr, &len, a.data(), int(a.size())) == 1,
          "kvtc store: AES-256-GCM: OpenSSL init failed");
  in_pieces(n, [&](size_t at, int k) {
    require(EVP_DecryptUpdate(x.c, out.data() + at, &len, v.data() + kNonce + at, k) == 1 && len == k, "kvtc store: AES-256-GCM: decryption failed");
  });
  uint8_t tag[kGcmTag];
  std::memcpy(tag, v.data() + kNonce + n, kGcmTag);
  require(EVP_CIPHER_CTX_ctrl(x.c, EVP_CTRL_GCM_SET_TAG, int(kGcmTag), tag) == 1, "kvtc store: AES-256-GCM: OpenSSL failed");
  uint8_t fin[16];
  if (EVP_DecryptFinal_ex(x.c, fin, &len) != 1) {
    OPENSSL_cleanse(out.data(), out.size());  // unauthenticated plaintext is never handed out
    throw foreign("AES-256-GCM tag mismatch: another secret, another key, or changed bytes");
  }
  v = std::move(out);
}

std::string hex(std::span<const uint8_t> b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (uint8_t x : b) {
    s.push_back(d[x >> 4]);
    s.push_back(d[x & 15]);
  }
  return s;
}

}  // namespace kvtc::store
