#include "server/batch_columns.h"

namespace qstream {

TransitionColumns EmptyColumns(const NetworkSpec& spec) {
  TransitionColumns c;
  c.obs_dim = spec.obs_dim;
  c.num_branches = spec.num_branches();
  return c;
}

}  // namespace qstream
