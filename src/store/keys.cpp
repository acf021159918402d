#include "store/keys.h"

#include <openssl/crypto.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/util.h"
#include "format/container.h"
#include "kvtc/error.h"
#include "kvtc/store.h"
#include "store/seal.h"

namespace kvtc::store {
namespace {

constexpr char kEntryMagic[4] = {'K', 'V', 'S', 'E'};
constexpr uint32_t kEntryVersion = 1;
constexpr size_t kEntryHeaderBytes = 20;  // magic, version, json length, xxh64

void put32(Bytes& o, uint32_t v) {
  for (int i = 0; i < 4; ++i) o.push_back(uint8_t(v >> (8 * i)));
}
void put64(Bytes& o, uint64_t v) {
  for (int i = 0; i < 8; ++i) o.push_back(uint8_t(v >> (8 * i)));
}

// A tenant's root: over the domain byte 't', the root it is derived from
// (64 ASCII hex digits) and the tenant's bytes as given, SHA-256, or
// HMAC-SHA256 under the chain key when there is a secret (as the links:
// nobody without it can then test a guessed tenant against the public
// names x:<root_T>). 't' is no link's domain, so a tenant root is never a
// chunk or entry key; the fixed 64-digit root before the tenant's bytes
// makes (root, tenant) -> digest one-to-one whatever bytes the tenant holds.
std::string derive_tenant_root(const std::vector<uint8_t>& chain_key, const std::string& root, std::string_view tenant) {
  Bytes b;
  b.reserve(1 + root.size() + tenant.size());
  b.push_back(uint8_t('t'));
  b.insert(b.end(), root.begin(), root.end());
  b.insert(b.end(), tenant.begin(), tenant.end());
  return chain_key.empty() ? sha256_bytes(b) : hex(hmac_sha256(chain_key, b));
}

bool is_hex64(const std::string& s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

nlohmann::json fingerprint(const SchemeFields& f, const std::string& salt) {
  nlohmann::json j = {{"scheme", kStoreScheme},
                      {"salt", salt},
                      {"model_sha256", f.model_sha256},
                      {"calibration_id", f.calibration_id},
                      {"container_version", f.container_version},
                      {"chunk_tokens", f.chunk_tokens},
                      {"ratio", f.ratio},
                      {"sink", f.sink},
                      {"window", f.window},
                      {"kv_settings", f.kv_settings}};
  // Only a protected store names its protection: the JSON of the others
  // (store.json, entry headers) stays byte for byte what it was.
  if (!f.protection.empty()) j["protection"] = f.protection;
  if (!f.swa.empty()) j["swa"] = f.swa;  // likewise: only an iSWA store has the field
  if (f.container_version >= 4 && f.window_bits != 16) j["window_bits"] = f.window_bits;
  return j;
}

}  // namespace

}  // namespace kvtc::store

namespace kvtc {

std::string KvSettings::text() const {
  if (*this == KvSettings{}) return "";
  return "rope_freq_base=" + fmt_g9(rope_freq_base) + ";rope_freq_scale=" + fmt_g9(rope_freq_scale) +
         ";n_ctx_orig_yarn=" + std::to_string(n_ctx_orig_yarn) + ";yarn_ext_factor=" + fmt_g9(yarn_ext_factor) +
         ";yarn_attn_factor=" + fmt_g9(yarn_attn_factor) + ";yarn_beta_fast=" + fmt_g9(yarn_beta_fast) + ";yarn_beta_slow=" + fmt_g9(yarn_beta_slow);
}

CacheGeometry geometry_with_settings(const CacheGeometry& g, const KvSettings& s) {
  if (s == KvSettings{}) return g;
  CacheGeometry out = g;
  for (size_t b = 0; b < out.blocks.size(); ++b) {
    Rope& r = out.blocks[b].rope;
    if (r.layout == RopeLayout::kNone) continue;
    if (!r.unsupported.empty()) {
      if (!r.yarn_unresolved) continue;  // a rotation no setting makes undoable
      r.unsupported.clear();
      r.yarn_unresolved = false;
    }
    if (b == 0) {
      r.freq_base = s.rope_freq_base;
      r.freq_scale = s.rope_freq_scale;
    }
    r.attn_factor = s.yarn_attn_factor;
    r.ext_factor = s.yarn_ext_factor;
    const bool yarn = s.yarn_ext_factor != 0;
    r.beta_fast = yarn ? s.yarn_beta_fast : Rope{}.beta_fast;
    r.beta_slow = yarn ? s.yarn_beta_slow : Rope{}.beta_slow;
    r.n_ctx_orig = yarn ? s.n_ctx_orig_yarn : 0;
  }
  return out;
}

}  // namespace kvtc

namespace kvtc::store {

size_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

Scheme::Scheme(const SchemeFields& f, std::vector<uint8_t> chain_key) : f_(f), chain_key_(std::move(chain_key)) {
  require(f.protection.empty() == chain_key_.empty(), "kvtc store: a protected scheme needs its chain key, and only it");
  std::string text = std::string(kStoreScheme) + "\nmodel_sha256=" + f.model_sha256 + "\ncalibration_id=" + f.calibration_id +
                     "\ncontainer_version=" + std::to_string(f.container_version) + "\nchunk_tokens=" + std::to_string(f.chunk_tokens) +
                     "\nratio=" + f.ratio + "\nsink=" + std::to_string(f.sink) + "\nwindow=" + std::to_string(f.window) +
                     "\nkv_settings=" + f.kv_settings + "\n";
  // Version 4 holds both windows: an 8-bit one is another store.
  if (f.container_version >= 4 && f.window_bits != 16) text += "window_bits=" + std::to_string(f.window_bits) + "\n";
  // A sliding-window model's pieces hold another layout (the window's state
  // in the tail); single-block stores keep version 2's text.
  if (!f.swa.empty()) text += "swa=" + f.swa + "\n";
  // Another secret or mode names another store: another directory and
  // Redis namespace. Without one the text is version 2's, unchanged.
  if (!f.protection.empty()) text += "protection=" + f.protection + "\n";
  salt_ = sha256_bytes(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  compat_ = salt_.substr(0, 16);
  root_ = chain_key_.empty() ? salt_ : hex(hmac_sha256(chain_key_, std::span(reinterpret_cast<const uint8_t*>(salt_.data()), salt_.size())));
}

Scheme::~Scheme() {
  if (!chain_key_.empty()) OPENSSL_cleanse(chain_key_.data(), chain_key_.size());
}

// One link of the key chain: over a domain byte ('c' chunk, 'e' entry),
// the parent's 64 hex digits and the tokens as little-endian int32,
// SHA-256, or HMAC-SHA256 under the chain key when there is a secret. Keyed
// links, not only a keyed root: every key is a public name (a file, a Redis
// key, x:<c_0> included), and from a name anyone could compute the next
// link of a guessed continuation if links were plain hashes.
std::string Scheme::link(char domain, const std::string& parent, std::span<const int32_t> tokens) const {
  Bytes b;
  b.reserve(1 + parent.size() + tokens.size() * 4);
  b.push_back(uint8_t(domain));
  b.insert(b.end(), parent.begin(), parent.end());
  for (int32_t t : tokens) put32(b, uint32_t(t));
  return chain_key_.empty() ? sha256_bytes(b) : hex(hmac_sha256(chain_key_, b));
}

std::string Scheme::tenant_root(std::string_view tenant) const {
  return tenant.empty() ? root_ : derive_tenant_root(chain_key_, root_, tenant);
}

std::vector<std::string> Scheme::chunk_keys(std::span<const int32_t> tokens, uint32_t m, const std::string& root) const {
  std::vector<std::string> keys;
  keys.reserve(m);
  std::string h = root;
  const uint32_t C = f_.chunk_tokens;
  for (uint32_t i = 0; i < m; ++i) keys.push_back(h = link('c', h, tokens.subspan(size_t(i) * C, C)));
  return keys;
}

std::string Scheme::entry_key(std::span<const int32_t> tokens, const std::vector<std::string>& chunks, const std::string& root) const {
  const size_t m = chunks.size();
  return link('e', m ? chunks.back() : root, tokens.subspan(m * f_.chunk_tokens));
}

uint32_t Scheme::full_chunks(size_t n) const {
  return n > f_.window ? uint32_t((n - f_.window) / f_.chunk_tokens) : 0;
}

Piece Scheme::piece_of(std::vector<int32_t> tokens, const std::string& root) const {
  Piece p;
  p.tokens = std::move(tokens);
  p.root = root;
  p.chunks = chunk_keys(p.tokens, full_chunks(p.tokens.size()), root);
  p.key = entry_key(p.tokens, p.chunks, root);
  return p;
}

std::string Scheme::fingerprint_json(int indent) const {
  return fingerprint(f_, salt_).dump(indent);
}

Bytes Scheme::entry_file(const Piece& e, std::span<const uint8_t> tail) const {
  require(is_hex64(e.root), "kvtc store: an entry without its chain's root");
  nlohmann::json j = fingerprint(f_, salt_);
  if (e.root != root_) j["tenant_root"] = e.root;  // tenant "": no field, the file as without tenants
  j["format"] = "kvtc-store-entry";
  j["version"] = kEntryVersion;
  j["key"] = e.key;
  j["n_tokens"] = e.tokens.size();
  j["chunks"] = e.chunks;
  j["tail_bytes"] = tail.size();
  const std::string js = j.dump();
  Bytes body(js.begin(), js.end());
  body.reserve(js.size() + 4 * e.tokens.size() + tail.size());
  for (int32_t t : e.tokens) put32(body, uint32_t(t));
  body.insert(body.end(), tail.begin(), tail.end());
  Bytes o(kEntryMagic, kEntryMagic + 4);
  put32(o, kEntryVersion);
  put32(o, uint32_t(js.size()));
  put64(o, container::xxh64(body.data(), body.size()));
  o.insert(o.end(), body.begin(), body.end());
  return o;
}

Piece Scheme::parse_entry(std::span<const uint8_t> f, const std::string& origin, Bytes* tail) const {
  require(f.size() >= kEntryHeaderBytes && std::memcmp(f.data(), kEntryMagic, 4) == 0, origin + ": not a kvtc store entry (magic)");
  require(get_le32(f.data() + 4) == kEntryVersion,
          origin + ": entry version " + std::to_string(get_le32(f.data() + 4)) + ", expected " + std::to_string(kEntryVersion));
  const uint32_t jl = get_le32(f.data() + 8);
  require(jl <= f.size() - kEntryHeaderBytes, origin + ": header length past the end (truncated file)");
  require(container::xxh64(f.data() + kEntryHeaderBytes, f.size() - kEntryHeaderBytes) == get_le64(f.data() + 12),
          origin + ": checksum mismatch (corrupted or truncated file)");
  Piece e;
  uint64_t tail_bytes = 0;
  try {
    const auto j = nlohmann::json::parse(f.begin() + kEntryHeaderBytes, f.begin() + kEntryHeaderBytes + jl);
    require(j.at("salt") == salt_, "salt: written by another model, calibration or setting");
    e.root = root_;
    if (j.contains("tenant_root")) {  // written only for a tenant other than ""
      e.root = j.at("tenant_root").get<std::string>();
      require(is_hex64(e.root) && e.root != root_, "tenant_root: 64 lower-case hex digits other than the store's root expected");
    }
    e.key = j.at("key").get<std::string>();
    const uint64_t n = j.at("n_tokens").get<uint64_t>();
    e.chunks = j.at("chunks").get<std::vector<std::string>>();
    tail_bytes = j.at("tail_bytes").get<uint64_t>();
    require(n <= (1u << 24) && f.size() - kEntryHeaderBytes - jl == n * 4 + tail_bytes, "n_tokens, tail_bytes: do not match the file size");
    const uint8_t* p = f.data() + kEntryHeaderBytes + jl;
    e.tokens.reserve(n);
    for (uint64_t i = 0; i < n; ++i) e.tokens.push_back(int32_t(get_le32(p + 4 * i)));
  } catch (const nlohmann::json::exception& x) {
    throw Error(origin + ": bad header: " + x.what());
  } catch (const Error& x) {
    throw Error(origin + ": " + x.what());
  }
  require(e.chunks.size() == full_chunks(e.tokens.size()) && chunk_keys(e.tokens, uint32_t(e.chunks.size()), e.root) == e.chunks &&
              entry_key(e.tokens, e.chunks, e.root) == e.key,
          origin + ": the keys do not match the tokens");
  if (tail) tail->assign(f.end() - std::ptrdiff_t(tail_bytes), f.end());
  return e;
}

}  // namespace kvtc::store
