// kvtc — KV Cache Transform Coding: the library's one public header.
//
//   #include <kvtc/kvtc.h>      // find_package(kvtc), target kvtc::kvtc
//
// What it declares (each header's comments give shapes, units, ownership
// and thread safety):
//   kvtc/error.h        kvtc::Error, the one exception every function throws
//   kvtc/cache.h        KvCapture: a KV cache in memory with its typed
//                       geometry; capture files; llama.cpp state blobs
//   kvtc/calibration.h  Calibration: load, save, allocations per ratio,
//                       fitting from caller-supplied caches
//   kvtc/codec.h        compress, decompress, append, inspect (CPU), on
//                       captures and on state blobs; statistics
//   kvtc/files.h        atomic file writes, the model fingerprint
//   kvtc/store.h        PromptStore: compressed prompt caches in RAM and
//                       on disk, shared prefix chunks, llama-server's rules
//
// Beside it, two optional libraries with their own headers (not included
// here, as they pull in more than the codec needs):
//   kvtc/llama.h, kvtc/corpus.h  the llama.cpp integration (model, session,
//                       calibration from a text corpus); links llama.cpp
//   kvtc/cuda.h         the GPU backend (CUDA, cuBLAS, nvCOMP)
#pragma once

#include "kvtc/cache.h"
#include "kvtc/calibration.h"
#include "kvtc/codec.h"
#include "kvtc/error.h"
#include "kvtc/files.h"
#include "kvtc/store.h"
