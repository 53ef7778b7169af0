// The main of every GoogleTest binary here (in place of gtest_main): the
// tests run with TEST_TMPDIR and TMPDIR set to a fresh directory of this
// process, which is removed when every test passed. The temp files of the
// tests (configs, checkpoints, certificates, tokens) and of the daemons they
// start go there, so a run leaves nothing behind in /tmp; a failing run
// keeps its files and says where.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "gtest/gtest.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const char* parent = std::getenv("TEST_TMPDIR");
  if (parent == nullptr || *parent == '\0') parent = std::getenv("TMPDIR");
  std::string dir =
      std::string(parent != nullptr && *parent != '\0' ? parent : "/tmp") + "/qstream-test.XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) {
    std::perror(("test_main: mkdtemp " + dir).c_str());
    return 2;
  }
  ::setenv("TEST_TMPDIR", dir.c_str(), 1);
  ::setenv("TMPDIR", dir.c_str(), 1);
  const int rc = RUN_ALL_TESTS();
  if (rc == 0) {
    std::error_code error;
    std::filesystem::remove_all(dir, error);
    if (error)
      std::fprintf(stderr, "test_main: could not remove %s: %s\n", dir.c_str(), error.message().c_str());
  } else {
    std::fprintf(stderr, "test_main: the tests' files are kept in %s\n", dir.c_str());
  }
  return rc;
}
