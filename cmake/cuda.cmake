# GPU path (issue 6): CUDA kernels, cuBLAS projection, nvCOMP DEFLATE.
#
# Included from the top-level CMakeLists.txt (and from bench/gpu/CMakeLists.txt,
# the reduced project the GPU machine builds); expects the target kvtc_lib
# (the codec library) to exist.
#
#   KVTC_CUDA    on when nvcc is found (check_language(CUDA)); builds kvtc_cuda,
#                bench/gpu/kvtc_gpu_bench and, with KVTC_BUILD_TESTS, the test `cuda`
#   KVTC_NVCOMP  on when nvCOMP's C library and headers are found (by default in
#                .deps/nvcomp, where scripts/bootstrap.sh extracts the pinned
#                nvidia-libnvcomp-cu13 wheel); off: DEFLATE stays on the host (libdeflate)
#   CMAKE_CUDA_ARCHITECTURES  default "90" = sm_90 machine code + compute_90 PTX
#                (Hopper: H100/H200; the PTX JIT-compiles on newer GPUs)
#
# Nothing here needs a GPU: the library and tests compile and link on any
# machine with the CUDA toolkit; the GPU tests skip when no device exists.

get_filename_component(_kvtc_root "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)

include(CheckLanguage)
check_language(CUDA)
set(_kvtc_cuda_default OFF)
if(CMAKE_CUDA_COMPILER AND NOT KVTC_FUZZ)
  set(_kvtc_cuda_default ON)
endif()
option(KVTC_CUDA "Build the GPU path (CUDA kernels, cuBLAS, nvCOMP)" ${_kvtc_cuda_default})
if(NOT KVTC_CUDA)
  message(STATUS "kvtc: GPU path off (KVTC_CUDA=OFF; nvcc found: ${CMAKE_CUDA_COMPILER})")
  return()
endif()
if(NOT CMAKE_CUDA_COMPILER)
  message(FATAL_ERROR "KVTC_CUDA is ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER or put nvcc on PATH)")
endif()

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
  set(CMAKE_CUDA_ARCHITECTURES 90 CACHE STRING "CUDA architectures (90 = sm_90 SASS + compute_90 PTX)" FORCE)
endif()
enable_language(CUDA)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)
if(NOT TARGET CUDA::cublas)
  message(FATAL_ERROR "kvtc: the CUDA toolkit at ${CUDAToolkit_LIBRARY_DIR} has no cuBLAS")
endif()

# ---- nvCOMP (optional) -------------------------------------------------
if(DEFINED KVTC_DEPS_DIR)
  set(_kvtc_deps "${KVTC_DEPS_DIR}")
else()
  set(_kvtc_deps "${_kvtc_root}/.deps")
endif()
set(KVTC_NVCOMP_DIR "${_kvtc_deps}/nvcomp" CACHE PATH "nvCOMP root (include/, lib64/) from scripts/bootstrap.sh")
find_path(KVTC_NVCOMP_INCLUDE_DIR nvcomp/deflate.h HINTS "${KVTC_NVCOMP_DIR}/include")
find_library(KVTC_NVCOMP_LIBRARY NAMES nvcomp libnvcomp.so.6 HINTS "${KVTC_NVCOMP_DIR}/lib64" "${KVTC_NVCOMP_DIR}/lib")
# AUTO (the default) follows what is found at each configure, so running the
# bootstrap after a first configure turns nvCOMP on by itself.
set(KVTC_NVCOMP AUTO CACHE STRING "DEFLATE on the GPU with nvCOMP: ON, OFF or AUTO (on when found; else libdeflate on the host)")
set_property(CACHE KVTC_NVCOMP PROPERTY STRINGS AUTO ON OFF)
set(_kvtc_nvcomp_found OFF)
if(KVTC_NVCOMP_INCLUDE_DIR AND KVTC_NVCOMP_LIBRARY)
  set(_kvtc_nvcomp_found ON)
endif()
if(KVTC_NVCOMP STREQUAL "AUTO")
  set(_kvtc_use_nvcomp ${_kvtc_nvcomp_found})
elseif(KVTC_NVCOMP)
  if(NOT _kvtc_nvcomp_found)
    message(FATAL_ERROR "KVTC_NVCOMP is ON but nvCOMP was not found under ${KVTC_NVCOMP_DIR} (run scripts/bootstrap.sh)")
  endif()
  set(_kvtc_use_nvcomp ON)
else()
  set(_kvtc_use_nvcomp OFF)
endif()

# ---- the library ---------------------------------------------------------
# One kernel family per .cu/.cuh pair: rope_gather (a), center (b), quant (c),
# project (d, cuBLAS), entropy (e, nvCOMP + batched copies); synth (test data,
# error). Host orchestration is plain C++: the codec's state (cuda_codec.cpp),
# the encoder and decoder pipelines (cuda_encode.cpp, cuda_decode.cpp) over
# the CPU's container rules (src/format), the kernels' segment tables
# (host_plan.cpp), test support (testing.cpp).
add_library(kvtc_cuda STATIC
  ${_kvtc_root}/src/cuda/common.cu
  ${_kvtc_root}/src/cuda/rope_gather.cu
  ${_kvtc_root}/src/cuda/center.cu
  ${_kvtc_root}/src/cuda/quant.cu
  ${_kvtc_root}/src/cuda/project.cu
  ${_kvtc_root}/src/cuda/entropy.cu
  ${_kvtc_root}/src/cuda/synth.cu
  ${_kvtc_root}/src/cuda/host_plan.cpp
  ${_kvtc_root}/src/cuda/cuda_codec.cpp
  ${_kvtc_root}/src/cuda/cuda_encode.cpp
  ${_kvtc_root}/src/cuda/cuda_decode.cpp
  ${_kvtc_root}/src/cuda/testing.cpp)
# The directory's -Wall/-Wextra are host-compiler flags nvcc does not take:
# give them to C++ sources, and to nvcc through -Xcompiler.
set_property(TARGET kvtc_cuda PROPERTY COMPILE_OPTIONS "")
target_compile_options(kvtc_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall -Werror=cross-execution-space-call>)
string(REPLACE ";" "," _kvtc_archs "${CMAKE_CUDA_ARCHITECTURES}")
target_compile_definitions(kvtc_cuda PRIVATE KVTC_CUDA_ARCHS="${_kvtc_archs}")
target_include_directories(kvtc_cuda PUBLIC ${_kvtc_root}/include PRIVATE ${_kvtc_root}/src)
target_link_libraries(kvtc_cuda PUBLIC kvtc_lib CUDA::cudart_static CUDA::cublas PRIVATE deflate xxhash OpenMP::OpenMP_CXX)
if(_kvtc_use_nvcomp)
  target_compile_definitions(kvtc_cuda PRIVATE KVTC_HAVE_NVCOMP=1)
  target_include_directories(kvtc_cuda SYSTEM PRIVATE ${KVTC_NVCOMP_INCLUDE_DIR})
  target_link_libraries(kvtc_cuda PUBLIC ${KVTC_NVCOMP_LIBRARY})
  message(STATUS "kvtc: GPU path on (CUDA ${CUDAToolkit_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES}), nvCOMP ${KVTC_NVCOMP_LIBRARY}")
else()
  message(STATUS "kvtc: GPU path on (CUDA ${CUDAToolkit_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES}), no nvCOMP: DEFLATE on the host")
endif()

# ---- benchmark -------------------------------------------------------------
# kvtc-lab bench --device cuda links kvtc_cuda (lab/CMakeLists.txt). The
# device check's own benchmark on synthetic caches made on the GPU:
add_executable(kvtc_gpu_bench ${_kvtc_root}/bench/gpu/kvtc_gpu_bench.cpp)
target_include_directories(kvtc_gpu_bench PRIVATE ${_kvtc_root}/src)
target_link_libraries(kvtc_gpu_bench PRIVATE kvtc_cuda)

# ---- tests (registered here, not in tests/CMakeLists.txt) -----------------
if(KVTC_BUILD_TESTS)
  find_package(GTest REQUIRED)
  enable_testing()
  add_executable(kvtc_tests_cuda ${_kvtc_root}/tests/test_cuda.cpp)
  target_include_directories(kvtc_tests_cuda PRIVATE ${_kvtc_root}/src)
  target_link_libraries(kvtc_tests_cuda PRIVATE kvtc_cuda GTest::gtest_main)
  set_target_properties(kvtc_tests_cuda PROPERTIES RUNTIME_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/tests")
  add_test(NAME cuda COMMAND kvtc_tests_cuda)
endif()
