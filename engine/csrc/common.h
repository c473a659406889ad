// Shared by every ISA variant of the kernels (engine/kernels.py assembles the sources into
// one translation unit: this file, engine/csrc/isa_kernels.cpp once per ISA under its own
// `#pragma GCC target`, then the torch-facing wrappers and the module).
//
// The per-ISA bodies see raw pointers only: every template and library function they
// use from outside is defined before any target pragma, so it is compiled for the baseline
// ISA and a variant never leaks instructions into code the other variants share.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pdk {

struct bf16 {  // bfloat16 storage (the bits of at::BFloat16); the arithmetic is fp32
  uint16_t bits;
};

// One element type's kernels, each over a range [begin, end) of rows (or decode tasks), so
// the wrappers parallelise them with at::parallel_for.
template <class T>
struct Ops {
  // out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)).
  void (*rms_norm)(const T* x, int64_t xs, const T* w, T* out, int64_t n, float eps,
                   int64_t begin, int64_t end);
  // res[r] += x[r] in place, then out[r] = rms_norm(res[r]).
  void (*add_rms_norm)(T* res, int64_t rs, const T* x, int64_t xs, const T* w, T* out,
                       int64_t n, float eps, int64_t begin, int64_t end);
  // RoPE in place on the first `rotated` heads of each qkv row (rotate-half convention).
  void (*rope)(T* qkv, int64_t qs, const T* cos, int64_t cs, const T* sin, int64_t ss,
               int64_t rotated, int64_t head_dim, int64_t begin, int64_t end);
  // out[r] = silu(gate[r]) * up[r], gate_up[r] = [gate | up] of width 2n.
  void (*silu_mul)(const T* gate_up, int64_t gs, T* out, int64_t n, int64_t begin,
                   int64_t end);
  // Paged decode attention for tasks [begin, end): a task is one sequence and
  // `kv_heads / head_tasks` of its KV heads. The pages' rows hold `pool_heads` heads, the
  // first `num_kv_heads` of them at `kv` the ones read (all of them, or one tensor-parallel
  // rank's share of a pool holding every head).
  void (*decode)(const T* q, const T* kv, const int64_t* tables, const int64_t* lens, T* out,
                 int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
                 int64_t pool_heads, int64_t head_dim, int64_t block_size, float scale,
                 int64_t head_tasks, int64_t begin, int64_t end);
  // The same over int8 pages: each row of head_dim int8 values is followed by its fp32
  // scale (engine/kv_quant.py), dequantized as the row is read.
  void (*decode_i8)(const T* q, const int8_t* kv, const int64_t* tables, const int64_t* lens,
                    T* out, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
                    int64_t pool_heads, int64_t head_dim, int64_t block_size, float scale,
                    int64_t head_tasks, int64_t begin, int64_t end);
};

// Columns per block of a weight packed for `gemv_bf16` ([N / 16][K / 2][16][2]: each block's
// K pairs of 16 columns, one 64-byte vector per pair, as vdpbf16ps takes them).
constexpr int64_t kGemvBlock = 16;

// out[r, n] = x[r] . w[n] (+ bias[n]) for every row and the column blocks [begin, end),
// fp32 sums rounded to bf16 (bias: fp32 added before rounding, or null).
using GemvBf16 = void (*)(const bf16* x, int64_t xs, int64_t rows, const bf16* w,
                          int64_t k, const bf16* bias, bf16* out, int64_t os, int64_t begin,
                          int64_t end);

struct KernelTable {
  const char* name;
  Ops<float> f32;
  Ops<bf16> b16;
  GemvBf16 gemv_bf16;  // null where the variant has no vdpbf16ps
  int64_t gemv_rows;   // the most rows `gemv_bf16` is faster than oneDNN for
};

}  // namespace pdk
