// The per-layer glue of a Llama decoder layer in one pass each over float32 or bfloat16
// rows: RMSNorm (with the residual add before it), RoPE in place, SiLU(gate) * up. Between
// the matmuls these replace ~15 small torch ops per layer, each of which allocates and
// walks the activations once more. The work is the active ISA variant's (module.cpp).
namespace pdk {

const KernelTable& active();

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kFloat ||
                                      t.scalar_type() == torch::kBFloat16),
              name, " must be a CPU float32 or bfloat16 tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, cols], rows contiguous");
}

void check_same_dtype(const torch::Tensor& a, const torch::Tensor& b, const char* name) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), name, " must be of the input's dtype");
}

template <class T>
T* ptr(const torch::Tensor& t) {
  if constexpr (std::is_same_v<T, bf16>)
    return reinterpret_cast<bf16*>(t.data_ptr<at::BFloat16>());
  else
    return t.data_ptr<T>();
}

// Runs f(ops, type tag) with the active variant's kernels for t's dtype.
template <class F>
void dispatch(const torch::Tensor& t, F&& f) {
  if (t.scalar_type() == torch::kFloat)
    f(active().f32, float{});
  else
    f(active().b16, bf16{});
}

}  // namespace pdk

// RMSNorm of x [T, H] by weight [H] into a new tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  pdk::check_rows(x, "x");
  pdk::check_same_dtype(x, weight, "weight");
  weight = weight.contiguous();
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  pdk::dispatch(x, [&](const auto& ops, auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      ops.rms_norm(pdk::ptr<T>(x), x.stride(0), pdk::ptr<T>(weight), pdk::ptr<T>(out),
                   x.size(1), static_cast<float>(eps), begin, end);
    });
  });
  return out;
}

// residual += x (in place), then RMSNorm of the sum into a new tensor.
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor x, torch::Tensor weight,
                           double eps) {
  pdk::check_rows(residual, "residual");
  pdk::check_rows(x, "x");
  pdk::check_same_dtype(residual, x, "x");
  pdk::check_same_dtype(residual, weight, "weight");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual and x must have one shape");
  weight = weight.contiguous();
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  pdk::dispatch(x, [&](const auto& ops, auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      ops.add_rms_norm(pdk::ptr<T>(residual), residual.stride(0), pdk::ptr<T>(x),
                       x.stride(0), pdk::ptr<T>(weight), pdk::ptr<T>(out), x.size(1),
                       static_cast<float>(eps), begin, end);
    });
  });
  return out;
}

// Rotates the first num_rotated heads of each row of qkv [T, (Hq + 2 Hkv) * D] in place
// (the query and key heads; the value heads follow them) by cos/sin [T, D]: Hugging Face's
// rotate-half convention, x * cos + rotate_half(x) * sin.
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_rotated,
           int64_t head_dim) {
  pdk::check_rows(qkv, "qkv");
  pdk::check_rows(cos, "cos");
  pdk::check_rows(sin, "sin");
  pdk::check_same_dtype(qkv, cos, "cos");
  pdk::check_same_dtype(qkv, sin, "sin");
  TORCH_CHECK(cos.size(0) == qkv.size(0) && cos.size(1) == head_dim && head_dim % 2 == 0,
              "cos/sin must be [T, head_dim]");
  TORCH_CHECK(num_rotated * head_dim <= qkv.size(1), "more rotated heads than columns");
  pdk::dispatch(qkv, [&](const auto& ops, auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, qkv.size(0), 16, [&](int64_t begin, int64_t end) {
      ops.rope(pdk::ptr<T>(qkv), qkv.stride(0), pdk::ptr<T>(cos), cos.stride(0),
               pdk::ptr<T>(sin), sin.stride(0), num_rotated, head_dim, begin, end);
    });
  });
}

// SiLU(gate) * up for gate_up [T, 2 I] (gate first) into a new [T, I] tensor.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  pdk::check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t n = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), n}, gate_up.options());
  pdk::dispatch(gate_up, [&](const auto& ops, auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, gate_up.size(0), 16, [&](int64_t begin, int64_t end) {
      ops.silu_mul(pdk::ptr<T>(gate_up), gate_up.stride(0), pdk::ptr<T>(out), n, begin, end);
    });
  });
  return out;
}

// A bf16 weight [N, K] packed for `gemv` (pdk::kGemvBlock): [N / 16, K / 2, 16, 2].
torch::Tensor pack_gemv(torch::Tensor weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kBFloat16 &&
              weight.dim() == 2, "weight must be a CPU bfloat16 [N, K] tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % pdk::kGemvBlock == 0 && k % 2 == 0, "N must be a multiple of ",
              pdk::kGemvBlock, " and K even, got [", n, ", ", k, "]");
  return weight.reshape({n / pdk::kGemvBlock, pdk::kGemvBlock, k / 2, 2})
      .permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bf16 times a weight packed by `pack_gemv` (+ bias [N]) -> [M, N] bf16, on the
// active variant's vdpbf16ps or AMX kernel (`gemv_rows`), the column blocks split over
// threads.
torch::Tensor gemv(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias) {
  // The input is checked first, so a bad call gets the same answer on every CPU.
  pdk::check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16 &&
              packed.dim() == 4 && packed.is_contiguous() && packed.size(1) * 2 == x.size(1),
              "x must be bfloat16 [M, K] and packed a pack_gemv weight of K columns");
  const auto kernel = pdk::active().gemv_bf16;
  TORCH_CHECK(kernel != nullptr, "the ", pdk::active().name, " kernels have no bf16 GEMV");
  const int64_t blocks = packed.size(0), n = blocks * pdk::kGemvBlock;
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kBFloat16 && b.numel() == n, "bias must be bf16 [N]");
  }
  auto out = torch::empty({x.size(0), n}, x.options());
  // Blocks of 4 (the kernel's unit), split evenly over the threads.
  at::parallel_for(0, (blocks + 3) / 4, 1, [&](int64_t begin, int64_t end) {
    kernel(pdk::ptr<pdk::bf16>(x), x.stride(0), x.size(0), pdk::ptr<pdk::bf16>(packed),
           x.size(1), b.defined() ? pdk::ptr<pdk::bf16>(b) : nullptr, pdk::ptr<pdk::bf16>(out),
           n, begin * 4, std::min(end * 4, blocks));
  });
  return out;
}
