// The Python module of the engine's CPU kernels (one extension, built once per CPU).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor x, torch::Tensor weight,
                           double eps);
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_rotated,
           int64_t head_dim);
torch::Tensor silu_mul(torch::Tensor gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention over KV pages read in place");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm of the sum");
  m.def("rope_", &rope_, "RoPE in place on the query and key heads of a qkv row block");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
}
