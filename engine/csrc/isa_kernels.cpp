// The kernels' bodies, compiled once per ISA: engine/kernels.py pastes this file into
// `namespace PDK_ISA` under that ISA's `#pragma GCC target`, with PDK_BF16_DOT set where
// the target has AVX512-BF16 (`vdpbf16ps`). Plain loops with independent partial sums
// that the compiler vectorises for the target; fp32 math on every element type, rounded
// to the storage type where Hugging Face's bf16 modules round (so bf16 follows them).
namespace PDK_ISA {

using pdk::bf16;
constexpr int64_t kLanes = 8;  // independent partial sums: lets the compiler use SIMD

inline float load(float x) { return x; }
inline float load(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float v) {  // round to nearest even, as torch's conversion
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  p->bits = static_cast<uint16_t>(u >> 16);
}
// v rounded to T's precision, kept in fp32 (a bf16 module's intermediate result).
template <class T>
inline float round_as(float v) {
  T t;
  store(&t, v);
  return load(t);
}

template <class T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] += load(x[i + l]) * load(x[i + l]);
  float sq = 0.f;
  for (; i < n; ++i) sq += load(x[i]) * load(x[i]);
  for (int64_t l = 0; l < kLanes; ++l) sq += part[l];
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
  // Hugging Face: weight * (x * inv).to(dtype)
  for (int64_t j = 0; j < n; ++j) store(out + j, load(w[j]) * round_as<T>(load(x[j]) * inv));
}

template <class T>
void rms_norm(const T* x, int64_t xs, const T* w, T* out, int64_t n, float eps,
              int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) norm_row(x + r * xs, w, out + r * n, n, eps);
}

template <class T>
void add_rms_norm(T* res, int64_t rs, const T* x, int64_t xs, const T* w, T* out, int64_t n,
                  float eps, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    T* row = res + r * rs;
    const T* add = x + r * xs;
    for (int64_t j = 0; j < n; ++j) store(row + j, load(row[j]) + load(add[j]));
    norm_row(row, w, out + r * n, n, eps);
  }
}

template <class T>
void rope(T* qkv, int64_t qs, const T* cos, int64_t cs, const T* sin, int64_t ss,
          int64_t rotated, int64_t head_dim, int64_t begin, int64_t end) {
  const int64_t half = head_dim / 2;
  for (int64_t t = begin; t < end; ++t) {
    const T* c = cos + t * cs;
    const T* s = sin + t * ss;
    for (int64_t h = 0; h < rotated; ++h) {
      T* x = qkv + t * qs + h * head_dim;
      for (int64_t d = 0; d < half; ++d) {
        const float lo = load(x[d]), hi = load(x[d + half]);
        // x * cos + rotate_half(x) * sin, each product rounded as a bf16 module would.
        store(x + d, round_as<T>(lo * load(c[d])) + round_as<T>(-hi * load(s[d])));
        store(x + d + half, round_as<T>(hi * load(c[d + half])) +
                                round_as<T>(lo * load(s[d + half])));
      }
    }
  }
}

template <class T>
void silu_mul(const T* gate_up, int64_t gs, T* out, int64_t n, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* g = gate_up + r * gs;
    const T* u = g + n;
    T* o = out + r * n;
    for (int64_t j = 0; j < n; ++j) {
      const float x = load(g[j]);
      store(o + j, round_as<T>(x / (1.f + std::exp(-x))) * load(u[j]));
    }
  }
}

// q . k over head_dim elements; q is pre-scaled fp32 (`qs`) or, with vdpbf16ps, the bf16
// query itself (`qb`, scaled after the sum).
inline float dot(const float* qs, const float*, const float* k, int64_t head_dim, float) {
  float part[kLanes] = {};
  for (int64_t d = 0; d < head_dim; d += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] += qs[d + l] * k[d + l];
  float s = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) s += part[l];
  return s;
}
inline float dot(const float* qs, const bf16* qb, const bf16* k, int64_t head_dim,
                 float scale) {
#if PDK_BF16_DOT
  if (head_dim % 32 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 32)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qb + d),
                             (__m512bh)_mm512_loadu_si512(k + d));
    return _mm512_reduce_add_ps(acc) * scale;
  }
#endif
  (void)qb;
  (void)scale;
  float part[kLanes] = {};
  for (int64_t d = 0; d < head_dim; d += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] += qs[d + l] * load(k[d + l]);
  float s = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) s += part[l];
  return s;
}

template <class T>
void decode(const T* q, const T* kv, const int64_t* tables, const int64_t* lens, T* out,
            int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
            int64_t block_size, float scale, int64_t head_tasks, int64_t begin, int64_t end) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // kv [N, 2, bs, Hkv, D]
  const int64_t half_stride = block_size * token_stride;  // K -> V of one block
  const int64_t block_stride = 2 * half_stride;
  const int64_t heads_per_task = num_kv_heads / head_tasks;
  const int64_t width = heads_per_task * group;  // query heads of a task
  std::vector<float> qs(width * head_dim), acc(width * head_dim), scores, sums(width);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t seq = task / head_tasks, first = (task % head_tasks) * heads_per_task;
    const int64_t len = lens[seq];
    const int64_t* table = tables + seq * max_blocks;
    const T* q_seq = q + (seq * num_heads + first * group) * head_dim;
    for (int64_t i = 0; i < width * head_dim; ++i) qs[i] = load(q_seq[i]) * scale;
    scores.resize(width * len);
    for (int64_t t = 0; t < len; ++t) {
      const T* row = kv + table[t / block_size] * block_stride +
                     (t % block_size) * token_stride + first * head_dim;
      for (int64_t h = 0; h < width; ++h)
        scores[h * len + t] = dot(qs.data() + h * head_dim, q_seq + h * head_dim,
                                  row + (h / group) * head_dim, head_dim, scale);
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
        for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * load(v[d]);
      }
    }
    T* o = out + (seq * num_heads + first * group) * head_dim;
    for (int64_t h = 0; h < width; ++h)
      for (int64_t d = 0; d < head_dim; ++d)
        store(o + h * head_dim + d, acc[h * head_dim + d] / sums[h]);
  }
}

template <class T>
constexpr pdk::Ops<T> ops() {
  return {&rms_norm<T>, &add_rms_norm<T>, &rope<T>, &silu_mul<T>, &decode<T>};
}

// constexpr: no static initialiser runs code of this ISA when the module loads.
constexpr pdk::KernelTable table = {PDK_ISA_NAME, ops<float>(), ops<bf16>()};

}  // namespace PDK_ISA
