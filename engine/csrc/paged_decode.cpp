// Paged decode attention on CPU: every query token (one per sequence) attends over its
// sequence's KV pages read in place through the block table, no gather into a copy. fp32
// accumulation on float32, bfloat16 or int8 pages (int8 rows dequantized by their own
// scale as they are read); the active ISA variant's kernel.

// q [B, Hq, D]; kv_layer [N, 2, block_size, Hkv, D] of q's dtype, or int8
// [N, 2, block_size, Hkv, D + 4] (each row's fp32 scale in its last 4 bytes), contiguous or
// a slice of the heads of such pages (a tensor-parallel rank's share of a pool with every
// head); block_tables [B, M] and context_lens [B] int64 -> [B, Hq, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv_layer.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && kv_layer.dim() == 5, "q [B, Hq, D], kv [N, 2, bs, Hkv, D]");
  const bool int8_kv = kv_layer.scalar_type() == torch::kChar;
  TORCH_CHECK(int8_kv || q.scalar_type() == kv_layer.scalar_type(),
              "kv_layer must be of q's dtype or int8");
  // Rows of `pool_heads` heads, of which kv_layer's are consecutive: pages as allocated,
  // or a slice of their heads.
  const int64_t row = kv_layer.size(4);
  TORCH_CHECK(kv_layer.stride(4) == 1 && kv_layer.stride(3) == row &&
                  kv_layer.stride(2) % row == 0 && kv_layer.stride(2) / row >= kv_layer.size(3) &&
                  kv_layer.stride(1) == kv_layer.size(2) * kv_layer.stride(2) &&
                  kv_layer.stride(0) == 2 * kv_layer.stride(1),
              "kv_layer must be contiguous pages, or a slice of their heads");
  const int64_t pool_heads = kv_layer.stride(2) / row;
  TORCH_CHECK(q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16,
              "q and kv_layer must be float32 or bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong &&
              context_lens.scalar_type() == torch::kLong, "int64 block tables and lengths");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim % 8 == 0 && kv_layer.size(4) == head_dim + (int8_kv ? 4 : 0),
              "head_dim % 8 != 0, or KV rows of another width");
  TORCH_CHECK(q.size(1) % kv_layer.size(3) == 0, "heads must be a multiple of KV heads");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t num_seqs = q.size(0), num_kv_heads = kv_layer.size(3);
  // A task is one sequence and a range of its KV heads. All heads at once (the default)
  // walk each page's K and V rows front to back once: one head per task read a third of
  // every row per pass and stalled on memory (4x slower at 32 x 300 tokens). Heads are
  // split over tasks only when there are fewer sequences than threads.
  const int64_t head_tasks = num_seqs >= at::get_num_threads() ? 1 : num_kv_heads;
  pdk::dispatch(q, [&](const auto& ops, auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, num_seqs * head_tasks, 1, [&](int64_t begin, int64_t end) {
      if (int8_kv)
        ops.decode_i8(pdk::ptr<T>(q), kv_layer.data_ptr<int8_t>(),
                      block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                      pdk::ptr<T>(out), block_tables.size(1), q.size(1), num_kv_heads,
                      pool_heads, head_dim, kv_layer.size(2), static_cast<float>(scale),
                      head_tasks, begin, end);
      else
        ops.decode(pdk::ptr<T>(q), pdk::ptr<T>(kv_layer), block_tables.data_ptr<int64_t>(),
                   context_lens.data_ptr<int64_t>(), pdk::ptr<T>(out), block_tables.size(1),
                   q.size(1), num_kv_heads, pool_heads, head_dim, kv_layer.size(2),
                   static_cast<float>(scale), head_tasks, begin, end);
    });
  });
  return out;
}
