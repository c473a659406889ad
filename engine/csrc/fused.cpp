// The per-layer glue of a Llama decoder layer in one pass each over CPU float32 rows:
// RMSNorm (with the residual add before it), RoPE in place, SiLU(gate) * up. Between the
// matmuls these replace ~15 small torch ops per layer, each of which allocates and walks
// the activations once more.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace fused {  // named: the sources are compiled as one translation unit

constexpr int64_t kLanes = 8;  // independent partial sums: lets the compiler use SIMD

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat, name,
              " must be a CPU float32 tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, cols], rows contiguous");
}

// out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), Hugging Face's order of operations.
void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) part[l] += x[i + l] * x[i + l];
  float sq = 0.f;
  for (; i < n; ++i) sq += x[i] * x[i];
  for (int64_t l = 0; l < kLanes; ++l) sq += part[l];
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) out[j] = w[j] * (x[j] * inv);
}

}  // namespace fused

// RMSNorm of x [T, H] by weight [H] into a new tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  fused::check_rows(x, "x");
  weight = weight.contiguous();
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fused::norm_row(xp + r * xs, wp, op + r * n, n, eps);
  });
  return out;
}

// residual += x (in place), then RMSNorm of the sum into a new tensor.
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor x, torch::Tensor weight,
                           double eps) {
  fused::check_rows(residual, "residual");
  fused::check_rows(x, "x");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual and x must have one shape");
  weight = weight.contiguous();
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), rs = residual.stride(0), xs = x.stride(0);
  float* rp = residual.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = rp + r * rs;
      const float* add = xp + r * xs;
      for (int64_t j = 0; j < n; ++j) row[j] += add[j];
      fused::norm_row(row, wp, op + r * n, n, eps);
    }
  });
  return out;
}

// Rotates the first num_rotated heads of each row of qkv [T, (Hq + 2 Hkv) * D] in place
// (the query and key heads; the value heads follow them) by cos/sin [T, D]: Hugging Face's
// rotate-half convention, x * cos + rotate_half(x) * sin.
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_rotated,
           int64_t head_dim) {
  fused::check_rows(qkv, "qkv");
  fused::check_rows(cos, "cos");
  fused::check_rows(sin, "sin");
  TORCH_CHECK(cos.size(0) == qkv.size(0) && cos.size(1) == head_dim && head_dim % 2 == 0,
              "cos/sin must be [T, head_dim]");
  TORCH_CHECK(num_rotated * head_dim <= qkv.size(1), "more rotated heads than columns");
  const int64_t half = head_dim / 2, qs = qkv.stride(0), cs = cos.stride(0),
                ss = sin.stride(0);
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, qkv.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * cs;
      const float* s = sp + t * ss;
      for (int64_t h = 0; h < num_rotated; ++h) {
        float* x = qp + t * qs + h * head_dim;
        for (int64_t d = 0; d < half; ++d) {
          const float lo = x[d], hi = x[d + half];
          x[d] = lo * c[d] - hi * s[d];
          x[d + half] = hi * c[d + half] + lo * s[d + half];
        }
      }
    }
  });
}

// SiLU(gate) * up for gate_up [T, 2 I] (gate first) into a new [T, I] tensor.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  fused::check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t n = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = torch::empty({gate_up.size(0), n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, gate_up.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * gs;
      const float* u = g + n;
      float* o = op + r * n;
      for (int64_t j = 0; j < n; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
    }
  });
  return out;
}
