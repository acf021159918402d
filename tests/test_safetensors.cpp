// safetensors reader/writer: round trip and malformed files (synthetic
// tensors: this tests the file format code).
#include <gtest/gtest.h>

#include <cstring>

#include "core/safetensors.h"
#include "kvtc/error.h"

using namespace kvtc;

namespace {

SafeTensors sample() {
  SafeTensors st;
  st.metadata["hello"] = "world";
  Tensor a;
  a.dtype = DType::F16;
  a.shape = {2, 3};
  a.data.resize(12);
  for (size_t i = 0; i < 12; ++i) a.data[i] = uint8_t(i);
  st.add("a", a);
  Tensor b;
  b.dtype = DType::I32;
  b.shape = {1};
  b.data = {1, 0, 0, 0};
  st.add("b", b);
  return st;
}

std::vector<uint8_t> with_header(const std::string& json, size_t data_bytes) {
  std::vector<uint8_t> out(8 + json.size() + data_bytes, 0);
  uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  std::memcpy(out.data() + 8, json.data(), json.size());
  return out;
}

void expect_error(const std::vector<uint8_t>& bytes, const std::string& needle) {
  try {
    safetensors_parse(bytes, "x.safetensors");
    FAIL() << "expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("x.safetensors"), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(SafeTensors, RoundTrip) {
  SafeTensors st = sample();
  std::vector<uint8_t> bytes = safetensors_serialize(st);
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u) << "data must start 8-byte aligned";
  SafeTensors back = safetensors_parse(bytes, "mem");
  EXPECT_EQ(back.metadata, st.metadata);
  ASSERT_EQ(back.tensors.size(), 2u);
  EXPECT_EQ(back.get("a").shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(back.get("a").data, st.get("a").data);
  EXPECT_EQ(back.get("b").dtype, DType::I32);
  EXPECT_EQ(safetensors_serialize(back), bytes);
}

TEST(SafeTensors, EveryTruncationIsAnError) {
  std::vector<uint8_t> bytes = safetensors_serialize(sample());
  for (size_t n = 0; n < bytes.size(); ++n) {
    std::vector<uint8_t> t(bytes.begin(), bytes.begin() + n);
    EXPECT_THROW(safetensors_parse(t, "t"), Error) << "length " << n;
  }
}

TEST(SafeTensors, MalformedHeaders) {
  expect_error({1, 2, 3}, "8-byte");
  expect_error(with_header("{not json", 0), "not valid JSON");
  expect_error(with_header("[1,2]", 0), "not a JSON object");
  expect_error(with_header(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8), "unsupported dtype");
  expect_error(with_header(R"({"a":{"dtype":"F16","shape":[2],"data_offsets":[0,8]}})", 8), "need 4");
  expect_error(with_header(R"({"a":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}})", 4), "outside the data buffer");
  expect_error(with_header(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})", 3),
               "contiguous");
  expect_error(with_header(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 5), "trailing");
  expect_error(with_header(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,2]}})", 2), "non-negative");
  expect_error(with_header(R"({"__metadata__":{"k":1}})", 0), "must be a string");
  expect_error(with_header(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,2]}})", 2), "larger than");
  std::vector<uint8_t> huge(16, 0);
  huge[5] = 1;  // header length 2^40
  expect_error(huge, "64 MiB");
}

TEST(SafeTensors, AddRejectsInconsistentTensors) {
  SafeTensors st = sample();
  Tensor t;
  t.dtype = DType::F32;
  t.shape = {3};
  t.data.resize(4);
  EXPECT_THROW(st.add("c", t), Error);
  EXPECT_THROW(st.add("a", st.get("a")), Error);
}
