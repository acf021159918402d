// kvtc: whole-file I/O as the library does it — outputs are written to a
// temporary file and renamed, so a failure never leaves a partial file or
// touches an existing one — and the model fingerprint.
// Thread safety: reentrant; distinct paths from several threads are safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvtc {

// Reads a whole file; Error names the path and the system's reason.
std::vector<uint8_t> read_file(const std::string& path);
// Writes to a temporary file in the same directory, fsyncs it, renames it
// over `path` and fsyncs the directory (so that the new name survives a
// crash too). On a failure before the rename the temporary is removed,
// `path` is left as it was, and Error names the path; when only the
// directory's sync fails, the new file is in place but Error says it may
// not survive a crash.
void write_file_atomic(const std::string& path, std::span<const uint8_t> data);
// Lower-case hex SHA-256 of a file's contents, streamed in 1 MiB reads
// (the model fingerprint of CacheGeometry::model_sha256).
std::string sha256_file(const std::string& path);

}  // namespace kvtc
