// MiniMax-M3's MSA block selection, the CPU reference (transformers 5.17 MiniMaxM3VLIndexer and
// build_block_mask; model/msa_indexer.h says what the block does). kernels/cuda/msa is the GPU form and is
// tested against this.
//
//   block score  B_g[b] = max over visible keys s of block b of q_g · k_s    (raw dot, no scale)
// The local_blocks newest blocks (clamped at block 0) and the first init_blocks are forced; the remaining
// slots of topk_blocks go to the best-scoring other blocks; a query that sees no more than topk_blocks
// blocks keeps them all. Ties go to the smaller block id (torch.topk leaves them unspecified).
#pragma once
#include <cstdint>
#include <vector>

namespace sparrow::cpu {

// The selection rule for one query and one index head. `block_scores` holds the scores of the blocks
// the query sees (blocks 0 .. position / block_size); returns the kept block ids, forced blocks first,
// then by descending score. vLLM scores init blocks 1e30 and local ones 1e29
// (vllm/models/minimax_m3/common/indexer.py); here both are +inf and ties go to the smaller block id,
// which ranks init blocks first the same way.
std::vector<int32_t> select_blocks(std::vector<float> block_scores, int64_t position, int64_t block_size,
                                   int64_t topk_blocks, int64_t local_blocks, int64_t init_blocks = 0);
// Whether select_blocks forces block b (b <= newest, the query's own block): one of the local_blocks newest
// (clamped at block 0) or of the first init_blocks.
inline bool msa_block_forced(int64_t b, int64_t newest, int64_t local_blocks, int64_t init_blocks) {
  return b > newest - local_blocks || b < init_blocks;
}

struct MsaSelectShape {
  int64_t heads = 0;         // index heads, one selection each
  int64_t head_dim = 0;      // index_head_dim
  int64_t block_size = 0;    // keys per block
  int64_t topk_blocks = 0;   // kept per query, forced ones included
  int64_t local_blocks = 0;  // newest blocks always kept
  int64_t init_blocks = 0;   // first blocks always kept
};

// The kept blocks of `count` consecutive queries of one sequence at positions start .. start+count-1:
// queries are rows `ld_queries` floats apart holding [heads, head_dim]; keys are the sequence's index keys
// [>= start + count, head_dim] (later keys are never looked at). Writes kept[(i * heads + g) * topk_blocks
// ...] for query i and head g: the kept block ids ascending, then -1 (msa_select_blocks' layout in
// kernels/cuda/msa/msa.h, so both devices hand the attention the same table).
void msa_select(const MsaSelectShape& shape, const float* queries, int64_t ld_queries, int64_t count, int64_t start,
                const float* keys, int32_t* kept);

// One query's block scores over some of the blocks it sees, for the indexer's decode context parallelism
// (model/msa_indexer.h): keys [n, head_dim] hold those blocks' visible keys back to back, block j's from
// starts[j] (ascending; the last runs to n). scores[g * starts.size() + j] = max over block j's keys of
// q_g · k, the products as msa_select forms them (one query row against its keys), so each block's score
// is msa_select's.
void msa_block_scores(int64_t heads, int64_t head_dim, const float* query, const float* keys, int64_t n,
                      const std::vector<int64_t>& starts, float* scores);

}  // namespace sparrow::cpu
