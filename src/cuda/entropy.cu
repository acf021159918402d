#include <string>

#include "entropy.cuh"
#include "kvtc/error.h"

#ifdef KVTC_HAVE_NVCOMP
#include <nvcomp.h>
#include <nvcomp/deflate.h>
#endif

namespace kvtc::cuda {

namespace {

__global__ void batched_copy_kernel(const CopyOp* __restrict__ ops) {
  const CopyOp op = ops[blockIdx.x];
  const uintptr_t s = reinterpret_cast<uintptr_t>(op.src), d = reinterpret_cast<uintptr_t>(op.dst);
  if (((s | d) & 15) == 0) {
    const size_t n16 = op.bytes / 16;
    const uint4* s4 = reinterpret_cast<const uint4*>(op.src);
    uint4* d4 = reinterpret_cast<uint4*>(op.dst);
    for (size_t i = threadIdx.x; i < n16; i += blockDim.x) d4[i] = s4[i];
    for (size_t i = n16 * 16 + threadIdx.x; i < op.bytes; i += blockDim.x) op.dst[i] = op.src[i];
  } else if (((s | d) & 3) == 0) {
    const size_t n4 = op.bytes / 4;
    const uint32_t* s4 = reinterpret_cast<const uint32_t*>(op.src);
    uint32_t* d4 = reinterpret_cast<uint32_t*>(op.dst);
    for (size_t i = threadIdx.x; i < n4; i += blockDim.x) d4[i] = s4[i];
    for (size_t i = n4 * 4 + threadIdx.x; i < op.bytes; i += blockDim.x) op.dst[i] = op.src[i];
  } else {
    for (size_t i = threadIdx.x; i < op.bytes; i += blockDim.x) op.dst[i] = op.src[i];
  }
}

}  // namespace

void launch_batched_copy(const CopyOp* ops, uint32_t n_ops, cudaStream_t st) {
  if (n_ops == 0) return;
  batched_copy_kernel<<<n_ops, 256, 0, st>>>(ops);
  check_launch("batched_copy");
}

namespace nvc {

#ifdef KVTC_HAVE_NVCOMP

namespace {
void nv_check(nvcompStatus_t s, const char* what) {
  if (s != nvcompSuccess) throw Error(std::string("nvCOMP error in ") + what + ": " + nvcompGetStatusString(s));
}
nvcompBatchedDeflateCompressOpts_t copts(int algo) {
  nvcompBatchedDeflateCompressOpts_t o = nvcompBatchedDeflateCompressDefaultOpts;
  o.algorithm = algo;
  return o;
}
}  // namespace

bool built() {
  return true;
}

std::string version() {
  nvcompProperties_t p{};
  if (nvcompGetProperties(&p) != nvcompSuccess) return "?";
  return std::to_string(NVCOMP_MAJOR_FROM_SEMVER(p.version)) + "." + std::to_string(NVCOMP_MINOR_FROM_SEMVER(p.version)) + "." +
         std::to_string(NVCOMP_PATCH_FROM_SEMVER(p.version));
}

size_t alignment() {
  nvcompAlignmentRequirements_t a{}, b{};
  nv_check(nvcompBatchedDeflateCompressGetRequiredAlignments(copts(1), &a), "compress alignments");
  nv_check(nvcompBatchedDeflateDecompressGetRequiredAlignments(nvcompBatchedDeflateDecompressDefaultOpts, &b), "decompress alignments");
  size_t m = 16;
  for (size_t x : {a.input, a.output, a.temp, b.input, b.output, b.temp}) m = x > m ? x : m;
  return m;
}

size_t compress_temp_bytes(size_t n_chunks, size_t max_chunk, size_t total, int algo) {
  size_t t = 0;
  nv_check(nvcompBatchedDeflateCompressGetTempSize(n_chunks, max_chunk, copts(algo), &t, total, nullptr), "compress temp size");
  return t;
}

size_t compress_max_output(size_t max_chunk, int algo) {
  size_t m = 0;
  nv_check(nvcompBatchedDeflateCompressGetMaxOutputChunkSize(max_chunk, copts(algo), &m), "compress max output");
  return m;
}

void compress(const void* const* in_ptrs, const size_t* in_sizes, size_t max_chunk, size_t n_chunks, void* temp, size_t temp_bytes,
              void* const* out_ptrs, size_t* out_sizes, int* statuses, int algo, cudaStream_t st) {
  static_assert(sizeof(nvcompStatus_t) == sizeof(int), "nvcompStatus_t is an int-sized enum");
  nv_check(nvcompBatchedDeflateCompressAsync(in_ptrs, in_sizes, max_chunk, n_chunks, temp, temp_bytes, out_ptrs, out_sizes, copts(algo),
                                             reinterpret_cast<nvcompStatus_t*>(statuses), st),
           "compress");
}

size_t decompress_temp_bytes(size_t n_chunks, size_t max_chunk, size_t total) {
  size_t t = 0;
  nv_check(nvcompBatchedDeflateDecompressGetTempSize(n_chunks, max_chunk, nvcompBatchedDeflateDecompressDefaultOpts, &t, total, nullptr),
           "decompress temp size");
  return t;
}

void decompress(const void* const* in_ptrs, const size_t* in_sizes, const size_t* out_buf_sizes, size_t* out_actual, size_t n_chunks, void* temp,
                size_t temp_bytes, void* const* out_ptrs, int* statuses, cudaStream_t st) {
  nv_check(nvcompBatchedDeflateDecompressAsync(in_ptrs, in_sizes, out_buf_sizes, out_actual, n_chunks, temp, temp_bytes, out_ptrs,
                                               nvcompBatchedDeflateDecompressDefaultOpts, reinterpret_cast<nvcompStatus_t*>(statuses), st),
           "decompress");
}

std::string status_string(int status) {
  return nvcompGetStatusString(nvcompStatus_t(status));
}

#else  // no nvCOMP

[[noreturn]] static void none() {
  throw Error("kvtc was built without nvCOMP (KVTC_NVCOMP off)");
}
bool built() {
  return false;
}
std::string version() {
  return "none";
}
size_t alignment() {
  return 16;
}
size_t compress_temp_bytes(size_t, size_t, size_t, int) {
  none();
}
size_t compress_max_output(size_t, int) {
  none();
}
void compress(const void* const*, const size_t*, size_t, size_t, void*, size_t, void* const*, size_t*, int*, int, cudaStream_t) {
  none();
}
size_t decompress_temp_bytes(size_t, size_t, size_t) {
  none();
}
void decompress(const void* const*, const size_t*, const size_t*, size_t*, size_t, void*, size_t, void* const*, int*, cudaStream_t) {
  none();
}
std::string status_string(int status) {
  return std::to_string(status);
}

#endif

}  // namespace nvc

}  // namespace kvtc::cuda
