"""The serving defaults above the engine, the one place they are written, and the request
path's clocks: the router, the cluster, the CLI and the planner's simulator all read them
here (the simulator must wait exactly as the cluster does for its predictions to hold).
No imports, so reading them costs nothing. The engine's own are in `engine.defaults`."""

# Uncached prompts at most this long are prefilled on the decode worker itself: such a
# prompt costs the decode batch one short step, less than queueing behind long prompts on
# the prefill pool (`serve --local-prefill-threshold`).
LOCAL_PREFILL_THRESHOLD = 256
# Requests inside the cluster at once, and waiting in the router's queue beyond them.
MAX_RUNNING = 256
MAX_QUEUE = 1024
# How long a drained worker's requests may take to finish before they move elsewhere.
DRAIN_TIMEOUT_S = 30.0

# A worker pushes its `Stats` this often; placement reads the latest.
STATS_INTERVAL_S = 0.5
# A decode worker that `Rejected` a reservation (no free KV) is asked again after this.
RESERVE_RETRY_S = 0.05
# By default a request waits at most this long for decode KV to free up before it fails.
RESERVE_TIMEOUT_S = 60.0
