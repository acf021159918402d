# The libraries' sources, listed once for the top-level project and for the
# reduced project the GPU machine builds (bench/gpu/CMakeLists.txt), as
# absolute paths. Each list builds one library (see their targets there).
get_filename_component(_kvtc_src_root "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
# kvtc_core: formats and utilities, no llama.cpp
set(KVTC_CORE_SOURCES src/core/util.cpp src/core/safetensors.cpp src/core/state_blob.cpp src/core/kv_capture.cpp)
# kvtc_codec: the decoder side; needs neither the encoder nor calibration
set(KVTC_CODEC_SOURCES
  src/codec/rope.cpp
  src/codec/quant.cpp
  src/codec/features.cpp
  src/codec/calibration.cpp
  src/codec/container.cpp
  src/codec/plan.cpp
  src/codec/parallel.cpp
  src/codec/project.cpp
  src/codec/decode.cpp)
# kvtc_encoder
set(KVTC_ENCODER_SOURCES src/codec/encode.cpp)
foreach(_l KVTC_CORE_SOURCES KVTC_CODEC_SOURCES KVTC_ENCODER_SOURCES)
  list(TRANSFORM ${_l} PREPEND "${_kvtc_src_root}/")
endforeach()
