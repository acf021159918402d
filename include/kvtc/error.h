// kvtc: error type shared by every module.
//
// Internals throw kvtc::Error with a message that names the file, the field
// and what was expected; the CLI prints it and exits non-zero. Nothing in
// kvtc aborts on bad input.
#pragma once

#include <stdexcept>
#include <string>

namespace kvtc {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Throws Error(msg) when cond is false. For input validation, not for
// programming errors.
inline void require(bool cond, const std::string& msg) {
  if (!cond) throw Error(msg);
}

}  // namespace kvtc
