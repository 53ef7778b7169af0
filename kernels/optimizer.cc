// Host side of kernels/optimizer.h: the fused Adam + pack program.
#include "kernels/optimizer.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace qstream::kernels {

std::string PlanAdamPack(const PackProgram& pack, const float* params, const float* target, int64_t n,
                         AdamPackProgram* out) {
  *out = AdamPackProgram{};
  out->precision = pack.precision;
  std::vector<AdamPackJob> jobs;
  for (int k = 0; k < pack.num_jobs; ++k) {
    const PackJob& pj = pack.jobs[k];
    const bool from_target = pj.src >= target && pj.src < target + n;
    const float* base = from_target ? target : params;
    const int64_t offset = pj.src - base;
    if (!from_target && !(pj.src >= params && pj.src < params + n)) {
      return absl::StrCat("pack job ", k, " reads outside both networks");
    }
    if (pj.rows < 1 || pj.cols < 1 || offset + int64_t{pj.rows} * pj.cols > n) {
      return absl::StrCat("pack job ", k, " reads past the parameters");
    }
    auto it =
        std::find_if(jobs.begin(), jobs.end(), [&](const AdamPackJob& j) { return j.offset == offset; });
    if (it == jobs.end()) {
      AdamPackJob job;
      job.offset = offset;
      job.rows = pj.rows;
      job.cols = pj.cols;
      jobs.push_back(job);
      it = jobs.end() - 1;
    } else if (it->rows != pj.rows || it->cols != pj.cols) {
      return absl::StrCat("pack job ", k, " reads offset ", offset, " as ", pj.rows, " x ", pj.cols,
                          ", another job as ", it->rows, " x ", it->cols);
    }
    if (it->num_dests == kMaxAdamPackDests) {
      return absl::StrCat("more than ", kMaxAdamPackDests, " copies of offset ", offset);
    }
    it->dests[it->num_dests++] = AdamPackDest{pj.dst, pj.dst_ld, pj.transpose, pj.to_f32, from_target};
  }
  std::sort(jobs.begin(), jobs.end(),
            [](const AdamPackJob& x, const AdamPackJob& y) { return x.offset < y.offset; });
  if (static_cast<int>(jobs.size()) > kMaxPackJobs) return "too many source matrices";
  int64_t next = 0;
  int tiles = 0;
  for (AdamPackJob& job : jobs) {
    if (job.offset != next) {
      return absl::StrCat("parameters ", std::min(next, job.offset), "..", std::max(next, job.offset),
                          job.offset > next ? " are packed by no job" : " are packed as two matrices");
    }
    next = job.offset + int64_t{job.rows} * job.cols;
    job.first_tile = tiles;
    tiles +=
        ((job.rows + kAdamPackTile - 1) / kAdamPackTile) * ((job.cols + kAdamPackTile - 1) / kAdamPackTile);
    out->jobs[out->num_jobs++] = job;
  }
  if (next != n) return absl::StrCat("parameters ", next, "..", n, " are packed by no job");
  out->num_tiles = tiles;
  return "";
}

}  // namespace qstream::kernels
