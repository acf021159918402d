#include "center.cuh"

namespace kvtc::cuda {

namespace {

template <int kOp>  // 0 fill, 1 sub, 2 add
__global__ void center_kernel(float* __restrict__ x, const float* __restrict__ mu, uint32_t n, uint32_t p) {
  const size_t total = size_t(n) * p;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const float m = mu[i % p];
    if (kOp == 0)
      x[i] = m;
    else if (kOp == 1)
      x[i] = __fsub_rn(x[i], m);
    else
      x[i] = __fadd_rn(x[i], m);
  }
}

template <int kOp>
void launch(float* x, const float* mu, uint32_t n, uint32_t p, cudaStream_t st, const char* what) {
  const size_t total = size_t(n) * p;
  if (total == 0) return;
  center_kernel<kOp><<<grid_blocks(total, 256, 1u << 20), 256, 0, st>>>(x, mu, n, p);
  check_launch(what);
}

}  // namespace

void launch_center_fill(float* x, const float* mu, uint32_t n, uint32_t p, cudaStream_t st) {
  launch<0>(x, mu, n, p, st, "center_fill");
}
void launch_center_sub(float* x, const float* mu, uint32_t n, uint32_t p, cudaStream_t st) {
  launch<1>(x, mu, n, p, st, "center_sub");
}
void launch_center_add(float* x, const float* mu, uint32_t n, uint32_t p, cudaStream_t st) {
  launch<2>(x, mu, n, p, st, "center_add");
}

}  // namespace kvtc::cuda
