// The calibration file (docs/calibration-format.md): format version 2
// checksums every byte of the file; version 1 files (tensors and id
// checked, header not) are still read.
#include "kvtc/calibration.h"

#include <xxhash.h>

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "codec/calibration_io.h"
#include "core/capture_io.h"
#include "core/util.h"
#include "format/quantizers.h"
#include "kvtc/error.h"

namespace kvtc {

namespace {

constexpr const char* kCalibFormat = "kvtc-calibration";
constexpr int kCalibFormatVersion = 2;
// The file checksum's metadata entry as the serializer writes it (compact
// JSON): found in the raw header, its 16 hex digits zeroed for hashing.
constexpr const char* kFileSumKey = "file_xxh64";
constexpr const char* kFileSumPattern = "\"file_xxh64\":\"";
constexpr const char* kZeroSum = "0000000000000000";

const char* kKindName[2] = {"k", "v"};
const char* kBlockSfx[2] = {"", "_swa"};

std::string prefix(size_t b, int kind) {
  return std::string(kKindName[kind]) + kBlockSfx[b];
}

std::string hex16(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)x);
  return buf;
}

Tensor f32_tensor(const std::vector<float>& x, std::vector<uint64_t> shape) {
  Tensor t;
  t.dtype = DType::F32;
  t.shape = std::move(shape);
  t.data.resize(x.size() * 4);
  std::memcpy(t.data.data(), x.data(), t.data.size());
  return t;
}

std::vector<float> f32_of(const Tensor& t, const std::vector<uint64_t>& shape, const std::string& what) {
  require(t.dtype == DType::F32 && t.shape == shape, what + ": expected F32 of the shape the metadata implies");
  std::vector<float> v(t.numel());
  std::memcpy(v.data(), t.data.data(), t.data.size());
  return v;
}

// Version 1's integrity: XXH64 over every tensor's name and bytes in file
// order (the JSON header was not covered).
std::string tensors_checksum(const SafeTensors& st) {
  XXH64_state_t* h = XXH64_createState();
  XXH64_reset(h, 0);
  for (const auto& [name, t] : st.tensors) {
    XXH64_update(h, name.data(), name.size());
    XXH64_update(h, t.data.data(), t.data.size());
  }
  const uint64_t d = XXH64_digest(h);
  XXH64_freeState(h);
  return hex16(d);
}

// Offset of the file checksum's 16 hex digits in the raw bytes, or an
// Error: the entry must occur exactly once in the JSON header.
size_t file_sum_at(std::span<const uint8_t> bytes, const std::string& origin) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(bytes[i]) << (8 * i);  // safetensors_parse checked it
  const std::string_view header(reinterpret_cast<const char*>(bytes.data()) + 8, size_t(n));
  const std::string_view pat(kFileSumPattern);
  const size_t at = header.find(pat);
  require(at != std::string_view::npos && header.find(pat, at + 1) == std::string_view::npos && at + pat.size() + 17 <= header.size() &&
              header[at + pat.size() + 16] == '"',
          origin + ": __metadata__['file_xxh64'] is missing or malformed (corrupted calibration file)");
  return 8 + at + pat.size();
}

// XXH64 of the whole file with the checksum's digits read as zeros.
uint64_t file_sum(std::span<const uint8_t> bytes, size_t at) {
  XXH64_state_t* h = XXH64_createState();
  XXH64_reset(h, 0);
  XXH64_update(h, bytes.data(), at);
  XXH64_update(h, kZeroSum, 16);
  XXH64_update(h, bytes.data() + at + 16, bytes.size() - at - 16);
  const uint64_t d = XXH64_digest(h);
  XXH64_freeState(h);
  return d;
}

// The keys that describe the file rather than the calibration's provenance.
bool structural_key(const std::string& k) {
  return k == "format" || k == "format_version" || k == "n_blocks" || k == "calibration_id" || k == "tensors_xxh64" || k == kFileSumKey ||
         (k.size() > 5 && k.compare(k.size() - 5, 5, ".info") == 0);
}

}  // namespace

std::string calibration_compute_id(const Calibration& c) {
  std::vector<uint8_t> buf;
  for (const auto& blk : c.blocks)
    for (const Transform& t : blk) {
      const auto* a = reinterpret_cast<const uint8_t*>(t.mu.data());
      buf.insert(buf.end(), a, a + t.mu.size() * 4);
      const auto* b = reinterpret_cast<const uint8_t*>(t.basis.data());
      buf.insert(buf.end(), b, b + t.basis.size() * 4);
    }
  return sha256_bytes(buf);
}

std::vector<uint8_t> calibration_serialize(const Calibration& c) {
  require(!c.blocks.empty() && c.blocks.size() <= 2, "calibration: expected 1 or 2 cache blocks");
  require(c.geometry.blocks.size() == c.blocks.size(), "calibration: the geometry must describe every block (CacheGeometry::blocks)");
  SafeTensors st;
  Meta m;
  for (const auto& [k, v] : c.meta)
    if (!structural_key(k)) m[k] = v;
  st.metadata = meta_with_geometry(m, c.geometry);
  const BlockGeometry& g0 = c.geometry.blocks[0];
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    const BlockGeometry& g = c.geometry.blocks[b];
    require(
        !g.layers.empty() && g.n_head_kv == g0.n_head_kv && g.head_dim == g0.head_dim && g.features() == c.blocks[b][0].p &&
            g.features() == c.blocks[b][1].p,
        "calibration: block " + std::to_string(b) + "'s geometry (layers x heads x dims) must match its p, with heads and dims alike in all blocks");
    st.metadata[std::string("layers") + kBlockSfx[b]] = layers_to_json(g.layers);
  }
  st.metadata["n_head_kv"] = std::to_string(g0.n_head_kv);
  st.metadata["head_dim"] = std::to_string(g0.head_dim);
  st.metadata["keys_rope"] = c.keys_derope ? "removed" : "kept";
  st.metadata["format"] = kCalibFormat;
  st.metadata["format_version"] = std::to_string(kCalibFormatVersion);
  st.metadata["n_blocks"] = std::to_string(c.blocks.size());
  st.metadata["calibration_id"] = calibration_compute_id(c);
  st.metadata[kFileSumKey] = kZeroSum;
  for (size_t b = 0; b < c.blocks.size(); ++b)
    for (int kind = 0; kind < 2; ++kind) {
      const Transform& t = c.blocks[b][kind];
      require(t.mu.size() == t.p && t.basis.size() == size_t(t.r) * t.p && t.variance.size() == t.r && t.block_errors.size() == t.sizes.size(),
              "calibration: transform " + prefix(b, kind) + " has arrays of the wrong size");
      const std::string pf = prefix(b, kind);
      st.add(pf + ".mu", f32_tensor(t.mu, {t.p}));
      st.add(pf + ".basis", f32_tensor(t.basis, {t.r, t.p}));
      st.add(pf + ".variance", f32_tensor(t.variance, {t.r}));
      nlohmann::json j;
      j["p"] = t.p;
      j["r"] = t.r;
      j["total_variance"] = t.total_variance;
      j["sizes"] = t.sizes;
      j["n_heldout"] = t.n_heldout;
      nlohmann::json tabs = nlohmann::json::object();
      for (const auto& [name, a] : t.tables) {
        nlohmann::json blocks = nlohmann::json::array();
        for (const BlockAlloc& x : a.blocks) blocks.push_back({x.start, x.size, int(x.type)});
        tabs[name] = {{"nominal_ratio", a.nominal_ratio}, {"budget_bits", a.budget_bits}, {"bits", a.bits}, {"error", a.error}, {"blocks", blocks}};
      }
      j["tables"] = tabs;
      st.metadata[pf + ".info"] = j.dump();
      for (size_t si = 0; si < t.sizes.size(); ++si)
        st.add(pf + ".errors." + std::to_string(t.sizes[si]), f32_tensor(t.block_errors[si], {t.r / t.sizes[si], uint64_t(kNumQTypes)}));
    }
  std::vector<uint8_t> bytes = safetensors_serialize(st);
  const size_t at = file_sum_at(bytes, "calibration");
  const std::string sum = hex16(file_sum(bytes, at));
  std::memcpy(bytes.data() + at, sum.data(), 16);
  return bytes;
}

Calibration calibration_parse(std::span<const uint8_t> bytes, const std::string& origin, bool decoder_only) {
  const SafeTensors st = safetensors_parse(bytes, origin);
  auto meta = [&](const std::string& k) -> const std::string& {
    auto it = st.metadata.find(k);
    require(it != st.metadata.end(), origin + ": __metadata__['" + k + "'] is missing (not a kvtc calibration?)");
    return it->second;
  };
  require(meta("format") == kCalibFormat, origin + ": __metadata__['format'] is '" + meta("format") + "', expected '" + kCalibFormat + "'");
  const std::string& version = meta("format_version");
  require(version == "1" || version == "2", origin + ": calibration format_version " + version + ", this kvtc reads versions 1 and 2");
#ifndef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
  if (version == "2") {
    const size_t at = file_sum_at(bytes, origin);
    const std::string stored(reinterpret_cast<const char*>(bytes.data()) + at, 16);
    require(stored == meta(kFileSumKey) && stored == hex16(file_sum(bytes, at)), origin + ": file checksum mismatch (corrupted calibration file)");
  } else {
    require(meta("tensors_xxh64") == tensors_checksum(st), origin + ": tensor checksum mismatch (corrupted calibration file)");
  }
#endif
  Calibration c;
  for (const auto& [k, v] : st.metadata)
    if (!structural_key(k)) c.meta[k] = v;
  if (auto it = c.meta.find("keys_rope"); it != c.meta.end()) {
    require(it->second == "removed" || it->second == "kept",
            origin + ": __metadata__['keys_rope'] is '" + it->second + "', expected 'removed' or 'kept'");
    c.keys_derope = it->second == "removed";
  }
  const std::string& nb = meta("n_blocks");
  require(nb == "1" || nb == "2", origin + ": __metadata__['n_blocks'] must be 1 or 2, found '" + nb + "'");
  c.blocks.resize(nb == "1" ? 1 : 2);
  for (size_t b = 0; b < c.blocks.size(); ++b)
    for (int kind = 0; kind < 2; ++kind) {
      Transform& t = c.blocks[b][kind];
      const std::string pf = prefix(b, kind);
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(meta(pf + ".info"));
        t.p = j.at("p").get<uint32_t>();
        t.r = j.at("r").get<uint32_t>();
        t.total_variance = j.at("total_variance").get<double>();
        t.sizes = j.at("sizes").get<std::vector<uint32_t>>();
        t.n_heldout = j.at("n_heldout").get<uint64_t>();
      } catch (const std::exception& e) {
        throw Error(origin + ": __metadata__['" + pf + ".info'] is malformed: " + e.what());
      }
      require(t.p > 0 && t.r > 0 && t.r <= t.p && t.p <= (1u << 20),
              origin + ": " + pf + ": implausible p " + std::to_string(t.p) + ", r " + std::to_string(t.r));
      t.mu = f32_of(st.get(pf + ".mu", origin), {t.p}, origin + ": tensor " + pf + ".mu");
      t.basis = f32_of(st.get(pf + ".basis", origin), {t.r, t.p}, origin + ": tensor " + pf + ".basis");
      t.variance = f32_of(st.get(pf + ".variance", origin), {t.r}, origin + ": tensor " + pf + ".variance");
      if (decoder_only) continue;
      for (uint32_t s : t.sizes) {
        require(s > 0 && s <= t.r, origin + ": " + pf + ": bad block size " + std::to_string(s));
        t.block_errors.push_back(f32_of(st.get(pf + ".errors." + std::to_string(s), origin), {t.r / s, uint64_t(kNumQTypes)},
                                        origin + ": tensor " + pf + ".errors." + std::to_string(s)));
      }
      try {
        for (auto it = j.at("tables").begin(); it != j.at("tables").end(); ++it) {
          Allocation a;
          a.nominal_ratio = it.value().at("nominal_ratio").get<double>();
          a.budget_bits = it.value().at("budget_bits").get<uint64_t>();
          a.bits = it.value().at("bits").get<uint64_t>();
          a.error = it.value().at("error").get<double>();
          uint32_t next = 0;
          for (const auto& x : it.value().at("blocks")) {
            const int ty = x.at(2).get<int>();
            BlockAlloc ba{x.at(0).get<uint32_t>(), x.at(1).get<uint32_t>(), QType(ty)};
            require(ty >= 0 && container::find_quantizer(uint32_t(ty)) && ba.size > 0 && ba.start == next && ba.start + ba.size <= t.r, "bad block");
            next = ba.start + ba.size;
            a.blocks.push_back(ba);
          }
          t.tables[it.key()] = a;
        }
      } catch (const std::exception& e) {
        throw Error(origin + ": allocation tables of " + pf + " are malformed: " + e.what());
      }
    }
  // Geometry: per block layers (layers / layers_swa) with the model's heads
  // and dims, where the file records them; RoPE and window as in captures.
  c.geometry.blocks.resize(c.blocks.size());
  auto num = [&](const char* k) -> uint32_t {
    auto it = c.meta.find(k);
    return it == c.meta.end() ? 0 : uint32_t(std::strtoul(it->second.c_str(), nullptr, 10));
  };
  for (size_t b = 0; b < c.blocks.size(); ++b) {
    BlockGeometry& g = c.geometry.blocks[b];
    const std::string lk = std::string("layers") + kBlockSfx[b];
    if (auto it = c.meta.find(lk); it != c.meta.end()) {
      g.layers = layers_from_json(it->second, origin + ": __metadata__['" + lk + "']");
      g.n_head_kv = num("n_head_kv");
      g.head_dim = num("head_dim");
    }
    if (g.features() != c.blocks[b][0].p || g.features() != c.blocks[b][1].p) {
      require(version == "1",
              origin + ": block " + std::to_string(b) + ": layers x n_head_kv x head_dim differs from p " + std::to_string(c.blocks[b][0].p));
      g = BlockGeometry{};  // a version 1 file without geometry: only p is known
    }
  }
  geometry_from_meta(c.meta, c.geometry, origin);
  c.id = calibration_compute_id(c);
  require(c.id == meta("calibration_id"), origin + ": calibration_id does not match the mean and basis it carries (corrupted file?)");
  return c;
}

void calibration_save(const std::string& path, const Calibration& c) {
  write_file_atomic(path, calibration_serialize(c));
}

Calibration calibration_load(const std::string& path, bool decoder_only) {
  return calibration_parse(read_file(path), path, decoder_only);
}

}  // namespace kvtc
