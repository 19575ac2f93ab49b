#include "model/tensor_parallel.h"

#include <algorithm>

#include "core/error.h"

namespace sparrow {

IndexRange even_share(const TensorParallel& tp, int64_t n, const char* what) {
  if (!tp.sharded()) return {0, n};
  SPARROW_CHECK(n % tp.size == 0, what, " (", n, ") is not divisible by the tensor-parallel size ", tp.size,
                ": choose a --tensor-parallel-size that divides it");
  return {n / tp.size * tp.rank, n / tp.size * (tp.rank + 1)};
}

IndexRange expert_share(const TensorParallel& tp, int64_t num_experts) {
  if (!tp.sharded()) return {0, num_experts};
  SPARROW_CHECK(num_experts >= tp.size, "expert parallel over ", tp.size, " ranks needs at least as many routed experts, "
                "the model has ", num_experts, ": leave out --enable-expert-parallel or choose a smaller "
                "--tensor-parallel-size");
  const int64_t base = num_experts / tp.size, extra = num_experts % tp.size;
  const int64_t begin = base * tp.rank + std::min<int64_t>(tp.rank, extra);
  return {begin, begin + base + (tp.rank < extra ? 1 : 0)};
}

IndexRange grouped_share(const TensorParallel& tp, int64_t heads, int64_t groups, const char* what) {
  if (!tp.sharded()) return {0, groups};
  if (groups % tp.size == 0) return even_share(tp, groups, what);
  const IndexRange mine = even_share(tp, heads, "num_attention_heads");
  const int64_t per_group = heads / groups;
  SPARROW_CHECK(mine.begin / per_group == (mine.end - 1) / per_group, what, " (", groups,
                ") and the tensor-parallel size ", tp.size, " leave a rank's query heads in two groups: choose a "
                "size that divides ", what, " or is a multiple of it");
  return {mine.begin / per_group, mine.begin / per_group + 1};
}

IndexRange vocab_share(const TensorParallel& tp, int64_t vocab) {
  const int64_t part = (vocab + tp.size - 1) / tp.size;
  const IndexRange mine{std::min(vocab, part * tp.rank), std::min(vocab, part * (tp.rank + 1))};
  SPARROW_CHECK(mine.count() > 0, "vocab_size ", vocab, " leaves rank ", tp.rank, " of ", tp.size, " no rows");
  return mine;
}

}  // namespace sparrow
