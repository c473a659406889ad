"""Tensor parallelism inside one engine (vLLM's `tensor_parallel_size`): N ranks in one
torch.distributed group, each holding 1/N of every layer as Megatron splits them, running
every forward in lock-step.

Rank 0 is the engine's own process: it schedules and samples, once, and runs its shard.
Ranks 1..N-1 are child processes it starts (multiprocessing: the shape of vLLM's
multiprocessing executor, which also works inside a Ray actor), forked from a forkserver
that imported this module once, so a follower starts in a fraction of a second instead of
importing torch again (the server has started no threads and touched no GPU). Before
each forward rank 0 broadcasts its inputs over the group (`TensorParallelModel`, below
`ModelRunner`, so nothing above the model knows); every rank then runs the same forward
on its shard, with an all-reduce after each row-parallel matmul and the LM head's logits
gathered to rank 0.

What each rank holds (`shard_state`):

- `qkv_proj` split by heads: its `num_heads / N` query heads and `num_kv_heads / N` KV
  heads; with fewer KV heads than ranks (N a multiple of them) the KV head its query heads
  use, replicated. q/k norms (Qwen3) are per head and so apply to the local heads as is.
- `o_proj` and `down_proj` (dense, and each expert's) split by input columns, their
  partial outputs summed by one all-reduce each; a row-parallel bias only on rank 0.
- `gate_up_proj` (dense, and each expert's) split by output rows, the gate and the up half
  alike, so SiLU(gate) * up stays local; an MoE router is replicated and the block's
  output is all-reduced once.
- The embedding and the LM head split by vocabulary rows, `ceil(vocab / N)` each, the last
  padded with zero rows (as vLLM pads; no vocabulary size is refused): a masked lookup
  plus an all-reduce, and each rank's logits gathered to rank 0 and the padding dropped.
  A tied head shares the embedding's shard.
- Norms replicated. KV pages: the local KV heads of every block; block ids are rank 0's
  (its scheduler's allocator is the only one). A KV transport moves the pool of every
  head, so a worker whose KV moves keeps one: on CPU the ranks' pages are slices of one
  pool in shared memory that every rank maps (`shared` pages); with `private` pages (each
  rank's heads in its own memory: one GPU a rank) rank 0 keeps a mirror of every rank's
  heads (`KVMirror`): one gather a layer after each forward's KV writes, one scatter of
  the blocks a transport wrote before they are read.

gloo on CPU, NCCL on CUDA, through the same code. Only gloo has run (this project's
machines have no GPU): the NCCL path (one GPU per rank, `cuda:<i + rank>`) is written but
untested, and NCCL reports a dead peer through its watchdog's timeout rather than at once.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_any
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from threadpoolctl import threadpool_limits
from torch import nn

from engine.attention import AttentionBackend, BatchLayout
from engine.config import ModelConfig
from engine.kv_cache import KVCache

log = logging.getLogger(__name__)

# Rank 0 fails a step whose collective waits longer than this for a follower: one layer's
# share of the largest step, with room to spare. A follower that dies is seen at once
# (gloo's connection to it closes; its exit is checked before each step).
COLLECTIVE_TIMEOUT_S = 300.0
# Bounds on a follower's start (import, join, load its shard); one that exits is seen at once.
START_TIMEOUT_S = 1800.0
# Followers wait for rank 0's next step with no practical bound: an engine may idle for
# days. Should rank 0 die, its connections close (and a watcher thread ends the follower).
_FOLLOWER_TIMEOUT = timedelta(days=365)
_STOP_TIMEOUT = timedelta(seconds=10)
_POLL_S = 0.02
_HOST = "127.0.0.1"  # every rank runs on this machine
_HEADER = 8  # int64 fields of each message's header


class TensorParallelError(RuntimeError):
    """A rank died, a collective failed, or a follower could not start: the group cannot
    compute any more (each forward needs every shard)."""


# ---- what each rank holds ---------------------------------------------------------------


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Refuse a size the model's dimensions do not split into.

    Raises:
        ValueError: naming the dimension `size` does not divide.
    """
    if size == 1:
        return
    split = [("num_attention_heads", cfg.num_heads)]
    if any(i not in cfg.moe_layers for i in range(cfg.num_layers)):
        split.append(("intermediate_size", cfg.intermediate_size))
    if cfg.moe_layers:
        split.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    for name, value in split:
        if value % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide {name} ({value}): "
                             f"each rank computes an equal share of it")
    kv = cfg.num_kv_heads
    if (kv % size if kv >= size else size % kv):
        raise ValueError(f"tensor_parallel_size {size} does not divide num_key_value_heads "
                         f"({kv}), nor is it a multiple of them (fewer KV heads than ranks "
                         f"are replicated, each rank holding the one its query heads use)")


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shapes of one rank's layers: its query heads, KV heads and intermediate sizes
    (the vocabulary, hidden size and experts' count stay the model's)."""
    if size == 1:
        return cfg
    return replace(cfg, num_heads=cfg.num_heads // size,
                   num_kv_heads=max(cfg.num_kv_heads // size, 1),
                   intermediate_size=cfg.intermediate_size // size,
                   moe_intermediate_size=cfg.moe_intermediate_size // size)


def vocab_shard_rows(vocab_size: int, size: int) -> int:
    """Rows of each rank's shard of the embedding and LM head (the last one padded)."""
    return math.ceil(vocab_size / size)


def kv_heads(cfg: ModelConfig, rank: int, size: int) -> range:
    """The KV heads rank `rank` holds: its own share, or (fewer KV heads than ranks) the
    one its query heads read."""
    if cfg.num_kv_heads >= size:
        n = cfg.num_kv_heads // size
        return range(rank * n, (rank + 1) * n)
    first = rank * (cfg.num_heads // size) // (cfg.num_heads // cfg.num_kv_heads)
    return range(first, first + 1)


def shard_state(state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int,
                size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slices of full tensors in the engine's names (as
    `engine.model_loader._fused` yields them).

    Each slice is a copy, so the full tensors can be freed once every slice is taken.
    """
    if size == 1:
        return state
    d = cfg.head_dim
    q_heads = cfg.num_heads // size
    q_rows = _rows(rank * q_heads * d, q_heads * d)
    kv = kv_heads(cfg, rank, size)
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    k_rows = _rows(q_size + kv.start * d, len(kv) * d)
    v_rows = _rows(q_size + kv_size + kv.start * d, len(kv) * d)
    vocab_rows = vocab_shard_rows(cfg.vocab_size, size)
    out = {}
    for name, t in state.items():
        if name in ("embed_tokens.weight", "lm_head.weight"):
            out[name] = _padded_rows(t, rank * vocab_rows, vocab_rows)
        elif name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            out[name] = torch.cat([t[q_rows], t[k_rows], t[v_rows]])
        elif name.endswith("o_proj.weight"):
            out[name] = t[:, q_rows].contiguous()
        elif name.endswith("o_proj.bias"):  # added once: rank 0's partial sum carries it
            out[name] = t.clone() if rank == 0 else torch.zeros_like(t)
        elif name.endswith("gate_up_proj.weight"):
            inter = t.shape[0] // 2 // size  # this rank's share of the gate and of the up
            gate, up = _rows(rank * inter, inter), _rows(t.shape[0] // 2 + rank * inter, inter)
            out[name] = torch.cat([t[gate], t[up]])
        elif name.endswith("down_proj.weight"):
            inter = t.shape[1] // size
            out[name] = t[:, _rows(rank * inter, inter)].contiguous()
        else:  # norms, an MoE router: replicated
            out[name] = t
    return out


def _rows(start: int, n: int) -> slice:
    return slice(start, start + n)


def _padded_rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Rows `start` to `start + n` of `t`, zero rows past its end."""
    out = t.new_zeros(n, *t.shape[1:])
    part = t[start:start + n]
    out[:len(part)] = part
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters (on one rank: its shard)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---- the collectives (every rank) -------------------------------------------------------


class ParallelGroup:
    """One rank's end of the tensor-parallel group: the collectives its shard needs.

    Args:
        group: the torch.distributed process group (gloo or NCCL).
        rank: this rank.
        size: ranks in the group.
        device: this rank's device.
    """

    def __init__(self, group: Any, rank: int, size: int, device: torch.device) -> None:
        self._group = group
        self.rank = rank
        self.size = size
        self.device = device

    @classmethod
    def join(cls, store: dist.Store, rank: int, size: int, device: torch.device,
             timeout: timedelta) -> ParallelGroup:
        """Join the group through `store`; returns once every rank has joined.

        Args:
            store: the rendezvous store rank 0 hosts.
            rank: this rank.
            size: ranks in the group.
            device: this rank's device (CUDA: NCCL, otherwise gloo).
            timeout: the bound on joining and on every collective of this rank.
        """
        store = dist.PrefixStore("tp", store)
        if device.type == "cuda":  # untested: no GPU on this project's machines
            torch.cuda.set_device(device)
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = timeout
            return cls(dist.ProcessGroupNCCL(store, rank, size, nccl), rank, size, device)
        # The private options are what init_process_group uses too; they pin the loopback
        # interface (every rank is on this machine) rather than trust the hostname.
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_HOST)]
        opts._timeout = timeout
        return cls(dist.ProcessGroupGloo(store, rank, size, opts), rank, size, device)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `t` (in place where `t` is contiguous)."""
        t = t.contiguous()
        self._group.allreduce([t]).wait()
        return t

    def broadcast(self, t: torch.Tensor, timeout: timedelta | None = None) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (same shape and dtype everywhere)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if timeout is not None:
            opts.timeout = timeout
        self._group.broadcast([t], opts).wait()
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape and dtype everywhere) on rank 0, in rank order; the
        other ranks get `[t]`."""
        t = t.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else []
        self._group.gather([parts] if parts else [], [t], opts).wait()
        return parts or [t]

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `[N, C]` side by side on rank 0, `[N, size * C]` in rank order;
        the other ranks get their own `t` back."""
        return torch.cat(self.gather(t), dim=-1)

    def scatter(self, parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Rank 0's `parts[r]` into rank r's `out` (rank 0 passes one part a rank, the
        others none; every part shaped as `out`)."""
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        inputs = [[part.contiguous() for part in parts]] if self.rank == 0 else []
        self._group.scatter([out], inputs, opts).wait()
        return out


def vocab_parallel_embedding(input_ids: torch.Tensor, weight: torch.Tensor,
                             group: ParallelGroup) -> torch.Tensor:
    """Embeddings `[T, hidden]` from each rank's rows of the table: a rank looks up the ids
    in its slice, zeros for the others', and the sum over ranks has every row once."""
    start = group.rank * weight.shape[0]
    local = input_ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    x = F.embedding(local.masked_fill(outside, 0), weight)
    return group.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


def gather_logits(logits: torch.Tensor, group: ParallelGroup, vocab_size: int) -> torch.Tensor:
    """Each rank's `[N, vocab / size]` logits as rank 0's `[N, vocab]` (the padding rows of
    the last shard dropped); the other ranks get theirs back."""
    full = group.gather_columns(logits)
    if group.rank != 0 or full.shape[-1] == vocab_size:
        return full
    return full[:, :vocab_size].contiguous()


# ---- rank 0 ------------------------------------------------------------------------------


class ShardBuilder(Protocol):
    """How a rank builds its shard and its KV pages (the engine's; sent to each follower,
    so it must pickle)."""

    def load(self, group: ParallelGroup) -> nn.Module:
        """The rank's shard of the model, its collectives through `group`."""

    def num_blocks(self, device: torch.device) -> int:
        """The KV blocks this rank's budget holds."""

    def pages(self, num_blocks: int, device: torch.device, rank: int,
              shared: tuple[int, int, int] | None) -> tuple[KVCache, AttentionBackend]:
        """The rank's KV pages (its KV heads of `num_blocks` blocks) and attention backend;
        with `shared` (rank 0's `SharedPages`: pid, descriptor, bytes), its heads' slice of
        the pool of every head there."""


class _Message(enum.IntEnum):
    """What rank 0 broadcasts next; header fields after the kind:
    START num_blocks, shared pool's pid, descriptor (-1: none), bytes, mirrored (0/1) |
    FORWARD tokens, seqs, table width, prefills, layers (-1: all), block size | LOGITS rows,
    hidden | SCATTER blocks | STOP."""

    START = 1
    FORWARD = 2
    LOGITS = 3
    STOP = 4
    SCATTER = 5


class KVMirror:
    """Rank 0's copy of every rank's KV heads when each rank's pages are its own
    (`private` pages): the pool of the whole model that a KV transport reads and writes.
    Every rank holds one and calls it in the same order: `copy_out` after each layer's
    attention, `scatter` when rank 0 says so.

    Args:
        group: the tensor-parallel group.
        pages: this rank's pages (its KV heads).
        whole: the pool of every head (rank 0), or None (the other ranks).
        heads: per rank, the KV heads its pages hold.
    """

    def __init__(self, group: ParallelGroup, pages: KVCache, whole: KVCache | None,
                 heads: list[range]) -> None:
        self.group = group
        self.pages = pages
        self.whole = whole
        self.heads = heads
        self._layer_of = {layer.data_ptr(): i for i, layer in enumerate(pages.layers)}

    def copy_out(self, kv_layer: torch.Tensor, slots: torch.Tensor) -> None:
        """The rows this step wrote into `kv_layer` (one of `pages`' layers, at `slots`),
        every rank's, into the same rows of the whole pool: one gather."""
        bs = self.pages.block_size
        blocks, offsets = slots // bs, slots % bs
        parts = self.group.gather(kv_layer[blocks, :, offsets])  # [T, 2, heads, D] each
        if self.whole is None:
            return
        whole = self.whole.layers[self._layer_of[kv_layer.data_ptr()]]
        for heads, part in zip(self.heads, parts, strict=True):
            whole[blocks, :, offsets, heads.start:heads.stop] = part

    def scatter(self, block_ids: torch.Tensor) -> None:
        """Blocks `block_ids` of the whole pool (written there by a transport) into every
        rank's pages, each rank its heads of every layer: one scatter."""
        pages = self.pages.buffer
        out = torch.empty((pages.shape[0], len(block_ids), *pages.shape[2:]),
                          dtype=pages.dtype, device=pages.device)
        parts = [] if self.whole is None else [
            self.whole.buffer[:, block_ids, :, :, heads.start:heads.stop]
            for heads in self.heads]
        pages[:, block_ids] = self.group.scatter(parts, out)


class MirroredAttention(AttentionBackend):
    """A rank's attention backend with private pages mirrored on rank 0: the inner
    backend's, then `KVMirror.copy_out` of the rows the layer wrote."""

    def __init__(self, inner: AttentionBackend, mirror: KVMirror) -> None:
        self.inner = inner
        self.name = inner.name
        self.mirror = mirror
        self._slots: torch.Tensor | None = None

    def begin_step(self, layout: BatchLayout) -> None:
        self._slots = layout.slot_mapping
        self.inner.begin_step(layout)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor) -> torch.Tensor:
        out = self.inner.forward(q, k, v, kv_layer)
        self.mirror.copy_out(kv_layer, self._slots)
        return out


class TensorParallelAttention(AttentionBackend):
    """Rank 0's attention backend: the engine's, keeping each step's layout so the forward
    that follows can send it to the followers."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.layout: BatchLayout | None = None

    def begin_step(self, layout: BatchLayout) -> None:
        self.layout = layout
        self.inner.begin_step(layout)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor) -> torch.Tensor:
        return self.inner.forward(q, k, v, kv_layer)


class Followers:
    """Rank 0's handle on ranks 1..N-1: starts them, sends each forward's inputs, sees one
    die, stops them. Use `Followers.start`.

    Args:
        size: ranks in the group, rank 0 included.
        builder: how each follower builds its shard and pages.
        device: rank 0's device.
        num_threads: compute threads per follower (None: torch's default).
    """

    def __init__(self, size: int, builder: ShardBuilder, device: torch.device,
                 num_threads: int | None) -> None:
        self.size = size
        self.device = device
        self.group: ParallelGroup | None = None
        self.dead: str | None = None  # why the group cannot compute any more
        self._header = torch.zeros(_HEADER, dtype=torch.long, device=device)
        self._store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=START_TIMEOUT_S))
        ctx = multiprocessing.get_context("forkserver")
        # This module and the builder's, imported once in the server before it forks any
        # follower (a preload set after the server started, e.g. by another user of the
        # forkserver, is ignored: each follower then imports what it needs itself).
        ctx.set_forkserver_preload([__name__, type(builder).__module__])
        self.procs = [ctx.Process(target=_follower_main, name=f"tp-rank-{rank}", daemon=True,
                                  args=(rank, size, self._store.port, rank_device(device, rank),
                                        num_threads, builder))
                      for rank in range(1, size)]
        # Should the engine be dropped without `stop`, its followers go with it.
        self._finalizer = weakref.finalize(self, _kill, self.procs)
        for proc in self.procs:
            proc.start()

    @property
    def pids(self) -> list[int]:
        """The followers' process ids, rank 1 first."""
        return [proc.pid for proc in self.procs]

    @property
    def exitcodes(self) -> list[int | None]:
        """The followers' exit codes (None: running; -N: killed by signal N)."""
        return [proc.exitcode for proc in self.procs]

    @classmethod
    def start(cls, size: int, builder: ShardBuilder, device: torch.device,
              num_threads: int | None) -> Followers:
        """Start ranks 1..`size`-1 and join the group with them.

        Raises:
            TensorParallelError: a follower exited or did not join in time (it is named).
        """
        followers = cls(size, builder, device, num_threads)
        try:
            followers._wait_for("joining", START_TIMEOUT_S)
            followers.group = ParallelGroup.join(
                followers._store, 0, size, device, timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        except BaseException:
            followers.stop()
            raise
        log.info("tensor parallel: %d ranks, followers %s", size, followers.pids)
        return followers

    def wait_ready(self) -> list[tuple[int, int]]:
        """Wait until every follower has loaded its shard.

        Returns:
            Per follower: the KV blocks its budget holds, and its weights' bytes.

        Raises:
            TensorParallelError: a follower failed to load (its error is in the message).
        """
        return [tuple(json.loads(value)) for value in self._wait_for("ready", START_TIMEOUT_S)]

    def begin(self, num_blocks: int, pid: int = 0, fd: int = -1, nbytes: int = 0,
              mirrored: bool = False) -> None:
        """Tell the followers the pool's size: each allocates its pages (or, given rank 0's
        `SharedPages` as `pid`, `fd`, `nbytes`, maps the pool of every head there and
        takes its heads' slice; `mirrored`: its private pages mirrored on rank 0,
        `KVMirror`) and waits for steps."""
        with self.step():
            self._send_header(_Message.START, num_blocks, pid, fd, nbytes, int(mirrored))

    def scatter(self, mirror: KVMirror, block_ids: list[int]) -> None:
        """`KVMirror.scatter` of `block_ids` on every rank.

        Raises:
            TensorParallelError: the group is (now) dead.
        """
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        with self.step():
            self._send_header(_Message.SCATTER, len(ids))
            mirror.scatter(self.group.broadcast(ids))

    def send_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     layout: BatchLayout, num_layers: int | None) -> None:
        """Broadcast one forward's inputs: a header, then its int64 tensors in one piece."""
        tables = layout.block_tables
        self._send_header(_Message.FORWARD, len(input_ids), len(layout.query_lens),
                          tables.shape[1], layout.num_prefills,
                          -1 if num_layers is None else num_layers, layout.block_size)
        lens = torch.tensor([*layout.query_lens, *layout.context_lens], device=self.device)
        self.group.broadcast(torch.cat([input_ids, positions, lens, tables.flatten(),
                                        layout.slot_mapping]))

    def send_logits(self, hidden: torch.Tensor) -> None:
        """Broadcast the hidden states the LM head takes next, `[rows, hidden]`."""
        self._send_header(_Message.LOGITS, *hidden.shape)
        self.group.broadcast(hidden.contiguous())

    def _send_header(self, kind: _Message, *fields: int) -> None:
        values = [int(kind), *fields]
        self._header.copy_(torch.tensor(values + [0] * (_HEADER - len(values))))
        self.group.broadcast(self._header)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Run one exchange with the followers: refused once the group is dead; any failure
        inside (a follower dying, a collective timing out, an error on rank 0 part-way,
        which leaves the followers waiting in a collective) ends the group: the followers
        are stopped and TensorParallelError says why.

        Raises:
            TensorParallelError: the group is (now) dead.
        """
        if self.dead is None and any(proc.exitcode is not None for proc in self.procs):
            raise self._fail(None)
        if self.dead is not None:
            raise TensorParallelError(self.dead)
        try:
            yield
        except Exception as e:
            raise self._fail(e) from e
        except BaseException:  # KeyboardInterrupt part-way: the followers are out of step
            self._fail(None)
            raise

    def _fail(self, cause: Exception | None, starting: bool = False) -> TensorParallelError:
        """Mark the group dead, stop the followers, and say why."""
        # A peer's closed connection can reach us a moment before its exit status does.
        deadline = time.monotonic() + 2.0
        while cause is not None and time.monotonic() < deadline and \
                all(proc.exitcode is None for proc in self.procs):
            time.sleep(_POLL_S)
        exited = [self._describe_exit(rank, proc) for rank, proc in enumerate(self.procs, 1)
                  if proc.exitcode is not None]
        why = "; ".join(exited) if exited else f"a collective failed: {cause}"
        self.dead = f"tensor-parallel group of {self.size} ranks is down: {why}; " + (
            "the engine cannot start" if starting else
            "every forward needs each rank's shard, so this engine cannot go on")
        log.error("%s", self.dead)
        self._kill_followers()
        return TensorParallelError(self.dead)

    def _describe_exit(self, rank: int, proc: multiprocessing.process.BaseProcess) -> str:
        code = proc.exitcode
        if code is not None and code < 0:
            return f"rank {rank} (pid {proc.pid}) was killed by {signal.Signals(-code).name}"
        error = self._error_of(rank)
        return f"rank {rank} (pid {proc.pid}) exited with code {code}" + (
            f": {error}" if error else " (its traceback is on its stderr)")

    def _error_of(self, rank: int) -> str | None:
        key = f"error/{rank}"
        try:
            return self._store.get(key).decode() if self._store.check([key]) else None
        except RuntimeError:
            return None

    def _wait_for(self, stage: str, timeout_s: float) -> list[bytes]:
        """Every follower's `stage/<rank>` key, watching them exit meanwhile."""
        keys = [f"{stage}/{rank}" for rank in range(1, self.size)]
        deadline = time.monotonic() + timeout_s
        while not self._store.check(keys):
            if any(proc.exitcode is not None for proc in self.procs):
                raise self._fail(None, starting=True)
            if time.monotonic() > deadline:
                raise self._fail(TimeoutError(f"followers not {stage} after {timeout_s:g} s"),
                                 starting=True)
            time.sleep(_POLL_S)
        return [self._store.get(key) for key in keys]

    def stop(self) -> None:
        """Stop the followers and wait for them (idempotent): a STOP message where the
        group still works, then SIGKILL for any still running after a few seconds."""
        if self.group is not None and self.dead is None and \
                all(proc.is_alive() for proc in self.procs):
            try:
                self._header.copy_(torch.tensor([int(_Message.STOP)] + [0] * (_HEADER - 1)))
                self.group.broadcast(self._header, _STOP_TIMEOUT)
            except RuntimeError as e:
                log.warning("tensor parallel: stopping the followers: %s", e)
            for proc in self.procs:
                proc.join(_STOP_TIMEOUT.total_seconds())
        self.dead = self.dead or "the tensor-parallel group was stopped"
        self._kill_followers()
        self.group = None

    def _kill_followers(self) -> None:
        self._finalizer()


def _kill(procs: list[multiprocessing.process.BaseProcess]) -> None:
    started = [proc for proc in procs if proc.pid is not None]
    for proc in started:
        if proc.is_alive():
            proc.kill()
    for proc in started:
        proc.join(5.0)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device when rank 0 is on `device`: the same CPU, or the CUDA device
    `rank` places after rank 0's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class TensorParallelModel(nn.Module):
    """Rank 0's model: its shard, called as `ModelRunner` calls a model; each call first
    sends the followers what they need to make the same call on theirs.

    The forward's `attn` must be the `TensorParallelAttention` whose `begin_step` took the
    step's layout. `layer_hook` runs here only (on rank 0).

    Args:
        shard: rank 0's shard of the model.
        followers: the other ranks.
    """

    def __init__(self, shard: nn.Module, followers: Followers) -> None:
        super().__init__()
        self.shard = shard
        self.cfg = shard.cfg
        self.followers = followers

    @property
    def layers(self) -> nn.ModuleList:
        return self.shard.layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                attn: TensorParallelAttention, layer_hook: Any = None,
                num_layers: int | None = None) -> torch.Tensor:
        with self.followers.step():
            self.followers.send_forward(input_ids, positions, attn.layout, num_layers)
            return self.shard(input_ids, positions, kv_cache, attn, layer_hook, num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The runner picks the rows before this call, so the rows themselves are sent
        # (`[rows, hidden]`: a few KB at decode) rather than their indices.
        with self.followers.step():
            self.followers.send_logits(hidden)
            return self.shard.compute_logits(hidden)


# ---- ranks 1..N-1 ------------------------------------------------------------------------


def _follower_main(rank: int, size: int, port: int, device: torch.device,
                   num_threads: int | None, builder: ShardBuilder) -> None:
    """A follower's life: join, load its shard, report, then run what rank 0 sends until
    STOP. A failure is written to the store for rank 0 to report, and ends the process."""
    _exit_with_parent()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
        threadpool_limits(num_threads, user_api="blas")
    store = dist.TCPStore(_HOST, port, is_master=False,
                          timeout=timedelta(seconds=START_TIMEOUT_S))
    try:
        store.set(f"joining/{rank}", "1")
        group = ParallelGroup.join(store, rank, size, device, _FOLLOWER_TIMEOUT)
        model = builder.load(group)
        store.set(f"ready/{rank}", json.dumps([builder.num_blocks(device),
                                               weight_bytes(model)]))
        _serve(group, model, builder)
    except Exception as e:
        log.exception("tensor-parallel rank %d failed", rank)
        with contextlib.suppress(Exception):  # rank 0 (the store's host) may be gone
            store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        _exit(1)
    _exit(0)


def _exit(code: int) -> None:
    """End a follower now: it holds nothing to tidy (its sockets close with it), and an
    interpreter's teardown of torch and gloo takes most of a second."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_parent() -> None:
    """End this process when rank 0's process ends, whatever it was doing."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait_for_any([parent.sentinel])
        os._exit(1)
    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


@torch.inference_mode()
def _serve(group: ParallelGroup, model: nn.Module, builder: ShardBuilder) -> None:
    """Run rank 0's messages in order until STOP."""
    header = torch.zeros(_HEADER, dtype=torch.long, device=group.device)
    dtype = next(model.parameters()).dtype
    kv_cache: KVCache | None = None
    attn: AttentionBackend | None = None
    mirror: KVMirror | None = None
    while True:
        kind, *fields = group.broadcast(header).tolist()
        if kind == _Message.STOP:
            return
        if kind == _Message.START:
            num_blocks, pid, fd, nbytes, mirrored = fields[:5]
            kv_cache, attn = builder.pages(num_blocks, group.device, group.rank,
                                           None if fd < 0 else (pid, fd, nbytes))
            if mirrored:
                mirror = KVMirror(group, kv_cache, None, [])
                attn = MirroredAttention(attn, mirror)
        elif kind == _Message.SCATTER:
            ids = torch.empty(fields[0], dtype=torch.long, device=group.device)
            mirror.scatter(group.broadcast(ids))
        elif kind == _Message.FORWARD:
            input_ids, positions, layout, num_layers = _receive_forward(group, fields)
            attn.begin_step(layout)
            model(input_ids, positions, kv_cache, attn, None, num_layers)
        elif kind == _Message.LOGITS:
            hidden = torch.empty(fields[0], fields[1], dtype=dtype, device=group.device)
            model.compute_logits(group.broadcast(hidden))
        else:
            raise TensorParallelError(f"unknown message {kind} from rank 0")


def _receive_forward(group: ParallelGroup, fields: list[int]
                     ) -> tuple[torch.Tensor, torch.Tensor, BatchLayout, int | None]:
    """The inputs `Followers.send_forward` sent."""
    num_tokens, num_seqs, width, num_prefills, num_layers, block_size = fields[:6]
    data = torch.empty(3 * num_tokens + (2 + width) * num_seqs, dtype=torch.long,
                       device=group.device)
    input_ids, positions, lens, tables, slots = group.broadcast(data).split(
        [num_tokens, num_tokens, 2 * num_seqs, num_seqs * width, num_tokens])
    lens = lens.tolist()
    layout = BatchLayout(query_lens=lens[:num_seqs], context_lens=lens[num_seqs:],
                         block_tables=tables.view(num_seqs, width), slot_mapping=slots,
                         num_prefills=num_prefills, block_size=block_size)
    return input_ids, positions, layout, None if num_layers < 0 else num_layers
