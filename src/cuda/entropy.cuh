// Internal (GPU path), kernel family (e): entropy coding and byte moves.
// DEFLATE through nvCOMP's batched C API (nvcomp/deflate.h; raw RFC 1951
// streams, at most 64 KiB per compressed stream, any size to decompress)
// when the build has it (KVTC_HAVE_NVCOMP), and a batched device memcpy used
// to lay sections out and to move raw f16 sections between a payload and
// the cache layout.
#pragma once

#include <string>

#include "common.cuh"

namespace kvtc::cuda {

struct CopyOp {
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  uint64_t bytes = 0;
};
// One CUDA block per op (ops of at most kCopyOpMax bytes: split larger ones
// with split_copy on the host).
constexpr uint64_t kCopyOpMax = 1u << 16;
void launch_batched_copy(const CopyOp* ops, uint32_t n_ops, cudaStream_t st);

namespace nvc {

bool built();           // the library was built with nvCOMP
std::string version();  // "6.0.0" or "none"
size_t alignment();     // slot alignment that satisfies nvCOMP's input, output and temp requirements (>= 16)
// Compression (chunks of at most 65536 bytes).
size_t compress_temp_bytes(size_t n_chunks, size_t max_chunk, size_t total, int algo);
size_t compress_max_output(size_t max_chunk, int algo);
void compress(const void* const* in_ptrs, const size_t* in_sizes, size_t max_chunk, size_t n_chunks, void* temp, size_t temp_bytes,
              void* const* out_ptrs, size_t* out_sizes, int* statuses, int algo, cudaStream_t st);
// Decompression (all arrays on the device). statuses: 0 = success.
size_t decompress_temp_bytes(size_t n_chunks, size_t max_chunk, size_t total);
void decompress(const void* const* in_ptrs, const size_t* in_sizes, const size_t* out_buf_sizes, size_t* out_actual, size_t n_chunks, void* temp,
                size_t temp_bytes, void* const* out_ptrs, int* statuses, cudaStream_t st);
std::string status_string(int status);

}  // namespace nvc

}  // namespace kvtc::cuda
