#include <string>

#include "common.cuh"
#include "kvtc/error.h"

namespace kvtc::cuda {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("CUDA error in ") + what + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

void check_launch(const char* what) {
  check(cudaGetLastError(), what);
}

namespace {
__global__ void probe_kernel(int* out) {
  if (out) *out = 1;
}
}  // namespace

// Launches a trivial kernel: fails when this build has no code for the device.
cudaError_t probe_device() {
  probe_kernel<<<1, 1>>>(nullptr);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  return cudaDeviceSynchronize();
}

}  // namespace kvtc::cuda
