// kvtc internal: helpers for kvtc-lab (lab/) and the tests, outside the
// public API. Not installed (cmake --install ships KVTC_PUBLIC_HEADERS of
// cmake/sources.cmake only, and tests/test_package.py checks that), not
// stable: names and signatures change with the lab's needs. The product
// (tools/), the example (examples/), the Python binding and the servers
// include <kvtc/kvtc.h> only. Implemented in the library (kvtc_lib), so
// what the lab measures is the codec's own code.
// Thread safety: reentrant functions over caller-owned data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvtc/cache.h"
#include "kvtc/calibration.h"
#include "kvtc/codec.h"

namespace kvtc {

// What the codec stores for x[0..n) coded as one allocation block of
// fixed-rate type t (docs/format.md "Dequantization"): out[i] is x[i]'s
// reconstruction (out may alias x). For the lab's FP8 and KIVI baselines,
// which quantize with the codec's own quantizers (src/format/quantizers.h).
void quantize_roundtrip(QType t, const float* x, size_t n, float* out);
// Bits per component of t's codes (0, 2, 4, 8; parameters aside), from its
// descriptor (src/format/quantizers.h), for kvtc-lab analyze's runs.
uint32_t qtype_code_bits(QType t);

// The feature vectors of docs/method.md §1 that the PCA sees: tokens [t0, t1)
// of block b, all layers and heads concatenated (feature
// (layer * n_head_kv + head) * head_dim + dim), keys with RoPE removed when
// derope. Returns [t1 - t0][b.features()] f32. Error when the range or the
// K/V sizes are wrong, or the RoPE cannot be undone.
std::vector<float> feature_rows(const KvBlock& b, bool keys, bool derope, uint32_t t0, uint32_t t1);
// The inverse: writes rows [t1 - t0][b.features()] back into tokens
// [t0, t1) of b, re-applying RoPE to keys when rerope, rounded to f16
// (nearest even). For the lab's per-prompt SVD baseline and the tests'
// synthetic caches.
void set_feature_rows(KvBlock& b, bool keys, bool rerope, uint32_t t0, uint32_t t1, std::vector<float> rows);

// The projection's GEMM alone, for kvtc-lab bench: C[m][n] = A[m][k] B' in
// `p` (resolved as the codec would), on all threads, best of `repeat`;
// returns GFLOP/s (2 m n k flops).
double projection_gemm_gflops(Precision p, uint32_t m, uint32_t n, uint32_t k, int repeat);

// Whether codec calls from now on multiply a layer-grouped basis
// (FitOptions::layer_groups) run by run (the default) or as one dense GEMM
// over its zeros: the control for kvtc-lab bench and the tests.
// Process-wide; set it between codec calls, not during one.
void set_grouped_projection(bool on);
// Whether the decoder's vector kernels (int8 codes, re-RoPE and f16
// rounding, the 32-lane rANS) run where the CPU has them (default) or their
// scalar forms: the same bits, the control for kvtc-lab bench
// --scalar-kernels. Process-wide; set it between codec calls.
void set_vector_kernels(bool on);
// The layout new entropy-coded containers are written in: 32 lanes
// (version 4, the default) or 4 (versions 2 and 3, as writers before
// version 4): the control for kvtc-lab bench --ecsq-lanes 4. Process-wide;
// set it between codec calls.
void set_ecsq_writer_lanes(uint32_t lanes);
// Multiply-adds per token of the projection over t's first ru components
// as the codec runs it now: ru x p for a dense basis (or with grouped
// projection off), sum over runs of (its components among the first ru) x
// (its features) for a layer-grouped one. For kvtc-lab bench's GFLOP/s.
uint64_t projection_macs_per_token(const Transform& t, uint32_t ru);

}  // namespace kvtc
