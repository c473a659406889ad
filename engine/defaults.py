"""The engine's defaults, the one place they are written: `CacheConfig` and
`SchedulerConfig` take them, and so do the CLI, the workers, the simulator and the
autoscaler. No imports, so reading them costs nothing."""

BLOCK_SIZE = 16  # tokens per KV block
KV_CACHE_GB = 1.0  # KV pool budget per worker
MAX_NUM_BATCHED_TOKENS = 2048  # token budget of one step
MAX_NUM_SEQS = 64  # most requests running at once
DTYPE = "float32"  # the exact reference on CPU
GPU_MEMORY_UTILIZATION = 0.9  # share of a GPU a worker may hold (weights + KV), as vLLM
# Where a tensor-parallel engine's ranks keep their KV heads (`LLMEngine(tp_kv_pages=)`).
TP_KV_PAGES = ("auto", "shared", "private")
