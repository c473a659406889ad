"""The typed messages pdcluster's parts exchange, and nothing else.

- `messages`: router <-> worker commands and replies, one msgpack codec, and the
  `WorkerInfo` a worker reports when it starts;
- `kv`: the KV receiver's `KVPeerInfo` (inside `Prefill`), the caches' `CompatRecord`, and
  the `FirstToken` that rides with the KV from the prefill to the decode worker;
- `status`: a worker's pushed stats and the router's `Status` view of it;
- `timing`: the request path's clocks (the simulator waits as the cluster does);
- `serving`: the trace, SLO and latency summary the load generator and the planner share;
- `secure`: the internal sockets' CURVE keys;
- `worker_role`: the one interface a worker's role implements.

It imports nothing of pdcluster but the engine's public names (types for annotations, and
`SamplingParams` when `WireSamplingParams.to_params` runs, not at import), so the workers,
the router, the cluster, the planner and client-side tools (`bench`) all speak it without
importing each other.
"""

from protocol.kv import CompatRecord, FirstToken, KVPeerInfo
from protocol.messages import (
    Abort,
    Command,
    Failed,
    Generate,
    Prefill,
    Rejected,
    Reply,
    Reserved,
    Role,
    Stats,
    Step,
    TokenRecord,
    WireSamplingParams,
    WorkerInfo,
    WorkerMessage,
    attempt_id,
    decode_command,
    decode_reply,
    encode,
)
from protocol.status import Utilization, WorkerStats, WorkerStatus
from protocol.worker_role import WorkerRole

__all__ = [
    "Abort",
    "Command",
    "CompatRecord",
    "Failed",
    "FirstToken",
    "Generate",
    "KVPeerInfo",
    "Prefill",
    "Rejected",
    "Reply",
    "Reserved",
    "Role",
    "Stats",
    "Step",
    "TokenRecord",
    "Utilization",
    "WireSamplingParams",
    "WorkerInfo",
    "WorkerMessage",
    "WorkerRole",
    "WorkerStats",
    "WorkerStatus",
    "attempt_id",
    "decode_command",
    "decode_reply",
    "encode",
]
