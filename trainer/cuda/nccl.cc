#include "trainer/cuda/nccl.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"

#if QSTREAM_WITH_NCCL
#include <nccl.h>
#endif

namespace qstream::cuda {

#if QSTREAM_WITH_NCCL
namespace {

static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes);

// The entry points qstream uses, resolved from the loaded library.
struct NcclApi {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGetLastError) last_error = nullptr;
};

struct Loaded {
  NcclApi api;
  std::string error;  // why it could not be loaded ("" when loaded)
};

template <typename F>
bool Resolve(void* lib, const char* name, F* out, std::string* error) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr) *error = absl::StrCat("NCCL: ", name, " not found in the library");
  return *out != nullptr;
}

const Loaded& Library() {
  static absl::once_flag once;
  static Loaded* loaded = new Loaded;
  absl::call_once(once, [] {
    // NVLink multicast can take a shared host's GPUs out of service.
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
    const char* file = std::getenv("NCCL_LIBRARY");
    if (file == nullptr || *file == '\0') file = "libnccl.so.2";
    void* lib = dlopen(file, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      loaded->error = absl::StrCat("NCCL: cannot load ", file, " (", why != nullptr ? why : "?",
                                   "); put libnccl.so.2 on the library path or set NCCL_LIBRARY");
      return;
    }
    NcclApi& a = loaded->api;
    std::string& e = loaded->error;
    // The handle stays open for the life of the process.
    (void)(Resolve(lib, "ncclGetVersion", &a.get_version, &e) &&
           Resolve(lib, "ncclGetUniqueId", &a.get_unique_id, &e) &&
           Resolve(lib, "ncclCommInitRank", &a.comm_init_rank, &e) &&
           Resolve(lib, "ncclCommDestroy", &a.comm_destroy, &e) &&
           Resolve(lib, "ncclAllReduce", &a.all_reduce, &e) &&
           Resolve(lib, "ncclBroadcast", &a.broadcast, &e) &&
           Resolve(lib, "ncclGetErrorString", &a.error_string, &e) &&
           Resolve(lib, "ncclGetLastError", &a.last_error, &e));
  });
  return *loaded;
}

absl::Status ToStatus(ncclResult_t r, const char* what, ncclComm_t comm) {
  if (r == ncclSuccess) return absl::OkStatus();
  const NcclApi& a = Library().api;
  const char* last = a.last_error != nullptr ? a.last_error(comm) : "";
  return absl::InternalError(
      absl::StrCat("NCCL ", what, ": ", a.error_string(r),
                   last != nullptr && *last != '\0' ? absl::StrCat(" (", last, ")") : ""));
}

}  // namespace

#define QS_NCCL_CHECK(expr, comm)                                     \
  do {                                                                \
    ::absl::Status qs_nccl_status_ = ToStatus((expr), #expr, (comm)); \
    if (!qs_nccl_status_.ok()) return qs_nccl_status_;                \
  } while (0)

std::string NcclVersion() {
  const Loaded& l = Library();
  if (!l.error.empty()) return l.error;
  int v = 0;
  if (l.api.get_version(&v) != ncclSuccess) return "NCCL (version unknown)";
  return absl::StrCat("NCCL ", v / 10000, ".", v / 100 % 100, ".", v % 100);
}

absl::StatusOr<std::string> NewNcclUniqueId() {
  const Loaded& l = Library();
  if (!l.error.empty()) return absl::FailedPreconditionError(l.error);
  ncclUniqueId id;
  QS_NCCL_CHECK(l.api.get_unique_id(&id), nullptr);
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<NcclComm>> NcclComm::Create(const std::string& unique_id, int world_size,
                                                           int rank) {
  const Loaded& l = Library();
  if (!l.error.empty()) return absl::FailedPreconditionError(l.error);
  if (unique_id.size() != kNcclUniqueIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL unique id: ", unique_id.size(), " bytes, expected ", kNcclUniqueIdBytes));
  }
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclComm_t comm = nullptr;
  QS_NCCL_CHECK(l.api.comm_init_rank(&comm, world_size, id, rank), nullptr);
  return std::unique_ptr<NcclComm>(new NcclComm(comm, world_size, rank));
}

NcclComm::~NcclComm() {
  if (comm_ != nullptr) Library().api.comm_destroy(static_cast<ncclComm_t>(comm_));
}

absl::Status NcclComm::AllReduceMean(float* data, int64_t count, cudaStream_t stream) {
  auto comm = static_cast<ncclComm_t>(comm_);
  QS_NCCL_CHECK(
      Library().api.all_reduce(data, data, static_cast<size_t>(count), ncclFloat32, ncclAvg, comm, stream),
      comm);
  return absl::OkStatus();
}

absl::Status NcclComm::Broadcast(void* data, int64_t bytes, int root, cudaStream_t stream) {
  auto comm = static_cast<ncclComm_t>(comm_);
  QS_NCCL_CHECK(
      Library().api.broadcast(data, data, static_cast<size_t>(bytes), ncclUint8, root, comm, stream), comm);
  return absl::OkStatus();
}

#undef QS_NCCL_CHECK

#else  // !QSTREAM_WITH_NCCL

namespace {
constexpr char kNoNccl[] =
    "NCCL: this build has no nccl.h (QSTREAM_WITH_NCCL=0); data-parallel groups need it";
}

std::string NcclVersion() { return kNoNccl; }
absl::StatusOr<std::string> NewNcclUniqueId() { return absl::FailedPreconditionError(kNoNccl); }
absl::StatusOr<std::unique_ptr<NcclComm>> NcclComm::Create(const std::string&, int, int) {
  return absl::FailedPreconditionError(kNoNccl);
}
NcclComm::~NcclComm() = default;
absl::Status NcclComm::AllReduceMean(float*, int64_t, cudaStream_t) {
  return absl::FailedPreconditionError(kNoNccl);
}
absl::Status NcclComm::Broadcast(void*, int64_t, int, cudaStream_t) {
  return absl::FailedPreconditionError(kNoNccl);
}

#endif  // QSTREAM_WITH_NCCL

}  // namespace qstream::cuda
