#include "runner/data_parallel.h"

#include <algorithm>

#include "core/error.h"

namespace sparrow {

DataParallelSync::DataParallelSync(Communicator& leaders) : leaders_(leaders) {}

std::vector<GroupStatus> DataParallelSync::exchange(int64_t tokens, bool stop) {
  SPARROW_CHECK(!stopped_, "the data-parallel groups have stopped stepping together (one of them left)");
  const int64_t mine[3] = {tokens, wave_, stop ? 1 : 0};
  std::vector<int64_t> all(static_cast<size_t>(3 * groups()));
  leaders_.all_gather(mine, all.data(), 3, ScalarType::I64);
  ++exchanges_;
  std::vector<GroupStatus> statuses(static_cast<size_t>(groups()));
  for (size_t d = 0; d < statuses.size(); ++d) statuses[d] = {all[3 * d], all[3 * d + 1], all[3 * d + 2]};
  stopped_ = any_stopped(statuses);
  return statuses;
}

bool any_stopped(const std::vector<GroupStatus>& statuses) {
  return std::any_of(statuses.begin(), statuses.end(), [](const GroupStatus& s) { return s.stop != 0; });
}

bool groups_settled(const std::vector<GroupStatus>& statuses) {
  if (any_stopped(statuses)) return true;
  for (const GroupStatus& s : statuses)
    if (s.tokens != 0 || s.wave != statuses[0].wave) return false;
  return true;
}

std::vector<int64_t> group_tokens(const std::vector<GroupStatus>& statuses) {
  std::vector<int64_t> tokens;
  for (const GroupStatus& s : statuses) tokens.push_back(s.tokens);
  return tokens;
}

}  // namespace sparrow
