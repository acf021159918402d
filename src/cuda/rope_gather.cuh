// Internal (GPU path), kernel family (a): cache layout <-> feature rows
// with RoPE, the device twin of src/codec/features.cpp + rope.cpp.
//
// Cache: f16 [n_layer * n_head_kv][n_tokens][head_dim] (KvBlock's layout).
// Feature rows: [row][p], p = n_layer * n_head_kv * head_dim, feature
// f = (layer * n_head_kv + head) * head_dim + dim.
//
// RoPE exactly as the CPU: theta_i = pos * theta_scale^i by repeated f32
// multiplication (theta_scale = powf(base, -2/n_rot) computed on the host,
// the CPU's expression), th = freq_scale * (theta / factor) in f32, then
// cos/sin in double (CUDA's double sincos, <= 2 double ulps from glibc's)
// and the rotation in double without FMA contraction, rounded to f32. A
// rotated value is therefore within 1 f32 ulp of the CPU's and almost
// always identical.
#pragma once

#include "common.cuh"

namespace kvtc::cuda {

struct RopeDev {
  int layout = 0;  // 0 none, 1 norm (pairs 2i, 2i+1), 2 neox (pairs i, i + n_rot/2)
  uint32_t n_rot = 0, head_dim = 0;
  float theta_scale = 1, freq_scale = 1;
  const float* freq_factors = nullptr;  // device [n_rot / 2] or nullptr
};

// c, s: [n][n_rot / 2] doubles for positions pos[0..n) (device); s is
// negated when inverse (un-rotating), as rope_table does.
void launch_rope_table(const int32_t* pos, uint32_t n, const RopeDev& r, bool inverse, double* c, double* s, cudaStream_t st);

// Rows [0, n) from cache tokens tok0 .. tok0 + n - 1; de-RoPE with the
// table (c == nullptr: none), then subtract mu (nullptr: none) in f32,
// stored as `out_type` (f32; bf16 / f16 rounded to nearest even).
void launch_gather(const uint16_t* cache, uint32_t lh, uint32_t n_tokens, uint32_t head_dim, uint32_t tok0, uint32_t n, const double* c,
                   const double* s, const RopeDev& r, const float* mu, void* out, ElemType out_type, cudaStream_t st);

// Inverse: rows [0, n) of x (f32 [n][p]) plus mu (nullptr: none; one f32
// add, as the CPU decoder's GEMM with beta = 1 onto mu) to cache tokens
// row_tok[row] (device), re-RoPE with the table (c == nullptr: none),
// f32 -> f16 round to nearest even.
void launch_scatter(const float* x, const float* mu, uint32_t n, const int32_t* row_tok, const double* c, const double* s, const RopeDev& r,
                    uint16_t* cache, uint32_t lh, uint32_t n_tokens, uint32_t head_dim, cudaStream_t st);

}  // namespace kvtc::cuda
