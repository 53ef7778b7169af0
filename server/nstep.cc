#include "server/nstep.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace qstream {

NStepAssembler::NStepAssembler(const NetworkSpec& spec, int n_step, float gamma, int64_t max_envs)
    : obs_dim_(spec.obs_dim),
      branches_(spec.num_branches()),
      branch_actions_(spec.branch_actions),
      n_(n_step),
      gamma_(gamma),
      max_envs_(max_envs) {}

int64_t NStepAssembler::Pending(const NStepWindows& windows) {
  int64_t total = 0;
  for (const auto& [id, w] : windows) total += w.size;
  return total;
}

std::vector<uint32_t> NStepAssembler::SortedIds(const NStepWindows& windows) {
  std::vector<uint32_t> ids;
  ids.reserve(windows.size());
  for (const auto& [id, w] : windows) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

NStepWindow NStepAssembler::EmptyWindow() const {
  NStepWindow w;
  w.values.resize(static_cast<size_t>(n_) * obs_dim_ + n_ + obs_dim_);
  w.actions.resize(static_cast<size_t>(n_) * branches_);
  return w;
}

void NStepAssembler::Push(NStepWindow& w, const float* obs, const int32_t* actions, float reward,
                          const float* next_obs) const {
  const int slot = Wrap(w.head + w.size);
  std::copy(obs, obs + obs_dim_, this->obs(w, slot));
  std::copy(actions, actions + branches_, w.actions.begin() + static_cast<size_t>(slot) * branches_);
  rewards(w)[slot] = reward;
  if (next_obs != nullptr) std::copy(next_obs, next_obs + obs_dim_, last_next_obs(w));
  w.awaiting = next_obs == nullptr;
  ++w.size;
}

void NStepAssembler::Emit(const NStepWindow& w, int offset, int end, const float* next, bool terminal,
                          TransitionColumns* out) const {
  double ret = 0;
  double discount = 1;
  const float* r = rewards(w);
  for (int k = offset; k < end; ++k) {
    ret += discount * r[Wrap(w.head + k)];
    discount *= gamma_;
  }
  const int slot = Wrap(w.head + offset);
  const float* o = obs(w, slot);
  out->obs.insert(out->obs.end(), o, o + obs_dim_);
  out->actions.insert(out->actions.end(), w.actions.begin() + static_cast<size_t>(slot) * branches_,
                      w.actions.begin() + static_cast<size_t>(slot + 1) * branches_);
  out->rewards.push_back(static_cast<float>(ret));
  out->discounts.push_back(terminal ? 0.0f : static_cast<float>(discount));
  out->next_obs.insert(out->next_obs.end(), next, next + obs_dim_);
  ++out->n;
}

void NStepAssembler::EmitAll(const NStepWindow& w, bool terminal, TransitionColumns* out) const {
  if (w.awaiting) {
    // The newest step has no next state; the ones before it bootstrap from its obs.
    const float* next = obs(w, Wrap(w.head + w.size - 1));
    for (int k = 0; k + 1 < w.size; ++k) Emit(w, k, w.size - 1, next, terminal, out);
    return;
  }
  for (int k = 0; k < w.size; ++k) Emit(w, k, w.size, last_next_obs(w), terminal, out);
}

std::optional<BatchError> NStepAssembler::Add(const IncomingBatch& batch, NStepWindows* windows,
                                              TransitionColumns* out, int64_t* opened) const {
  const int64_t count = batch.count();
  std::vector<NStepWindow*> rows;
  if (auto error = Resolve(batch, windows, max_envs_, &rows, opened)) return error;
  // Every row emits at most one item, plus at most n for a row that ends its
  // episode (its window's): reserved once, no column grows while it fills.
  int64_t ends = 0;
  for (int64_t i = 0; i < count; ++i) {
    ends += static_cast<int64_t>(batch.done[i] != 0 || (!batch.truncated.empty() && batch.truncated[i] != 0));
  }
  out->Reserve(out->n + count + ends * n_);
  Advance(batch, rows, windows, out);
  return std::nullopt;
}

int64_t NStepAssembler::Replay(const IncomingBatch& batch, NStepWindows* windows) const {
  std::vector<NStepWindow*> rows;
  const int64_t before = static_cast<int64_t>(windows->size());
  Resolve(batch, windows, std::numeric_limits<int64_t>::max(), &rows, nullptr);
  Advance(batch, rows, windows, nullptr);
  return static_cast<int64_t>(windows->size()) - before;
}

std::optional<BatchError> NStepAssembler::Resolve(const IncomingBatch& batch, NStepWindows* windows,
                                                  int64_t max_envs, std::vector<NStepWindow*>* rows,
                                                  int64_t* opened) const {
  const int64_t count = batch.count();
  const bool has_env_ids = !batch.env_ids.empty();
  const auto id_of = [&](int64_t i) -> uint32_t { return has_env_ids ? batch.env_ids[i] : 0; };
  rows->assign(static_cast<size_t>(count), nullptr);
  // Lookups only, so a rejected batch leaves every window untouched. Without
  // env_ids every row is env 0, which counts like any other (a batch of
  // count 0, episode reports only, opens nothing).
  const int64_t held = static_cast<int64_t>(windows->size());
  int64_t envs = held;
  absl::flat_hash_set<uint32_t> fresh;
  const NStepWindow* probe = nullptr;  // a window found, to tell whether reserve() moved them
  uint32_t probe_id = 0;
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t id = id_of(i);
    if (!has_env_ids && i > 0) {
      (*rows)[i] = (*rows)[0];
      continue;
    }
    if (auto it = windows->find(id); it != windows->end()) {
      (*rows)[i] = &it->second;
      if (probe == nullptr) {
        probe = &it->second;
        probe_id = id;
      }
      continue;
    }
    if (!fresh.insert(id).second) continue;
    if (++envs > max_envs) {
      return BatchError{
          v1::Error::TOO_LARGE, "env_ids",
          absl::StrCat(has_env_ids ? absl::StrCat("env_ids[", i, "]: ", id) : "env 0 (no env_ids)",
                       " opens more than server.max_envs_per_stream = ", max_envs,
                       " environments on this stream")};
    }
  }
  if (opened != nullptr) *opened = envs - held;
  if (fresh.empty()) return std::nullopt;
  // Room for every window the batch opens, so that opening them moves no
  // window found above; reserve() itself may move them all (a rehash).
  windows->reserve(windows->size() + fresh.size());
  if (probe != nullptr && &windows->find(probe_id)->second != probe) {
    for (int64_t i = 0; i < count; ++i) {
      if ((*rows)[i] != nullptr) (*rows)[i] = &windows->find(id_of(i))->second;
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    if ((*rows)[i] != nullptr) continue;
    auto [it, inserted] = windows->try_emplace(id_of(i));
    if (inserted) it->second = EmptyWindow();
    (*rows)[i] = &it->second;
  }
  return std::nullopt;
}

void NStepAssembler::Advance(const IncomingBatch& batch, const std::vector<NStepWindow*>& rows,
                             NStepWindows* windows, TransitionColumns* out) const {
  const int64_t count = batch.count();
  const bool has_env_ids = !batch.env_ids.empty();
  const bool has_truncated = !batch.truncated.empty();
  // The step-stream form: a row's next state is the next row's obs of its env.
  const bool stream_form = batch.columns.next_obs.empty();
  const float* final_obs = batch.final_obs.data();
  const TransitionColumns& in = batch.columns;
  // Rows that ended their episode: their windows are dropped at the end
  // unless a later row of the batch opened the next episode.
  std::vector<uint32_t> emptied;
  for (int64_t i = 0; i < count; ++i) {
    NStepWindow& w = *rows[i];
    const float* obs = in.obs.data() + i * obs_dim_;
    if (w.awaiting && w.size == n_) {
      // This row's obs is the newest step's next state: the oldest item is complete.
      if (out != nullptr) Emit(w, 0, n_, obs, /*terminal=*/false, out);
      w.head = Wrap(w.head + 1);
      --w.size;
    }
    const bool done = batch.done[i] != 0;
    const bool ends = done || (has_truncated && batch.truncated[i] != 0);
    const float* next = nullptr;
    if (!stream_form) {
      next = in.next_obs.data() + i * obs_dim_;
    } else if (ends) {
      next = final_obs;
      final_obs += obs_dim_;
    }
    Push(w, obs, in.actions.data() + i * branches_, in.rewards[i], next);
    if (ends) {
      if (out != nullptr) EmitAll(w, /*terminal=*/done, out);
      w.head = 0;
      w.size = 0;
      emptied.push_back(has_env_ids ? batch.env_ids[i] : 0);
    } else if (w.size == n_ && !w.awaiting) {
      if (out != nullptr) Emit(w, 0, n_, last_next_obs(w), /*terminal=*/false, out);
      w.head = Wrap(w.head + 1);
      --w.size;
    }
  }
  // Only windows holding steps are kept (an episode that ended leaves none).
  // With n = 1 a window of the full form is empty after every row: all empty
  // ones go at a batch with an end (as Fold expects); with n > 1 only a row
  // that ends its episode empties a window.
  if (emptied.empty()) return;
  if (n_ == 1) {
    absl::erase_if(*windows, [](const auto& entry) { return entry.second.size == 0; });
    return;
  }
  for (uint32_t id : emptied) {
    if (auto it = windows->find(id); it != windows->end() && it->second.size == 0) windows->erase(it);
  }
}

void NStepAssembler::Keep(NStepWindow& w, const float* obs, const int32_t* actions, float reward,
                          const float* next_obs) const {
  // Advance's steps for such a row, without the items it emits.
  if (w.awaiting && w.size == n_) {
    w.head = Wrap(w.head + 1);
    --w.size;
  }
  Push(w, obs, actions, reward, next_obs);
  if (w.size == n_ && !w.awaiting) {
    w.head = Wrap(w.head + 1);
    --w.size;
  }
}

int64_t NStepAssembler::Fold(const std::vector<const IncomingBatch*>& batches, NStepWindows* windows) const {
  const int64_t before = static_cast<int64_t>(windows->size());
  // Per env, newest row first: the rows kept so far and whether older rows
  // matter at all. After n rows (or an episode end) they do not: whatever
  // the window held before, Replay leaves exactly the newest of the kept
  // rows (n - 1 of them, or n when the newest awaits its next obs), and the
  // bootstrap state of the newest.
  struct Tail {
    int kept = 0;
    bool fresh = false;  // start from an empty window (none when kept is 0)
    size_t newest = 0;   // the batch of the env's newest row
  };
  struct Row {
    uint32_t env;
    uint32_t batch;
    int64_t row;
  };
  absl::flat_hash_map<uint32_t, Tail> tails;
  tails.reserve(windows->size());
  std::vector<Row> kept;
  // The newest batch that ends an episode: Replay drops every empty window
  // at the end of such a batch (n = 1 leaves a window empty without an end).
  std::optional<size_t> last_end;
  for (size_t b = batches.size(); b-- > 0;) {
    const IncomingBatch& batch = *batches[b];
    const bool has_env_ids = !batch.env_ids.empty();
    const bool has_truncated = !batch.truncated.empty();
    for (int64_t i = batch.count(); i-- > 0;) {
      const bool ends = batch.done[i] != 0 || (has_truncated && batch.truncated[i] != 0);
      if (ends && !last_end) last_end = b;
      const uint32_t id = has_env_ids ? batch.env_ids[i] : 0;
      auto [at, first] = tails.try_emplace(id);
      Tail& t = at->second;
      if (first) t.newest = b;
      if (t.fresh) continue;
      if (ends) {
        t.fresh = true;  // the rows kept start a new episode
        continue;
      }
      kept.push_back({id, static_cast<uint32_t>(b), i});
      if (++t.kept == n_) t.fresh = true;
    }
  }
  for (const auto& [id, t] : tails) {
    if (!t.fresh) continue;  // continues its window (or opens one)
    if (t.kept == 0) {
      windows->erase(id);  // its newest row ended the episode
      continue;
    }
    auto [it, opened] = windows->try_emplace(id);
    NStepWindow& w = it->second;
    if (opened) w = EmptyWindow();
    w.head = 0;
    w.size = 0;
    w.awaiting = false;
  }
  for (size_t k = kept.size(); k-- > 0;) {
    const Row& r = kept[k];
    const IncomingBatch& batch = *batches[r.batch];
    const TransitionColumns& in = batch.columns;
    auto it = windows->find(r.env);
    if (it == windows->end()) it = windows->emplace(r.env, EmptyWindow()).first;
    // Such a row's next state is its own next_obs, or (the step-stream form)
    // the next row's obs: the window awaits it.
    const float* next = in.next_obs.empty() ? nullptr : in.next_obs.data() + r.row * obs_dim_;
    Keep(it->second, in.obs.data() + r.row * obs_dim_, in.actions.data() + r.row * branches_,
         in.rewards[r.row], next);
  }
  if (last_end) {
    absl::erase_if(*windows, [&](const auto& entry) {
      if (entry.second.size != 0) return false;
      const auto t = tails.find(entry.first);
      return t == tails.end() || t->second.newest <= *last_end;
    });
  }
  return static_cast<int64_t>(windows->size()) - before;
}

void NStepAssembler::Flush(const NStepWindows& windows, TransitionColumns* out) const {
  out->Reserve(out->n + Pending(windows));
  for (uint32_t id : SortedIds(windows)) EmitAll(windows.at(id), /*terminal=*/false, out);
}

int64_t NStepAssembler::window_bytes() const {
  // Two vectors, each with a malloc header and rounding (~16 bytes), and the
  // window's hash-map slot (key and struct) at the table's lowest load (7/16)
  // plus its control byte.
  constexpr int64_t kPerAllocation = 16;
  const int64_t columns = (static_cast<int64_t>(n_) * obs_dim_ + obs_dim_ + n_) * sizeof(float) +
                          static_cast<int64_t>(n_) * branches_ * sizeof(int32_t);
  const int64_t slot = static_cast<int64_t>(sizeof(std::pair<const uint32_t, NStepWindow>));
  return columns + 2 * kPerAllocation + (slot * 16 + 6) / 7 + 1;
}

void NStepAssembler::Save(const NStepWindows& windows,
                          google::protobuf::RepeatedPtrField<v1::NStepWindowState>* out) const {
  for (uint32_t id : SortedIds(windows)) {
    const NStepWindow& w = windows.at(id);
    if (w.size == 0) continue;
    v1::NStepWindowState* s = out->Add();
    s->set_env_id(id);
    for (int k = 0; k < w.size; ++k) {
      const int slot = Wrap(w.head + k);
      const float* o = obs(w, slot);
      s->mutable_obs()->Add(o, o + obs_dim_);
      s->mutable_actions()->Add(w.actions.begin() + static_cast<size_t>(slot) * branches_,
                                w.actions.begin() + static_cast<size_t>(slot + 1) * branches_);
      s->add_rewards(rewards(w)[slot]);
    }
    if (w.awaiting) {
      s->set_awaiting_next_obs(true);
    } else {
      const float* next = last_next_obs(w);
      s->mutable_last_next_obs()->Add(next, next + obs_dim_);
    }
  }
}

absl::Status NStepAssembler::Load(const google::protobuf::RepeatedPtrField<v1::NStepWindowState>& in,
                                  NStepWindows* out) const {
  NStepWindows windows;
  for (int i = 0; i < in.size(); ++i) {
    const v1::NStepWindowState& s = in.Get(i);
    const std::string where = absl::StrCat("windows[", i, "] (env_id ", s.env_id(), ")");
    const int size = s.rewards_size();
    if (size == 0) continue;
    const bool awaiting = s.awaiting_next_obs();
    // An awaiting window holds its n-th step until the next row's obs comes.
    const int most = awaiting ? n_ : n_ - 1;
    if (size > most) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", size, " steps; returns.n_step = ", n_,
                                                     " holds at most ", most,
                                                     awaiting ? " (awaiting_next_obs)" : ""));
    }
    if (s.obs_size() != size * obs_dim_) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": obs: ", s.obs_size(), " values, expected ", size, " x obs_dim ", obs_dim_));
    }
    if (s.actions_size() != size * branches_) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": actions: ", s.actions_size(),
                                                     " values, expected ", size, " x branches ", branches_));
    }
    const int next_values = awaiting ? 0 : obs_dim_;
    if (s.last_next_obs_size() != next_values) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": last_next_obs: ", s.last_next_obs_size(),
                                                     " values, expected ", next_values,
                                                     awaiting ? " (awaiting_next_obs)" : " (obs_dim)"));
    }
    for (int j = 0; j < s.actions_size(); ++j) {
      const int b = j % branches_;
      if (s.actions(j) < 0 || s.actions(j) >= branch_actions_[b]) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": actions[", j, "]: ", s.actions(j),
                                                       " out of range [0, ", branch_actions_[b],
                                                       ") for branch ", b));
      }
    }
    NStepWindow w = EmptyWindow();
    std::copy(s.obs().begin(), s.obs().end(), obs(w, 0));
    std::copy(s.actions().begin(), s.actions().end(), w.actions.begin());
    std::copy(s.rewards().begin(), s.rewards().end(), rewards(w));
    std::copy(s.last_next_obs().begin(), s.last_next_obs().end(), last_next_obs(w));
    w.size = size;
    w.awaiting = awaiting;
    if (!windows.emplace(s.env_id(), std::move(w)).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": env_id appears twice"));
    }
  }
  *out = std::move(windows);
  return absl::OkStatus();
}

}  // namespace qstream
