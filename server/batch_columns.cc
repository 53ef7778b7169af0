#include "server/batch_columns.h"

namespace qstream {

TransitionColumns EmptyColumns(const NetworkSpec& spec) {
  TransitionColumns c;
  c.obs_dim = spec.obs_dim;
  c.num_branches = spec.num_branches();
  return c;
}

TransitionColumns ColumnsFromNStepBatch(const v1::TransitionBatch& batch, const NetworkSpec& spec) {
  TransitionColumns c = EmptyColumns(spec);
  c.n = batch.count();
  // RepeatedField iterators are raw pointers: each assign is one memcpy.
  c.obs.assign(batch.obs().begin(), batch.obs().end());
  c.next_obs.assign(batch.next_obs().begin(), batch.next_obs().end());
  c.actions.assign(batch.actions().begin(), batch.actions().end());
  c.rewards.assign(batch.rewards().begin(), batch.rewards().end());
  c.discounts.assign(batch.discounts().begin(), batch.discounts().end());
  return c;
}

}  // namespace qstream
