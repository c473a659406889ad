// The Python module of the engine's CPU kernels: one build holds a variant per ISA
// (engine/kernels.py compiles them together), and `select_isa` picks the one this CPU runs.
namespace pdk {

const std::vector<const KernelTable*>& tables() {
  static const std::vector<const KernelTable*> all = {PDK_TABLES};
  return all;
}

const KernelTable* selected = tables().front();  // the baseline until select_isa

const KernelTable& active() { return *selected; }

void select_isa(const std::string& name) {
  for (const KernelTable* t : tables())
    if (name == t->name) {
      selected = t;
      return;
    }
  TORCH_CHECK(false, "no kernel variant named ", name);
}

std::vector<std::string> isas() {
  std::vector<std::string> names;
  for (const KernelTable* t : tables()) names.emplace_back(t->name);
  return names;
}

}  // namespace pdk

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention over KV pages read in place");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 or bfloat16 rows");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm of the sum");
  m.def("rope_", &rope_, "RoPE in place on the query and key heads of a qkv row block");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
  m.def("isas", &pdk::isas, "the ISA variants compiled in, baseline first");
  m.def("isa", [] { return std::string(pdk::active().name); }, "the variant in use");
  m.def("select_isa", &pdk::select_isa, "use the named variant (the CPU must run it)");
}
