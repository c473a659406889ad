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

bool request_amx() {
#if defined(__linux__) && defined(__x86_64__)
  // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): Linux hands out AMX state only on
  // request.
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  return false;
#endif
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
  m.def("pack_gemv", &pack_gemv, "a bf16 [N, K] weight laid out for gemv");
  m.def("gemv", &gemv, "few-row bf16 GEMM on a pack_gemv weight (AMX or vdpbf16ps)",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.def("gemv_rows", [] { return pdk::active().gemv_rows; },
        "rows up to which the variant's bf16 GEMV is the faster (0: it has none)");
  m.def("request_amx", &pdk::request_amx,
        "ask the kernel for AMX tile state (once per process); false where refused");
  m.def("isas", &pdk::isas, "the ISA variants compiled in, baseline first");
  m.def("isa", [] { return std::string(pdk::active().name); }, "the variant in use");
  m.def("select_isa", &pdk::select_isa, "use the named variant (the CPU must run it)");
}
