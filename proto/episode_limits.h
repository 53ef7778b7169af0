// Bounds of TransitionBatch.episodes and TransitionBatch.env that the wire
// API fixes (experience.proto states them) rather than the daemon's config:
// the daemon validates against them and the clients stay within them.
// Header-only, like proto/tensor.h.
#pragma once

#include <cstdint>
#include <string_view>

namespace qstream::wire {

// Reports per batch. Above what an actor ends in one batch (an episode ends
// with one of the batch's transitions, or waited for the batch before).
inline constexpr int kMaxEpisodesPerBatch = 4096;
// EpisodeReport.length, environment steps: 1 to this.
inline constexpr int64_t kMaxEpisodeLength = 1'000'000'000;
// |EpisodeReport.episode_return|: a larger return would swamp the per-env
// sum of the return histogram (a double then no longer resolves ordinary
// returns added to it), so rate(sum) / rate(count) would stop being the mean.
inline constexpr double kMaxAbsEpisodeReturn = 1e12;
// TransitionBatch.env, bytes of [A-Za-z0-9_.:/-].
inline constexpr int kMaxEnvBytes = 64;

inline constexpr bool EnvChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
         c == ':' || c == '/' || c == '-';
}

// Index of the first byte of `env` that is not EnvChar, or -1 (the length
// is the caller's to check).
inline int64_t FirstBadEnvChar(std::string_view env) {
  for (size_t i = 0; i < env.size(); ++i) {
    if (!EnvChar(env[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace qstream::wire
