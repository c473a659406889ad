// Paged decode attention on CPU: every query token (one per sequence) attends over its
// sequence's KV pages read in place through the block table, no gather into a copy.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;  // independent partial sums: lets the compiler use SIMD

template <typename T>
void decode(const T* q, const T* kv, const int64_t* tables, const int64_t* lens, T* out,
            int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_dim, int64_t block_size, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;     // kv [N, 2, bs, Hkv, D]
  const int64_t half_stride = block_size * token_stride;     // K -> V of one block
  const int64_t block_stride = 2 * half_stride;
  // A task is one sequence and a range of its KV heads. All heads at once (the default)
  // walk each page's K and V rows front to back once: one head per task read a third of
  // every row per pass and stalled on memory (4x slower at 32 x 300 tokens). Heads are
  // split over tasks only when there are fewer sequences than threads.
  const int64_t head_tasks = num_seqs >= at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t heads_per_task = num_kv_heads / head_tasks;
  at::parallel_for(0, num_seqs * head_tasks, 1, [&](int64_t begin, int64_t end) {
    const int64_t width = heads_per_task * group;  // query heads of a task
    std::vector<float> qs(width * head_dim), acc(width * head_dim), scores, sums(width);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / head_tasks, first = (task % head_tasks) * heads_per_task;
      const int64_t len = lens[seq];
      const int64_t* table = tables + seq * max_blocks;
      const T* q_seq = q + (seq * num_heads + first * group) * head_dim;
      for (int64_t i = 0; i < width * head_dim; ++i) qs[i] = static_cast<float>(q_seq[i]) * scale;
      scores.resize(width * len);
      for (int64_t t = 0; t < len; ++t) {
        const T* row = kv + table[t / block_size] * block_stride + (t % block_size) * token_stride +
                       first * head_dim;
        for (int64_t h = 0; h < width; ++h) {
          const float* qh = qs.data() + h * head_dim;
          const T* k = row + (h / group) * head_dim;
          float part[kLanes] = {};
          for (int64_t d = 0; d < head_dim; d += kLanes)
            for (int64_t l = 0; l < kLanes; ++l) part[l] += qh[d + l] * static_cast<float>(k[d + l]);
          float s = 0.f;
          for (int64_t l = 0; l < kLanes; ++l) s += part[l];
          scores[h * len + t] = s;
        }
      }
      for (int64_t h = 0; h < width; ++h) {
        float* sh = scores.data() + h * len;
        const float top = *std::max_element(sh, sh + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) sum += (sh[t] = std::exp(sh[t] - top));
        sums[h] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* row = kv + table[t / block_size] * block_stride + half_stride +
                       (t % block_size) * token_stride + first * head_dim;
        for (int64_t h = 0; h < width; ++h) {
          const float p = scores[h * len + t];
          const T* v = row + (h / group) * head_dim;
          float* ah = acc.data() + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * static_cast<float>(v[d]);
        }
      }
      T* o = out + (seq * num_heads + first * group) * head_dim;
      for (int64_t h = 0; h < width; ++h)
        for (int64_t d = 0; d < head_dim; ++d)
          o[h * head_dim + d] = static_cast<T>(acc[h * head_dim + d] / sums[h]);
    }
  });
}

}  // namespace

// q [B, Hq, D]; kv_layer [N, 2, block_size, Hkv, D]; block_tables [B, M] and
// context_lens [B] int64 -> [B, Hq, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv_layer.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && kv_layer.dim() == 5, "q [B, Hq, D], kv [N, 2, bs, Hkv, D]");
  TORCH_CHECK(kv_layer.is_contiguous() && q.scalar_type() == kv_layer.scalar_type(),
              "kv_layer must be contiguous and of q's dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong &&
              context_lens.scalar_type() == torch::kLong, "int64 block tables and lengths");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim % kLanes == 0 && kv_layer.size(4) == head_dim, "head_dim % 8 != 0");
  TORCH_CHECK(q.size(1) % kv_layer.size(3) == 0, "heads must be a multiple of KV heads");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), kv_layer.data_ptr<scalar_t>(),
                     block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                     out.data_ptr<scalar_t>(), q.size(0), block_tables.size(1), q.size(1),
                     kv_layer.size(3), head_dim, kv_layer.size(2), static_cast<float>(scale));
  });
  return out;
}

