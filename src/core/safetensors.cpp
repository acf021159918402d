#include "core/safetensors.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/util.h"
#include "kvtc/error.h"

namespace kvtc {

using json = nlohmann::json;

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F32: return "F32";
    case DType::I32: return "I32";
    case DType::U8: return "U8";
  }
  return "?";
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F16:
    case DType::BF16: return 2;
    case DType::F32:
    case DType::I32: return 4;
    case DType::U8: return 1;
  }
  return 1;
}

static bool dtype_from_name(const std::string& s, DType* t) {
  for (DType d : {DType::F16, DType::BF16, DType::F32, DType::I32, DType::U8}) {
    if (s == dtype_name(d)) {
      *t = d;
      return true;
    }
  }
  return false;
}

uint64_t Tensor::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

const Tensor* SafeTensors::find(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return &t;
  return nullptr;
}

const Tensor& SafeTensors::get(const std::string& name, const std::string& origin) const {
  const Tensor* t = find(name);
  require(t != nullptr, origin + ": tensor '" + name + "' is missing");
  return *t;
}

void SafeTensors::add(const std::string& name, Tensor t) {
  require(find(name) == nullptr, "safetensors: duplicate tensor name '" + name + "'");
  require(t.data.size() == t.numel() * dtype_size(t.dtype), "safetensors: tensor '" + name + "' data size does not match its shape");
  tensors.emplace_back(name, std::move(t));
}

std::vector<uint8_t> safetensors_serialize(const SafeTensors& st) {
  // nlohmann::ordered_json keeps insertion order, so the header lists tensors
  // in data order, which readers such as `safetensors` do not require but
  // which makes the file easy to read by eye.
  nlohmann::ordered_json h;
  if (!st.metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : st.metadata) m[k] = v;
    h["__metadata__"] = m;
  }
  uint64_t off = 0;
  for (const auto& [name, t] : st.tensors) {
    h[name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {off, off + t.data.size()}}};
    off += t.data.size();
  }
  std::string hs = h.dump();
  while ((8 + hs.size()) % 8 != 0) hs.push_back(' ');
  std::vector<uint8_t> out(8 + hs.size() + off);
  uint64_t n = hs.size();
  for (int i = 0; i < 8; ++i) out[i] = uint8_t(n >> (8 * i));
  std::memcpy(out.data() + 8, hs.data(), hs.size());
  uint8_t* p = out.data() + 8 + hs.size();
  for (const auto& [name, t] : st.tensors) {
    if (!t.data.empty()) std::memcpy(p, t.data.data(), t.data.size());
    p += t.data.size();
  }
  return out;
}

SafeTensors safetensors_parse(std::span<const uint8_t> bytes, const std::string& origin) {
  require(bytes.size() >= 8, origin + ": not a safetensors file (" + std::to_string(bytes.size()) + " bytes, the 8-byte header length is missing)");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(bytes[i]) << (8 * i);
  require(n <= (64u << 20), origin + ": safetensors header length " + std::to_string(n) + " exceeds the 64 MiB limit (not a safetensors file?)");
  require(n <= bytes.size() - 8,
          origin + ": truncated: header length " + std::to_string(n) + " but only " + std::to_string(bytes.size() - 8) + " bytes follow");
  json h;
  try {
    h = json::parse(bytes.begin() + 8, bytes.begin() + 8 + n);
  } catch (const std::exception& e) {
    throw Error(origin + ": safetensors header is not valid JSON: " + e.what());
  }
  require(h.is_object(), origin + ": safetensors header is not a JSON object");
  const uint64_t data_size = bytes.size() - 8 - n;
  const uint8_t* data = bytes.data() + 8 + n;
  SafeTensors st;
  struct Entry {
    std::string name;
    uint64_t b, e;
    Tensor t;
  };
  std::vector<Entry> entries;
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      require(v.is_object(), origin + ": __metadata__ must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        require(m.value().is_string(), origin + ": __metadata__['" + m.key() + "'] must be a string");
        st.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = origin + ": tensor '" + name + "'";
    require(v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
            where + ": expected an object with dtype, shape and data_offsets");
    Entry e;
    e.name = name;
    require(v["dtype"].is_string() && dtype_from_name(v["dtype"].get<std::string>(), &e.t.dtype),
            where + ": unsupported dtype (expected F16, BF16, F32, I32 or U8)");
    const json& shape = v["shape"];
    require(shape.is_array() && shape.size() <= 8, where + ": shape must be an array of rank <= 8");
    uint64_t numel = 1;
    for (const json& d : shape) {
      require(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0), where + ": shape entries must be non-negative integers");
      uint64_t x = d.get<uint64_t>();
      require(x == 0 || numel <= data_size / x, where + ": shape is larger than the file's data");
      numel *= x;
      e.t.shape.push_back(x);
    }
    const json& offs = v["data_offsets"];
    require(offs.is_array() && offs.size() == 2 && offs[0].is_number_unsigned() && offs[1].is_number_unsigned(),
            where + ": data_offsets must be two non-negative integers");
    e.b = offs[0].get<uint64_t>();
    e.e = offs[1].get<uint64_t>();
    require(e.b <= e.e && e.e <= data_size, where + ": data_offsets [" + std::to_string(e.b) + ", " + std::to_string(e.e) +
                                                "] outside the data buffer of " + std::to_string(data_size) + " bytes (truncated file?)");
    require(e.e - e.b == numel * dtype_size(e.t.dtype), where + ": data_offsets span " + std::to_string(e.e - e.b) + " bytes, shape and dtype need " +
                                                            std::to_string(numel * dtype_size(e.t.dtype)));
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.b < b.b; });
  uint64_t expect = 0;
  for (const Entry& e : entries) {
    require(e.b == expect, origin + ": tensor '" + e.name + "' starts at byte " + std::to_string(e.b) + ", expected " + std::to_string(expect) +
                               " (tensors must be contiguous and must not overlap)");
    expect = e.e;
  }
  require(expect == data_size, origin + ": " + std::to_string(data_size - expect) + " trailing bytes after the last tensor");
  for (Entry& e : entries) {
    e.t.data.assign(data + e.b, data + e.e);
    st.tensors.emplace_back(e.name, std::move(e.t));
  }
  return st;
}

SafeTensors safetensors_load(const std::string& path) {
  std::vector<uint8_t> bytes = read_file(path);
  return safetensors_parse(bytes, path);
}

void safetensors_save(const std::string& path, const SafeTensors& st) {
  std::vector<uint8_t> bytes = safetensors_serialize(st);
  write_file_atomic(path, bytes);
}

}  // namespace kvtc
