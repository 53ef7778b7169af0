#include "trainer/backend.h"

namespace qstream {

const char* GuardReasonName(GuardReason reason) {
  switch (reason) {
    case GuardReason::kNone: return "none";
    case GuardReason::kNonFiniteLoss: return "nonfinite_loss";
    case GuardReason::kNonFiniteGrad: return "nonfinite_grad";
    case GuardReason::kGradNorm: return "grad_norm";
    case GuardReason::kQRange: return "q_range";
  }
  return "unknown";
}

}  // namespace qstream
