#include "kvtc/calibration.h"

#include <xxhash.h>

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "kvtc/error.h"
#include "kvtc/util.h"

namespace kvtc {

namespace {

const char* kKindName[2] = {"k", "v"};
const char* kBlockSfx[2] = {"", "_swa"};

std::string prefix(size_t b, int kind) {
  return std::string(kKindName[kind]) + kBlockSfx[b];
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

}  // namespace

// XXH64 over every tensor's bytes in file order: integrity of the whole
// file (errors and tables too), ~10 GB/s, where calibration_id covers only
// what the decoder uses.
static std::string tensors_checksum(const SafeTensors& st) {
  XXH64_state_t* h = XXH64_createState();
  XXH64_reset(h, 0);
  for (const auto& [name, t] : st.tensors) {
    XXH64_update(h, name.data(), name.size());
    XXH64_update(h, t.data.data(), t.data.size());
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)XXH64_digest(h));
  XXH64_freeState(h);
  return buf;
}

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

SafeTensors calibration_to_safetensors(const Calibration& c) {
  SafeTensors st;
  st.metadata = c.meta;
  st.metadata["format"] = kCalibFormat;
  st.metadata["format_version"] = std::to_string(kCalibFormatVersion);
  st.metadata["n_blocks"] = std::to_string(c.blocks.size());
  st.metadata["calibration_id"] = calibration_compute_id(c);
  for (size_t b = 0; b < c.blocks.size(); ++b)
    for (int kind = 0; kind < 2; ++kind) {
      const Transform& t = c.blocks[b][kind];
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
  st.metadata["tensors_xxh64"] = tensors_checksum(st);
  return st;
}

Calibration calibration_from_safetensors(const SafeTensors& st, const std::string& origin, bool decoder_only) {
  auto meta = [&](const std::string& k) -> const std::string& {
    auto it = st.metadata.find(k);
    require(it != st.metadata.end(), origin + ": __metadata__['" + k + "'] is missing (not a kvtc calibration?)");
    return it->second;
  };
  require(meta("format") == kCalibFormat, origin + ": __metadata__['format'] is '" + meta("format") + "', expected '" + kCalibFormat + "'");
  require(meta("format_version") == std::to_string(kCalibFormatVersion),
          origin + ": calibration format_version " + meta("format_version") + ", this kvtc reads " + std::to_string(kCalibFormatVersion));
  require(meta("tensors_xxh64") == tensors_checksum(st), origin + ": tensor checksum mismatch (corrupted calibration file)");
  Calibration c;
  c.meta = st.metadata;
  if (auto it = c.meta.find("keys_rope"); it != c.meta.end())
    require(it->second == "removed" || it->second == "kept",
            origin + ": __metadata__['keys_rope'] is '" + it->second + "', expected 'removed' or 'kept'");
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
          for (const auto& x : it.value().at("blocks")) {
            BlockAlloc ba{x.at(0).get<uint32_t>(), x.at(1).get<uint32_t>(), QType(x.at(2).get<int>())};
            require(int(ba.type) >= 0 && int(ba.type) < kNumQTypes && ba.size > 0 && ba.start + ba.size <= t.r, "bad block");
            a.blocks.push_back(ba);
          }
          t.tables[it.key()] = a;
        }
      } catch (const std::exception& e) {
        throw Error(origin + ": allocation tables of " + pf + " are malformed: " + e.what());
      }
    }
  c.id = calibration_compute_id(c);
  require(c.id == meta("calibration_id"), origin + ": calibration_id does not match the mean and basis it carries (corrupted file?)");
  return c;
}

void calibration_save(const std::string& path, const Calibration& c) {
  safetensors_save(path, calibration_to_safetensors(c));
}

Calibration calibration_load(const std::string& path, bool decoder_only) {
  return calibration_from_safetensors(safetensors_load(path), path, decoder_only);
}

}  // namespace kvtc
