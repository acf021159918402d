// kvtc: a minimal, bounds-checked safetensors reader and writer.
//
// Format (https://huggingface.co/docs/safetensors): u64 little-endian header
// length N, N bytes of JSON {name: {dtype, shape, data_offsets: [b, e]},
// "__metadata__": {string: string}}, then the data buffer; offsets are
// relative to the start of the data buffer. We write tensors in insertion
// order, contiguously, with the header padded by spaces to a multiple of 8
// bytes so that every tensor starts 8-byte aligned.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace kvtc {

enum class DType { F16, BF16, F32, I32, U8 };
const char* dtype_name(DType t);
size_t dtype_size(DType t);

struct Tensor {
  DType dtype = DType::U8;
  std::vector<uint64_t> shape;
  std::vector<uint8_t> data;  // little-endian, row-major, product(shape) * dtype_size bytes
  uint64_t numel() const;
};

struct SafeTensors {
  std::map<std::string, std::string> metadata;
  std::vector<std::pair<std::string, Tensor>> tensors;  // in file order

  // Returns the tensor or throws Error naming `origin` (a file path, for
  // messages) and the missing name.
  const Tensor& get(const std::string& name, const std::string& origin = "safetensors") const;
  const Tensor* find(const std::string& name) const;
  void add(const std::string& name, Tensor t);
};

std::vector<uint8_t> safetensors_serialize(const SafeTensors& st);
// Parses a whole file image. Every length and offset is checked against the
// bytes present before anything is allocated; `origin` names the source in
// errors. Limits: header <= 64 MiB, rank <= 8.
SafeTensors safetensors_parse(std::span<const uint8_t> bytes, const std::string& origin);

SafeTensors safetensors_load(const std::string& path);
void safetensors_save(const std::string& path, const SafeTensors& st);  // atomic replace

}  // namespace kvtc
