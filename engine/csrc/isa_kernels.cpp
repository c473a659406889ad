// The kernels' bodies, compiled once per ISA: engine/kernels.py pastes this file into
// `namespace PDK_ISA` under that ISA's `#pragma GCC target`, with PDK_AVX512 set where the
// target has AVX-512 (explicit 16-key blocks in decode) and PDK_BF16_DOT where it has
// AVX512-BF16 (`vdpbf16ps`). Plain loops with independent partial sums
// that the compiler vectorises for the target; fp32 math on every element type, rounded
// to the storage type where Hugging Face's bf16 modules round (so bf16 follows them).
namespace PDK_ISA {

using pdk::bf16;
constexpr int64_t kLanes = 8;  // independent partial sums: lets the compiler use SIMD

inline float load(float x) { return x; }
inline float load(int8_t x) { return static_cast<float>(x); }
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

// Elements after a KV row's head_dim values: an int8 row carries its fp32 scale there.
template <class K>
constexpr int64_t kTail = std::is_same_v<K, int8_t> ? 4 : 0;

// The factor a KV row's values are multiplied by: its stored scale for int8, else 1.
template <class K>
inline float row_scale(const K* row, int64_t head_dim) {
  if constexpr (std::is_same_v<K, int8_t>) {
    float s;
    std::memcpy(&s, row + head_dim, sizeof s);
    return s;
  } else {
    (void)row;
    (void)head_dim;
    return 1.f;
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
// q . k for an int8 row (its scale not applied): widened to fp32 lane by lane.
template <class T>
inline float dot(const float* qs, const T*, const int8_t* k, int64_t head_dim, float) {
  float part[kLanes] = {};
  for (int64_t d = 0; d < head_dim; d += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] += qs[d + l] * static_cast<float>(k[d + l]);
  float s = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) s += part[l];
  return s;
}

#if PDK_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {  // widen 16 bf16 to fp32
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const int8_t* p) {  // widen 16 int8 to fp32
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Asks for n elements from p into the cache ahead of their use (pages are scattered, so
// the hardware prefetcher restarts at every page).
template <class T>
inline void prefetch(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64)
    _mm_prefetch(bytes + i, _MM_HINT_T0);
}

// out[i] = sum of v[i]'s 16 lanes, for 16 vectors: a transposing tree of shuffles and
// adds (45 instructions where 16 horizontal sums take about 130).
inline __m512 sum16(__m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }  // b[i]: each 128-bit lane holds that lane's sums of v[4i .. 4i+3]
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                  _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                  _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// Scores of one query head against 16 consecutive keys `stride` elements apart.
template <class T, class K>
inline void scores16(const float* qs, const T* qb, const K* k, int64_t stride,
                     int64_t head_dim, float scale, float* out) {
  __m512 acc[16];
#if PDK_BF16_DOT
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<K, bf16>) {
    for (int i = 0; i < 16; ++i) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 32)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qb + d),
                             (__m512bh)_mm512_loadu_si512(k + i * stride + d));
      acc[i] = a;
    }
    _mm512_storeu_ps(out, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
    return;
  }
#endif
  (void)qb;
  (void)scale;
  for (int i = 0; i < 16; ++i) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 16)
      a = _mm512_fmadd_ps(_mm512_loadu_ps(qs + d), load16(k + i * stride + d), a);
    acc[i] = a;
  }
  __m512 sums = sum16(acc);
  if constexpr (std::is_same_v<K, int8_t>) {
    float scales[16];
    for (int i = 0; i < 16; ++i) scales[i] = row_scale(k + i * stride, head_dim);
    sums = _mm512_mul_ps(sums, _mm512_loadu_ps(scales));
  }
  _mm512_storeu_ps(out, sums);
}
#endif

// K is the pages' element type: T itself, or int8 (rows of head_dim values and a scale).
template <class T, class K>
void decode(const T* q, const K* kv, const int64_t* tables, const int64_t* lens, T* out,
            int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t pool_heads,
            int64_t head_dim, int64_t block_size, float scale, int64_t head_tasks, int64_t begin, int64_t end) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_width = head_dim + kTail<K>;
  const int64_t token_stride = pool_heads * row_width;  // kv [N, 2, bs, pool_heads, row_width]
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
    for (int64_t t = 0; t < len;) {
      const K* row = kv + table[t / block_size] * block_stride +
                     (t % block_size) * token_stride + first * row_width;
#if PDK_AVX512
      // 16 keys of one page at once (no horizontal sum per key).
      if (block_size % 16 == 0 && t % 16 == 0 && t + 16 <= len && head_dim % 32 == 0) {
        if (t % block_size == 0 && t + block_size < len)  // the next page is elsewhere
          prefetch(kv + table[t / block_size + 1] * block_stride, half_stride);
        for (int64_t h = 0; h < width; ++h)
          scores16(qs.data() + h * head_dim, q_seq + h * head_dim,
                   row + (h / group) * row_width, token_stride, head_dim, scale,
                   scores.data() + h * len + t);
        t += 16;
        continue;
      }
#endif
      for (int64_t h = 0; h < width; ++h) {
        const K* k = row + (h / group) * row_width;
        scores[h * len + t] =
            dot(qs.data() + h * head_dim, q_seq + h * head_dim, k, head_dim, scale) *
            row_scale(k, head_dim);
      }
      ++t;
    }
    for (int64_t h = 0; h < width; ++h) {
      float* sh = scores.data() + h * len;
      const float top = *std::max_element(sh, sh + len);
      // Two plain loops, so each vectorises (a SIMD exp, then a SIMD sum).
      for (int64_t t = 0; t < len; ++t) sh[t] = std::exp(sh[t] - top);
      float sum = 0.f;
      for (int64_t t = 0; t < len; ++t) sum += sh[t];
      sums[h] = sum;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
#if PDK_AVX512
    if (head_dim % 64 == 0) {
      // A page's run of V rows per head, the head's 64-column slices in registers.
      for (int64_t t0 = 0, run; t0 < len; t0 += run) {
        run = std::min(block_size - t0 % block_size, len - t0);
        if (t0 + run < len)
          prefetch(kv + table[(t0 + run) / block_size] * block_stride + half_stride, half_stride);
        const K* rows = kv + table[t0 / block_size] * block_stride + half_stride +
                        (t0 % block_size) * token_stride + first * row_width;
        for (int64_t h = 0; h < width; ++h) {
          const K* v = rows + (h / group) * row_width;
          const float* p = scores.data() + h * len + t0;
          for (int64_t d = 0; d < head_dim; d += 64) {
            float* ah = acc.data() + h * head_dim + d;
            __m512 a0 = _mm512_loadu_ps(ah), a1 = _mm512_loadu_ps(ah + 16),
                   a2 = _mm512_loadu_ps(ah + 32), a3 = _mm512_loadu_ps(ah + 48);
            for (int64_t i = 0; i < run; ++i) {
              const __m512 pv =
                  _mm512_set1_ps(p[i] * row_scale(v + i * token_stride, head_dim));
              const K* vr = v + i * token_stride + d;
              a0 = _mm512_fmadd_ps(pv, load16(vr), a0);
              a1 = _mm512_fmadd_ps(pv, load16(vr + 16), a1);
              a2 = _mm512_fmadd_ps(pv, load16(vr + 32), a2);
              a3 = _mm512_fmadd_ps(pv, load16(vr + 48), a3);
            }
            _mm512_storeu_ps(ah, a0);
            _mm512_storeu_ps(ah + 16, a1);
            _mm512_storeu_ps(ah + 32, a2);
            _mm512_storeu_ps(ah + 48, a3);
          }
        }
      }
    } else
#endif
    for (int64_t t = 0; t < len; ++t) {
      const K* row = kv + table[t / block_size] * block_stride + half_stride +
                     (t % block_size) * token_stride + first * row_width;
      for (int64_t h = 0; h < width; ++h) {
        const K* v = row + (h / group) * row_width;
        const float p = scores[h * len + t] * row_scale(v, head_dim);
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

#if PDK_BF16_DOT
// Rows up to which each kernel beats oneDNN's bf16 GEMM on a SmolLM2 layer's weights
// (measured on a 2-core Xeon with AMX, 2 threads): vdpbf16ps 1.35x at 1 row, 1.09x at 4,
// 0.8x at 8; AMX 1.5x from 1 to 16 rows, 1.17x at 32, 0.91x at 64.
constexpr int64_t kGemvRows = 4, kAmxRows = 32;

// Few-row bf16 GEMM on a weight packed for it (pdk::kGemvBlock): streams each weight
// vector once for every row (decode steps are bound by reading the weights), 4 column
// blocks at a time so 4 independent sums per row hide vdpbf16ps's latency, rows 4 at a time
// (a later group of rows reads the blocks again from cache).
inline void gemv_bf16(const bf16* x, int64_t xs, int64_t rows, const bf16* w, int64_t k,
                      const bf16* bias, bf16* out, int64_t os, int64_t begin, int64_t end) {
  constexpr int64_t kBlocks = 4, kRows = 4;
  const int64_t pairs = k / 2, block_elems = pairs * pdk::kGemvBlock * 2;
  for (int64_t b0 = begin; b0 < end; b0 += kBlocks) {
    const int64_t nb = std::min(kBlocks, end - b0);
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int64_t nr = std::min(kRows, rows - r0);
      __m512 acc[kRows][kBlocks];
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t j = 0; j < kBlocks; ++j) acc[r][j] = _mm512_setzero_ps();
      const bf16* wb = w + b0 * block_elems;
      for (int64_t p = 0; p < pairs; ++p) {
        __m512bh wv[kBlocks];
        for (int64_t j = 0; j < nb; ++j)
          wv[j] = (__m512bh)_mm512_loadu_si512(wb + j * block_elems + p * 32);
        for (int64_t r = 0; r < nr; ++r) {
          int32_t pair;
          std::memcpy(&pair, x + (r0 + r) * xs + 2 * p, sizeof pair);
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
          for (int64_t j = 0; j < nb; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
        }
      }
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t j = 0; j < nb; ++j) {
          const int64_t col = (b0 + j) * pdk::kGemvBlock;
          __m512 v = acc[r][j];
          if (bias != nullptr) v = _mm512_add_ps(v, load16(bias + col));
          alignas(64) float f[16];
          _mm512_store_ps(f, v);
          bf16* o = out + (r0 + r) * os + col;
          for (int i = 0; i < 16; ++i) store(o + i, f[i]);
        }
    }
  }
}
#endif

#if PDK_AMX
struct TileConfig {  // the AMX tile configuration (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// bf16 GEMM of up to a few dozen rows on AMX tiles, on the same packed weight: a packed
// column block's 16 K pairs are one 1 KB B tile (16 rows of 64 bytes, the VNNI layout
// tdpbf16ps takes), so the weight streams from memory once per 16 rows of x. Tiles 0-3
// hold the sums of 4 column blocks, tile 4 a 16-row x 32-column slice of x, 5 and 6 the
// weight. Faster than the vdpbf16ps kernel above at every row count (1.4x at 1 to 4 rows);
// that one takes a K that is not a multiple of 32.
inline void gemm_amx(const bf16* x, int64_t xs, int64_t rows, const bf16* w, int64_t k,
                     const bf16* bias, bf16* out, int64_t os, int64_t begin, int64_t end) {
  if (k % 32 != 0) {
    gemv_bf16(x, xs, rows, w, k, bias, out, os, begin, end);
    return;
  }
  const int64_t block_elems = k * pdk::kGemvBlock;  // (k / 2) pairs x 16 columns x 2
  alignas(64) float sums[4][16 * 16];
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t mr = std::min<int64_t>(16, rows - r0);
    TileConfig cfg;
    for (int t = 0; t < 5; ++t) cfg.rows[t] = static_cast<uint8_t>(mr), cfg.colsb[t] = 64;
    for (int t = 5; t < 7; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    const bf16* xr = x + r0 * xs;
    for (int64_t b0 = begin; b0 < end; b0 += 4) {
      const int64_t nb = std::min<int64_t>(4, end - b0);
      const bf16* wb = w + b0 * block_elems;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kc = 0; kc < k / 32; ++kc) {
        const bf16* wk = wb + kc * 512;  // 16 pairs x 16 columns x 2
        _tile_loadd(4, xr + kc * 32, xs * 2);
        _tile_loadd(5, wk, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nb > 1) {
          _tile_loadd(6, wk + block_elems, 64);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (nb > 2) {
          _tile_loadd(5, wk + 2 * block_elems, 64);
          _tile_dpbf16ps(2, 4, 5);
        }
        if (nb > 3) {
          _tile_loadd(6, wk + 3 * block_elems, 64);
          _tile_dpbf16ps(3, 4, 6);
        }
      }
      _tile_stored(0, sums[0], 64);
      if (nb > 1) _tile_stored(1, sums[1], 64);
      if (nb > 2) _tile_stored(2, sums[2], 64);
      if (nb > 3) _tile_stored(3, sums[3], 64);
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t col = (b0 + j) * pdk::kGemvBlock;
        const __m512 b = bias != nullptr ? load16(bias + col) : _mm512_setzero_ps();
        for (int64_t r = 0; r < mr; ++r) {
          alignas(64) float f[16];
          _mm512_store_ps(f, _mm512_add_ps(_mm512_load_ps(sums[j] + r * 16), b));
          bf16* o = out + (r0 + r) * os + col;
          for (int i = 0; i < 16; ++i) store(o + i, f[i]);
        }
      }
    }
  }
  _tile_release();
}
#endif

template <class T>
constexpr pdk::Ops<T> ops() {
  return {&rms_norm<T>, &add_rms_norm<T>, &rope<T>, &silu_mul<T>, &decode<T, T>,
          &decode<T, int8_t>};
}

// constexpr: no static initialiser runs code of this ISA when the module loads.
#if PDK_AMX
constexpr pdk::KernelTable table = {PDK_ISA_NAME, ops<float>(), ops<bf16>(), &gemm_amx,
                                    kAmxRows};
#elif PDK_BF16_DOT
constexpr pdk::KernelTable table = {PDK_ISA_NAME, ops<float>(), ops<bf16>(), &gemv_bf16,
                                    kGemvRows};
#else
constexpr pdk::KernelTable table = {PDK_ISA_NAME, ops<float>(), ops<bf16>(), nullptr, 0};
#endif

}  // namespace PDK_ISA
