// Internal: the codec's scalar conversions and quantizer arithmetic, written
// once for the CPU and the GPU (__host__ __device__ under nvcc). The CPU
// quantizers (src/format/quantizers.cpp) and the CUDA kernels (src/cuda/quant.cu,
// rope_gather.cu) call these very functions, which is what makes their f16
// parameters and codes byte-identical (docs/gpu.md).
//
// Every operation is a single IEEE-rounded step: on the device through the
// explicitly rounded intrinsics (__fmul_rn, ...), which nvcc never fuses
// into FMAs; on the host as plain operators in a library built with
// -ffp-contract=off. Rounding to integers is round-half-even (rintf; the
// host's default rounding mode).
#pragma once

#include <math.h>

#include <cstdint>

#if defined(__CUDACC__)
#define KVTC_HD __host__ __device__
#else
#define KVTC_HD
#endif

namespace kvtc {

namespace scalar {

KVTC_HD inline float bits_f32(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float f;
  __builtin_memcpy(&f, &b, 4);
  return f;
#endif
}
KVTC_HD inline uint32_t f32_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t b;
  __builtin_memcpy(&b, &f, 4);
  return b;
#endif
}
KVTC_HD inline float mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVTC_HD inline float sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
KVTC_HD inline float div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

}  // namespace scalar

// IEEE binary16 -> binary32, exact for every finite half and for inf/NaN.
KVTC_HD inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
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
  return scalar::bits_f32(bits);
}

// binary32 -> binary16, round to nearest even; overflow to inf, NaN kept quiet.
KVTC_HD inline uint16_t f32_to_f16(float f) {
  const uint32_t x = scalar::f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t ax = x & 0x7fffffff;
  if (ax >= 0x7f800000) return uint16_t(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 | ((ax >> 13) & 0x3ff) : 0));
  if (ax >= 0x477ff000) return uint16_t(sign | 0x7c00);  // rounds to >= 65520: overflow to inf
  if (ax < 0x38800000) {                                 // below the smallest normal half: subnormal or zero
    if (ax < 0x33000000) return uint16_t(sign);          // < 2^-25 rounds to zero
    const uint32_t e = ax >> 23;
    const uint32_t m = (ax & 0x7fffff) | 0x800000;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t half = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t h = ((ax >> 13) - (112u << 10));
  const uint32_t rem = ax & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;
  return uint16_t(sign | h);
}

// FP8 E4M3 (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; max 448;
// 0x7f/0xff are NaN and never produced).
KVTC_HD inline float e4m3_to_f32(uint8_t v) {
  const int s = v >> 7, e = (v >> 3) & 15, m = v & 7;
  float x;
  if (e == 0)
    x = ldexpf(float(m), -9);  // subnormal: m/8 * 2^-6
  else if (e == 15 && m == 7)
    x = scalar::bits_f32(0x7fc00000u);
  else
    x = ldexpf(1.0f + float(m) / 8.0f, e - 7);  // exact: m/8 and powers of two
  return s ? -x : x;
}

// Round to nearest even, saturating at 448 (0x7e).
KVTC_HD inline uint8_t f32_to_e4m3(float x) {
  const uint8_t sign = (scalar::f32_bits(x) >> 31) ? 0x80 : 0;
  const float a = fabsf(x);
  if (!(a == a)) return 0;                          // NaN input: code 0 (inputs are finite in practice)
  if (a >= 464.0f) return sign | 0x7e;              // 464 is halfway between 448 and the (absent) 480: saturate
  if (a < 0.015625f) {                              // below 2^-6, the subnormal range: steps of 2^-9
    const float m = rintf(scalar::mul(a, 512.0f));  // exact product, ties to even
    return sign | uint8_t(m);                       // m == 8 is exactly the smallest normal's code (0x08)
  }
  int e;
  const float f = frexpf(a, &e);  // a = f * 2^e, f in [0.5, 1)
  float m = rintf(scalar::mul(scalar::sub(scalar::mul(f, 2.0f), 1.0f), 8.0f));
  int ef = e - 1 + 7;
  if (m == 8.0f) {
    m = 0;
    ++ef;
  }
  if (ef > 15 || (ef == 15 && m == 7.0f)) return sign | 0x7e;
  return sign | uint8_t(ef << 3) | uint8_t(m);
}

// ---- the quantizers (docs/format.md "Dequantization") ----------------------
// Parameters are rounded to f16 before the codes are chosen, so the decoder,
// which sees only the f16 values, reconstructs what the encoder measured.

// The arithmetic families of the fixed-rate quantizers. Which quantizer
// uses which, with its code and parameter widths, is the format's
// descriptor table (src/format/quantizers.h); the CPU block quantizer
// (src/format/quantizers.cpp, chunk.cpp) and the GPU kernels
// (src/cuda/quant.cu, which get the rule per segment) switch on it.
enum class QRule : uint8_t {
  kZero,    // no codes, no parameters: every component decodes as 0
  kAffine,  // f16 minimum and step, codes 0..2^bits-1: lo + code * step (int_block_params, int_code)
  kE4M3,    // one f16 scale absmax / 448, E4M3 codes: e4m3(code) * scale (fp8_block_scale, fp8_code)
};

// int2/int4 block with minimum lo and maximum hi: the f16 minimum, and the
// step (hi - lo') / levels rounded *up* to f16 so that hi stays reachable
// after lo was rounded.
KVTC_HD inline void int_block_params(float lo, float hi, int levels, uint16_t* lo16, uint16_t* st16) {
  *lo16 = f32_to_f16(lo);
  const float lo_r = f16_to_f32(*lo16);
  const float step = scalar::div(scalar::sub(hi, lo_r), float(levels));
  uint16_t s = f32_to_f16(step);
  if (f16_to_f32(s) < step) s = uint16_t(s + 1);
  *st16 = s;
}
// The code of x in an int block of minimum lo_r and step st (f16 values).
KVTC_HD inline uint8_t int_code(float x, float lo_r, float st, int levels) {
  const float q = st > 0 ? rintf(scalar::div(scalar::sub(x, lo_r), st)) : 0.0f;
  return uint8_t(q < 0.0f ? 0.0f : (float(levels) < q ? float(levels) : q));
}
// fp8 block with absolute maximum amax: its f16 scale amax / 448.
KVTC_HD inline uint16_t fp8_block_scale(float amax) {
  return f32_to_f16(scalar::div(amax, 448.0f));
}
// The code of x in an fp8 block of scale s (an f16 value).
KVTC_HD inline uint8_t fp8_code(float x, float s) {
  return s > 0 ? f32_to_e4m3(scalar::div(x, s)) : 0;
}

}  // namespace kvtc
