// Small file helpers shared by the checkpoint-format tests.
#pragma once

#include <stdlib.h>

#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace qstream::testing {

// A fresh directory under the test's temp dir, named after `prefix`.
inline std::string MakeTempDir(const std::string& prefix) {
  std::string tmpl = ::testing::TempDir() + "/" + prefix + ".XXXXXX";
  EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace qstream::testing
