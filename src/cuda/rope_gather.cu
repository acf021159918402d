#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/scalar.h"
#include "elem.cuh"
#include "rope_gather.cuh"

namespace kvtc::cuda {

namespace {

__global__ void rope_table_kernel(const int32_t* __restrict__ pos, uint32_t n, RopeDev r, bool inverse, double* __restrict__ c,
                                  double* __restrict__ s) {
  const uint32_t half = r.n_rot / 2;
  for (size_t k = blockIdx.x * size_t(blockDim.x) + threadIdx.x; k < n; k += size_t(gridDim.x) * blockDim.x) {
    float theta = float(pos[k]);
    for (uint32_t i = 0; i < half; ++i) {
      const float ff = r.freq_factors ? r.freq_factors[i] : 1.0f;
      const float th = __fmul_rn(r.freq_scale, __fdiv_rn(theta, ff));
      double sn, cs;
      sincos(double(th), &sn, &cs);
      c[k * half + i] = cs;
      s[k * half + i] = inverse ? -sn : sn;
      theta = __fmul_rn(theta, r.theta_scale);
    }
  }
}

// Rotated value of element d of one head row (x0 = row[a], x1 = row[b]).
// rowf (+ rowmu, when given: the decoder's f32 add of the mean) or rowh
// is one head's row.
__device__ __forceinline__ float rotate(uint32_t d, int layout, uint32_t half, const float* rowf, const float* rowmu, const uint16_t* rowh,
                                        const double* c, const double* s) {
  const bool norm = layout == 1;
  const uint32_t i = norm ? d >> 1 : (d < half ? d : d - half);
  const bool is_a = norm ? (d & 1) == 0 : d < half;
  const uint32_t a = norm ? 2 * i : i, b = norm ? 2 * i + 1 : i + half;
  double x0, x1;
  if (rowf) {
    x0 = double(rowmu ? __fadd_rn(rowf[a], rowmu[a]) : rowf[a]);
    x1 = double(rowmu ? __fadd_rn(rowf[b], rowmu[b]) : rowf[b]);
  } else {
    x0 = double(f16_to_f32(rowh[a]));
    x1 = double(f16_to_f32(rowh[b]));
  }
  const double ci = c[i], si = s[i];
  const double y = is_a ? __dsub_rn(__dmul_rn(x0, ci), __dmul_rn(x1, si)) : __dadd_rn(__dmul_rn(x0, si), __dmul_rn(x1, ci));
  return __double2float_rn(y);
}

// One thread per (layer-head, row, dim); reads are coalesced along the
// cache (token-major per head), writes along a head's dims of a row.
// Idx: uint32_t when the job has < 2^32 elements (cheaper index math), else size_t.
template <typename T, typename Idx>
__global__ void gather_kernel(const uint16_t* __restrict__ cache, uint32_t lh, uint32_t n_tokens, uint32_t D, uint32_t tok0, uint32_t n,
                              const double* __restrict__ c, const double* __restrict__ s, RopeDev r, const float* __restrict__ mu,
                              T* __restrict__ out) {
  const Idx total = Idx(lh) * n * D;
  const size_t p = size_t(lh) * D;
  const uint32_t half = r.n_rot / 2;
  for (Idx idx = blockIdx.x * Idx(blockDim.x) + threadIdx.x; idx < total; idx += Idx(gridDim.x) * blockDim.x) {
    const uint32_t d = uint32_t(idx % D);
    const Idx rest = idx / D;
    const uint32_t row = uint32_t(rest % n);
    const uint32_t h = uint32_t(rest / n);
    const uint16_t* src = cache + (size_t(h) * n_tokens + tok0 + row) * D;
    float v;
    if (c && d < r.n_rot)
      v = rotate(d, r.layout, half, nullptr, nullptr, src, c + size_t(row) * half, s + size_t(row) * half);
    else
      v = f16_to_f32(src[d]);
    const size_t f = size_t(h) * D + d;
    if (mu) v = __fsub_rn(v, mu[f]);
    store_elem<T>(out + size_t(row) * p + f, v);
  }
}

template <typename Idx>
__global__ void scatter_kernel(const float* __restrict__ x, const float* __restrict__ mu, uint32_t n, const int32_t* __restrict__ row_tok,
                               const double* __restrict__ c, const double* __restrict__ s, RopeDev r, uint16_t* __restrict__ cache, uint32_t lh,
                               uint32_t n_tokens, uint32_t D) {
  const Idx total = Idx(lh) * n * D;
  const size_t p = size_t(lh) * D;
  const uint32_t half = r.n_rot / 2;
  for (Idx idx = blockIdx.x * Idx(blockDim.x) + threadIdx.x; idx < total; idx += Idx(gridDim.x) * blockDim.x) {
    const uint32_t d = uint32_t(idx % D);
    const Idx rest = idx / D;
    const uint32_t row = uint32_t(rest % n);
    const uint32_t h = uint32_t(rest / n);
    const float* src = x + size_t(row) * p + size_t(h) * D;
    const float* m = mu ? mu + size_t(h) * D : nullptr;
    float v;
    if (c && d < r.n_rot)
      v = rotate(d, r.layout, half, src, m, nullptr, c + size_t(row) * half, s + size_t(row) * half);
    else
      v = m ? __fadd_rn(src[d], m[d]) : src[d];
    cache[(size_t(h) * n_tokens + uint32_t(row_tok[row])) * D + d] = f32_to_f16(v);
  }
}

}  // namespace

void launch_rope_table(const int32_t* pos, uint32_t n, const RopeDev& r, bool inverse, double* c, double* s, cudaStream_t st) {
  if (n == 0 || r.n_rot == 0) return;
  rope_table_kernel<<<grid_blocks(n, 128), 128, 0, st>>>(pos, n, r, inverse, c, s);
  check_launch("rope_table");
}

void launch_gather(const uint16_t* cache, uint32_t lh, uint32_t n_tokens, uint32_t head_dim, uint32_t tok0, uint32_t n, const double* c,
                   const double* s, const RopeDev& r, const float* mu, void* out, ElemType out_type, cudaStream_t st) {
  const size_t total = size_t(lh) * n * head_dim;
  if (total == 0) return;
  const unsigned g = grid_blocks(total, 256, 1u << 20);
  const bool small = total + size_t(g) * 256 < (size_t(1) << 32);  // no 32-bit overflow in the grid-stride loop
#define KVTC_GATHER(T)                                                                                                        \
  if (small)                                                                                                                  \
    gather_kernel<T, uint32_t><<<g, 256, 0, st>>>(cache, lh, n_tokens, head_dim, tok0, n, c, s, r, mu, static_cast<T*>(out)); \
  else                                                                                                                        \
    gather_kernel<T, size_t><<<g, 256, 0, st>>>(cache, lh, n_tokens, head_dim, tok0, n, c, s, r, mu, static_cast<T*>(out));
  switch (out_type) {
    case ElemType::kF32: KVTC_GATHER(float) break;
    case ElemType::kBf16: KVTC_GATHER(__nv_bfloat16) break;
    case ElemType::kF16: KVTC_GATHER(__half) break;
  }
#undef KVTC_GATHER
  check_launch("gather");
}

void launch_scatter(const float* x, const float* mu, uint32_t n, const int32_t* row_tok, const double* c, const double* s, const RopeDev& r,
                    uint16_t* cache, uint32_t lh, uint32_t n_tokens, uint32_t head_dim, cudaStream_t st) {
  const size_t total = size_t(lh) * n * head_dim;
  if (total == 0) return;
  const unsigned g = grid_blocks(total, 256, 1u << 20);
  if (total + size_t(g) * 256 < (size_t(1) << 32))
    scatter_kernel<uint32_t><<<g, 256, 0, st>>>(x, mu, n, row_tok, c, s, r, cache, lh, n_tokens, head_dim);
  else
    scatter_kernel<size_t><<<g, 256, 0, st>>>(x, mu, n, row_tok, c, s, r, cache, lh, n_tokens, head_dim);
  check_launch("scatter");
}

}  // namespace kvtc::cuda
