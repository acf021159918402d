// kvtc-lab bench --device cuda: one benchmark row measured on the GPU codec
// (kvtc/cuda.h), with the keys of the CPU rows (lab/bench.cpp). Built only
// with the GPU path (KVTC_WITH_CUDA); elsewhere bench refuses --device cuda
// with the reason.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvtc/kvtc.h"

namespace kvtc::lab {

// The device in one line; throws Error with the reason when none is
// usable or a precision (auto, f32, tf32, bf16, f16) is unknown.
std::string cuda_bench_device(const std::vector<std::string>& precisions);

// Compresses `batch` copies of `cap`, already in GPU memory (the upload is
// not timed: a serving engine's cache lives there), into host containers,
// and decodes them back into GPU memory, `repeat` times after one warm-up;
// the fastest of each is reported. `precision` picks the cuBLAS mode
// (auto = f32). Fills the row's keys: precision, compressed_mb, ratio,
// compress_ms, decompress_ms, encode_gbs, decode_gbs (raw f16 bytes of the
// batch per second), encode_stages / decode_stages (ms of GPU time per
// stage plus transfer and host), rel_error_k / rel_error_v, batch,
// entropy_backend. *decoded receives sequence 0 decoded (for the restore).
nlohmann::ordered_json cuda_bench_row(const KvCapture& cap, const Calibration& cal, const AllocationSet& alloc, const CompressOptions& opt,
                                      const std::string& precision, int batch, int repeat, KvCapture* decoded, std::vector<uint8_t>* container);

}  // namespace kvtc::lab
