// Internal (GPU path), kernel family (b): centring of feature rows
// [n][p] (f32) on the mean mu [p]. The encoder fuses the subtraction into
// the gather (launch_gather's mu); these are the standalone forms: the
// decoder fills rows with mu and lets the GEMM add D B on top (beta = 1, as
// the CPU decoder does), and the tests check both against the CPU.
// f32 add/sub are correctly rounded on both sides: results are identical.
#pragma once

#include "common.cuh"

namespace kvtc::cuda {

void launch_center_fill(float* x, const float* mu, uint32_t n, uint32_t p, cudaStream_t st);  // x[t][f] = mu[f]
void launch_center_sub(float* x, const float* mu, uint32_t n, uint32_t p, cudaStream_t st);   // x[t][f] -= mu[f]
void launch_center_add(float* x, const float* mu, uint32_t n, uint32_t p, cudaStream_t st);   // x[t][f] += mu[f]

}  // namespace kvtc::cuda
