"""The small pure pieces: block runs, config validation, control-message decoding."""

from __future__ import annotations

import msgpack
import pytest
import torch

from kv_transfer import CompatRecord, KVCompatibilityError, TransferConfig
from kv_transfer.blocks import as_bytes, block_runs, check_block_ids, copy_runs, dst_runs
from kv_transfer.transports.zmq_tcp import frame_slices
from kv_transfer.wire import ProtocolError, unpack


def test_block_runs_merge_blocks_consecutive_on_both_sides() -> None:
    assert block_runs([4, 5, 6, 9, 10, 2], [0, 1, 7, 8, 9, 3]) == [
        (4, 0, 2), (6, 7, 1), (9, 8, 2), (2, 3, 1)]
    assert block_runs([], []) == []


def test_dst_runs_checks_the_senders_split() -> None:
    assert dst_runs([0, 1, 7, 8, 9], [2, 3]) == [(0, 2), (7, 3)]
    with pytest.raises(ValueError, match="do not cover 5 blocks"):
        dst_runs([0, 1, 7, 8, 9], [2, 2])
    with pytest.raises(ValueError, match="not consecutive"):
        dst_runs([0, 1, 7, 8, 9], [3, 2])


def test_check_block_ids() -> None:
    assert check_block_ids(torch.tensor([3, 1]).tolist(), 4, "ids") == [3, 1]
    with pytest.raises(ValueError, match=r"ids: ids \[-1, 4\] are outside the pool of 4"):
        check_block_ids([-1, 2, 4], 4, "ids")


def test_frame_slices_cut_runs_at_the_frame_size() -> None:
    assert frame_slices([(10, 5), (40, 2)], 2) == [(10, 2), (12, 2), (14, 1), (40, 2)]


def test_copy_runs_moves_exactly_the_runs() -> None:
    src = torch.arange(6 * 4, dtype=torch.bfloat16).view(6, 4)
    dst = torch.zeros(6, 4, dtype=torch.bfloat16)
    copy_runs(dst, src, block_runs([0, 1, 4], [3, 4, 0]))
    assert torch.equal(dst[[3, 4, 0]], src[[0, 1, 4]])
    assert not dst[[1, 2, 5]].any()
    assert bytes(as_bytes(src[1])) == src[1].view(torch.uint8).numpy().tobytes()


def test_config_is_validated_where_built() -> None:
    with pytest.raises(ValueError, match="subset of"):
        TransferConfig(transports=("rdma",))
    with pytest.raises(ValueError, match="heartbeat_s must be > 0"):
        TransferConfig(heartbeat_s=0)
    with pytest.raises(ValueError, match="must exceed heartbeat_s"):
        TransferConfig(heartbeat_s=2, peer_timeout_s=1)


def test_malformed_peer_messages_are_rejected() -> None:
    with pytest.raises(ProtocolError):
        unpack(b"\xc1")
    with pytest.raises(ProtocolError, match="without op"):
        unpack(msgpack.packb([1, 2]))
    with pytest.raises(KVCompatibilityError, match="malformed compatibility record"):
        CompatRecord.from_dict({"model": "m"})
