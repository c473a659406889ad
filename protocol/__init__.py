"""The router <-> worker data-plane protocol: typed messages and their one msgpack codec.

It depends on nothing inside pdcluster, so the workers (`prefill_worker`, `decode_worker`,
`cluster.worker`), the cluster's router side (`cluster.backend`) and client-side tools
(`bench`) all speak it without importing each other.
"""

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
    WorkerMessage,
    decode_command,
    decode_reply,
    encode,
)
from protocol.worker_role import WorkerRole

__all__ = [
    "Abort",
    "Command",
    "Failed",
    "Generate",
    "Prefill",
    "Rejected",
    "Reply",
    "Reserved",
    "Role",
    "Stats",
    "Step",
    "TokenRecord",
    "WorkerMessage",
    "WorkerRole",
    "decode_command",
    "decode_reply",
    "encode",
]
