// cuBLASLt carries ~94 KB of static TLS, and glibc carves static TLS out of
// every thread's stack. civetweb (under prometheus-cpp's Exposer) asks for
// fixed 100 KB stacks in Debian's build, so once the CUDA backend is linked
// its pthread_create fails with EINVAL and /metrics cannot start. This
// definition interposes pthread_attr_setstacksize for the whole process
// (exported from the executable, see server/CMakeLists.txt) and raises
// explicit stack sizes below a floor; larger requests pass unchanged.
#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <cstddef>

namespace {
constexpr size_t kStackFloorBytes = size_t{1} << 20;
using SetStackSize = int (*)(pthread_attr_t*, size_t);
}  // namespace

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t stacksize) {
  static const SetStackSize real =
      reinterpret_cast<SetStackSize>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  return real(attr, std::max(stacksize, kStackFloorBytes));
}
