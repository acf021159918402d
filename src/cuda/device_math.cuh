// Internal (GPU path): bit-exact device copies of the CPU's scalar
// conversions (src/core/util.cpp f16, src/codec/quant.cpp E4M3), so that
// parameters and codes match the CPU byte for byte. Only for .cu files.
#pragma once

#include <cstdint>

namespace kvtc::cuda {

__host__ __device__ inline float bits_f32(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float f;
  __builtin_memcpy(&f, &b, 4);
  return f;
#endif
}
__host__ __device__ inline uint32_t f32_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t b;
  __builtin_memcpy(&b, &f, 4);
  return b;
#endif
}

// kvtc::f16_to_f32 (exact for every half).
__host__ __device__ inline float h2f(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400));
      bits = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 112) << 23 | man << 13;
  }
  return bits_f32(bits);
}

// kvtc::f32_to_f16: round to nearest even, overflow to inf.
__host__ __device__ inline uint16_t f2h(float f) {
  uint32_t x = f32_bits(f);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t ax = x & 0x7fffffff;
  if (ax >= 0x7f800000) return uint16_t(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 | ((ax >> 13) & 0x3ff) : 0));
  if (ax >= 0x477ff000) return uint16_t(sign | 0x7c00);
  if (ax < 0x38800000) {
    if (ax < 0x33000000) return uint16_t(sign);
    uint32_t e = ax >> 23;
    uint32_t m = (ax & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - e;
    uint32_t half = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t h = ((ax >> 13) - (112u << 10));
  uint32_t rem = ax & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;
  return uint16_t(sign | h);
}

#ifdef __CUDACC__
// kvtc::f32_to_e4m3: round to nearest even, saturating at 448 (0x7e);
// same operations as the CPU (frexp, nearbyint in round-to-nearest-even).
__device__ inline uint8_t f2e4m3(float x) {
  const uint8_t sign = signbit(x) ? 0x80 : 0;
  const float a = fabsf(x);
  if (!(a == a)) return 0;
  if (a >= 464.0f) return sign | 0x7e;
  if (a < 0.015625f) {                            // 2^-6
    const float m = rintf(__fmul_rn(a, 512.0f));  // exact product, ties to even
    return sign | uint8_t(m);
  }
  int e;
  const float f = frexpf(a, &e);
  float m = rintf(__fmul_rn(__fsub_rn(__fmul_rn(f, 2.0f), 1.0f), 8.0f));
  int ef = e - 1 + 7;
  if (m == 8.0f) {
    m = 0;
    ++ef;
  }
  if (ef > 15 || (ef == 15 && m == 7.0f)) return sign | 0x7e;
  return sign | uint8_t(ef << 3) | uint8_t(m);
}
#endif

}  // namespace kvtc::cuda
