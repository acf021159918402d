#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/scalar.h"
#include "elem.cuh"
#include "quant.cuh"

namespace kvtc::cuda {

namespace {

__device__ __forceinline__ uint16_t plane16(const uint8_t* planes, uint32_t n, uint32_t k, uint32_t t) {
  return uint16_t(planes[size_t(2 * k) * n + t] | uint16_t(planes[size_t(2 * k + 1) * n + t]) << 8);
}

__global__ void quant_params_kernel(const float* __restrict__ dt, size_t ld, const QSeg* __restrict__ segs, uint8_t* __restrict__ base) {
  const QSeg sg = segs[blockIdx.x];
  if (sg.rule == QRule::kZero) return;
  uint8_t* out = base + sg.off;
  const uint32_t n = sg.n;
  for (uint32_t t = threadIdx.x; t < n; t += blockDim.x) {
    const float* col = dt + size_t(sg.comp0) * ld + sg.row0 + t;
    if (sg.rule == QRule::kE4M3) {
      float amax = 0;
      for (uint32_t i = 0; i < sg.size; ++i) {
        const float a = fabsf(col[size_t(i) * ld]);
        amax = amax < a ? a : amax;  // std::max(amax, a)
      }
      const uint16_t s16 = fp8_block_scale(amax);
      out[t] = uint8_t(s16);
      out[size_t(n) + t] = uint8_t(s16 >> 8);
    } else {  // kAffine
      const int levels = int((1u << sg.code_bits) - 1);
      float lo = col[0], hi = col[0];
      for (uint32_t i = 1; i < sg.size; ++i) {
        const float x = col[size_t(i) * ld];
        lo = x < lo ? x : lo;  // std::min(lo, x)
        hi = hi < x ? x : hi;  // std::max(hi, x)
      }
      uint16_t lo16, st16;
      int_block_params(lo, hi, levels, &lo16, &st16);
      out[t] = uint8_t(lo16);
      out[size_t(n) + t] = uint8_t(lo16 >> 8);
      out[2 * size_t(n) + t] = uint8_t(st16);
      out[3 * size_t(n) + t] = uint8_t(st16 >> 8);
    }
  }
}

__global__ void quant_codes_kernel(const float* __restrict__ dt, size_t ld, const QSeg* __restrict__ segs, const QTile* __restrict__ tiles,
                                   uint8_t* __restrict__ base) {
  const QTile tile = tiles[blockIdx.x];
  const QSeg sg = segs[tile.seg];
  const uint32_t n = sg.n, cb = sg.code_bits, per = 8 / cb;
  const uint8_t* planes = base + sg.off;
  uint8_t* codes = base + sg.off + size_t(2) * sg.n_params * n;
  const size_t n_codes = size_t(n) * sg.size;
  const size_t bytes = (n_codes * cb + 7) / 8;
  const size_t end = min(bytes, size_t(tile.begin) + kEncTileBytes);
  const int levels = (1 << cb) - 1;
  for (size_t q = tile.begin + threadIdx.x; q < end; q += blockDim.x) {
    uint32_t byte = 0;
    for (uint32_t k = 0; k < per; ++k) {
      const size_t j = q * per + k;
      if (j >= n_codes) break;
      const uint32_t i = uint32_t(j / n), t = uint32_t(j % n);
      const float x = dt[size_t(sg.comp0 + i) * ld + sg.row0 + t];
      uint32_t code;
      if (sg.rule == QRule::kE4M3)
        code = fp8_code(x, f16_to_f32(plane16(planes, n, 0, t)));
      else  // kAffine
        code = int_code(x, f16_to_f32(plane16(planes, n, 0, t)), f16_to_f32(plane16(planes, n, 1, t)), levels);
      byte |= code << (k * cb);
    }
    codes[q] = uint8_t(byte);
  }
}

template <typename T>
__global__ void unpack_kernel(const uint8_t* __restrict__ base, const QSeg* __restrict__ segs, const QTile* __restrict__ tiles, T* __restrict__ dt,
                              size_t ld) {
  const QTile tile = tiles[blockIdx.x];
  const QSeg sg = segs[tile.seg];
  const uint32_t n = sg.n, cb = sg.code_bits;
  const size_t n_codes = size_t(n) * sg.size;
  const size_t end = min(n_codes, size_t(tile.begin) + kDecTileCodes);
  const uint8_t* planes = base + sg.off;
  const uint8_t* codes = base + sg.off + size_t(2) * sg.n_params * n;
  const uint32_t mask = (1u << cb) - 1;
  for (size_t j = tile.begin + threadIdx.x; j < end; j += blockDim.x) {
    const uint32_t i = uint32_t(j / n), t = uint32_t(j % n);
    float v = 0.0f;
    if (sg.rule != QRule::kZero) {
      const size_t bit = j * cb;
      const uint32_t code = (codes[bit >> 3] >> (bit & 7)) & mask;
      if (sg.rule == QRule::kE4M3)
        v = __fmul_rn(e4m3_to_f32(uint8_t(code)), f16_to_f32(plane16(planes, n, 0, t)));
      else  // kAffine
        v = __fadd_rn(f16_to_f32(plane16(planes, n, 0, t)), __fmul_rn(float(code), f16_to_f32(plane16(planes, n, 1, t))));
    }
    store_elem<T>(dt + size_t(sg.comp0 + i) * ld + sg.row0 + t, v);
  }
}

}  // namespace

void launch_quant_params(const float* dt, size_t ld, const QSeg* segs, uint32_t n_segs, uint8_t* base, cudaStream_t st) {
  if (n_segs == 0) return;
  quant_params_kernel<<<n_segs, 128, 0, st>>>(dt, ld, segs, base);
  check_launch("quant_params");
}

void launch_quant_codes(const float* dt, size_t ld, const QSeg* segs, const QTile* tiles, uint32_t n_tiles, uint8_t* base, cudaStream_t st) {
  if (n_tiles == 0) return;
  quant_codes_kernel<<<n_tiles, 256, 0, st>>>(dt, ld, segs, tiles, base);
  check_launch("quant_codes");
}

void launch_unpack(const uint8_t* base, const QSeg* segs, const QTile* tiles, uint32_t n_tiles, void* dt, size_t ld, ElemType dt_type,
                   cudaStream_t st) {
  if (n_tiles == 0) return;
  switch (dt_type) {
    case ElemType::kF32: unpack_kernel<float><<<n_tiles, 256, 0, st>>>(base, segs, tiles, static_cast<float*>(dt), ld); break;
    case ElemType::kBf16: unpack_kernel<__nv_bfloat16><<<n_tiles, 256, 0, st>>>(base, segs, tiles, static_cast<__nv_bfloat16*>(dt), ld); break;
    case ElemType::kF16: unpack_kernel<__half><<<n_tiles, 256, 0, st>>>(base, segs, tiles, static_cast<__half*>(dt), ld); break;
  }
  check_launch("unpack");
}

}  // namespace kvtc::cuda
