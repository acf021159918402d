# The library's sources, listed once for the top-level project and for the
# reduced project the GPU machine builds (bench/gpu/CMakeLists.txt), as
# absolute paths. Each list is one layer; the decoder layers (core, format,
# decoder) build and link without the encoder or the calibration code.
get_filename_component(_kvtc_src_root "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
# core: in-memory caches and their files, state blobs, checksums, threads
set(KVTC_CORE_SOURCES src/core/util.cpp src/core/safetensors.cpp src/core/state_blob.cpp src/core/capture.cpp src/core/parallel.cpp)
# format + the CPU decoder: the container rules and its quantizers, the
# calibration file, RoPE, features, the projection, decompress and inspect
set(KVTC_DECODER_SOURCES
  src/format/container.cpp
  src/format/chunk.cpp
  src/format/ecsq.cpp
  src/format/plan.cpp
  src/format/quantizers.cpp
  src/format/raw8.cpp
  src/codec/rope.cpp
  src/codec/features.cpp
  src/codec/calibration.cpp
  src/codec/project.cpp
  src/codec/decode.cpp
  src/codec/info.cpp)
# the CPU encoder: compress, append
set(KVTC_ENCODER_SOURCES src/codec/encode.cpp)
# calibration: the DP bit allocation (allocations for any ratio), and the
# fitter with its PCA (LAPACK; no llama.cpp)
set(KVTC_ALLOC_SOURCES src/calib/dp.cpp src/calib/alloc.cpp)
set(KVTC_FIT_SOURCES src/calib/pca.cpp src/calib/fit.cpp src/calib/online.cpp)
set(KVTC_CALIB_SOURCES ${KVTC_ALLOC_SOURCES} ${KVTC_FIT_SOURCES})
# the prompt store: tiers of compressed prompt caches (encoder + decoder)
set(KVTC_STORE_SOURCES src/store/store.cpp src/store/keys.cpp src/store/pieces.cpp src/store/queue.cpp src/store/ram_tier.cpp src/store/disk_tier.cpp
                        src/store/redis_tier.cpp src/store/redis.cpp src/store/seal.cpp src/store/shared_calib.cpp
                        src/store/learner.cpp)
foreach(_l KVTC_CORE_SOURCES KVTC_DECODER_SOURCES KVTC_ENCODER_SOURCES KVTC_ALLOC_SOURCES KVTC_FIT_SOURCES KVTC_CALIB_SOURCES KVTC_STORE_SOURCES)
  list(TRANSFORM ${_l} PREPEND "${_kvtc_src_root}/")
endforeach()
# The headers `cmake --install` ships: the codec library's public API.
set(KVTC_PUBLIC_HEADERS kvtc.h error.h files.h cache.h calibration.h codec.h store.h)
