"""Rollout engines on their own GPUs (--rollout-gpus, docs/async.md): the trainer's side and the engines' side.

A launch of W ranks with --rollout-gpus R splits in two (common/run/dist.py): ranks 0..W-R-1 train, the last R
only generate. They talk through the launcher's store (commands, prompts, samples: small) and one process group
of the first trainer rank and the R engine ranks (weights: NCCL on GPUs, gloo on CPUs):

    trainer ranks                                       engine ranks
    engine = RemoteEngine(link)                         serve(link, make_engine)   # until the trainer says stop
    engine.update_weights(export_hf_weights(...))  ->   buckets received, engine.update_weights(...)
    engine.generate(prompts, n=..., seed=...)      ->   each engine replica its share, samples back
    ticket = engine.submit(...); engine.collect(ticket) (the same, the trainer free in between)

Commands run on the engines in the order the trainer sends them, so a weight sync sent while the engines still
generate an earlier request waits for it: with requests sent ahead (common/rollout/ahead.py, --off-policy-steps K) the
engines generate the next step's samples under the weights they hold while the trainer trains on this step's.
Every wait on the other side has a deadline, and each side writes a heartbeat: an engine rank that died or
hangs stops the trainer with a message naming it (and the other way round), rather than a silent wait. Streaming
partial rollouts (common/rollout/stream.py) send chunks from a thread of their own; RemoteEngine.turn keeps each
chunk and each weight sync whole on the engines.
"""

import contextlib
import copy
import pickle
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from common.rollout.engine import RolloutEngine, replica_share

_OPEN = []  # RemoteEngines not yet closed: close_all() stops their engines, however the run ends
HEARTBEAT_S = 5.0  # how often each side says it is alive
SILENT_LIMIT_S = 300.0  # a side silent this long is taken for dead (a checkpoint's pickling holds the GIL a while)
WAIT_SLICE_S = 10.0  # a wait looks at the other side's heartbeats this often


class Link:
    """The two sides' channel: messages through the launcher's store, weights through a process group of the
    first trainer rank (its rank 0) and the engine ranks (1..R). store: common.run.dist.role_store();
    trainers, rollout_gpus: the split; global_rank: this process's; device: cuda for NCCL, cpu for gloo;
    timeout_minutes: the longest any wait may take."""

    def __init__(self, store, trainers, rollout_gpus, global_rank, device, timeout_minutes=60):
        self.store = dist.PrefixStore("link/", store)
        self.trainers, self.rollout_gpus, self.global_rank = trainers, rollout_gpus, global_rank
        self.timeout_s = timeout_minutes * 60
        self.engine_side = global_rank >= trainers
        self.group = None  # the weights' group: the first trainer rank and every engine rank
        if global_rank == 0 or self.engine_side:
            rank = global_rank - trainers + 1 if self.engine_side else 0
            size = rollout_gpus + 1
            xfer = dist.PrefixStore("xfer/", self.store)
            if device.type == "cuda":
                self.group = dist.ProcessGroupNCCL(xfer, rank, size)
            else:
                self.group = dist.ProcessGroupGloo(xfer, rank, size, timedelta(seconds=self.timeout_s))
            # heartbeats on a client of their own (the main thread's may be blocked in a wait)
            beat = dist.PrefixStore("link/", _client_like(store))
            threading.Thread(target=_beat, args=(beat, f"alive/{global_rank}"), daemon=True).start()

    def post(self, key, obj):
        self.store.set(key, pickle.dumps(obj))

    def take(self, key, watch, what, delete=True):
        """The object at key once it is there; meanwhile checks that the ranks in watch still beat (RuntimeError
        naming the silent one, or after timeout_minutes, naming what was waited for)."""
        start = time.time()
        while True:
            try:
                self.store.wait([key], timedelta(seconds=min(WAIT_SLICE_S, self.timeout_s)))
                break
            except dist.DistStoreError:
                for rank in watch:
                    seen = float(self.store.get(f"alive/{rank}")) if self.store.check([f"alive/{rank}"]) else start
                    if time.time() - seen > SILENT_LIMIT_S:
                        side = "engine" if rank >= self.trainers else "trainer"
                        raise RuntimeError(
                            f"--rollout-gpus: {side} rank {rank} has not answered for {time.time() - seen:.0f} s while "
                            f"this rank waited for {what}: it stopped or hangs (see its log)"
                        ) from None
                if time.time() - start > self.timeout_s:
                    raise RuntimeError(f"--rollout-gpus: no {what} within {self.timeout_s / 60:.0f} minutes") from None
        obj = pickle.loads(self.store.get(key))
        if delete:
            self.store.delete_key(key)
        return obj

    def clone(self):
        """This link with a store client of its own, for another thread (a client takes one call at a time: the
        main thread's posts would wait for the other thread's waits)."""
        other = copy.copy(self)
        other.store = self.store.clone()
        return other

    def engine_ranks(self):
        return range(self.trainers, self.trainers + self.rollout_gpus)

    def broadcast(self, flat):
        """The weights' group: the first trainer rank's flat byte buffer into every engine rank's (same size)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([flat], opts).wait()


def _client_like(store):
    """Another client of the launcher's TCP store; any other store (torchrun's agent store comes wrapped in a
    prefix) is shared as it is: its client takes one call at a time, so a beat may wait for a wait's slice."""
    if isinstance(store, dist.TCPStore):
        return dist.TCPStore(store.host, store.port, is_master=False, timeout=timedelta(minutes=5))
    return store


def _beat(store, key):
    while True:
        try:
            store.set(key, repr(time.time()))
        except Exception:  # the store's host left: the run is ending
            return
        time.sleep(HEARTBEAT_S)


class RemoteEngine(RolloutEngine):
    """The trainer ranks' engine when the engines run on other GPUs: every trainer rank calls its methods (the
    weight export runs collectives); the first sends the commands and gets the samples, which it alone returns
    (the other ranks get [], as the ranks of one colocated replica but its first: the scripts gather the first's).
    sync counts the weight syncs made: a sample generated after sync i and trained after sync j is j - i steps
    old (one sync a step); held, those the engines hold (a sync sent behind lags sync until it is sent).

    behind (--sync-overlap, where the trainer's export runs no collectives: TP = PP = EP = 1): update_weights
    returns at once and the first rank sends the weights from a thread of its own, reading the parameters while
    the trainer's next passes run; settle() waits for it (the scripts call it before the optimizer step changes
    the parameters: common/train/colocation.py wait_optimizers). Every other call settles first, so a request or a
    validation goes after the sync as before. The other trainer ranks send nothing and skip the export."""

    def __init__(self, link, bucket_mb=512, behind=False):
        self.link, self.bucket_bytes, self.behind = link, bucket_mb * 2**20, behind
        self.leader = link.global_rank == 0
        self.commands = 0  # commands sent (their keys: cmd/0, cmd/1, ...)
        self.sync = self.held = 0
        self.sender, self.sender_error = None, None  # a sync sent behind: its thread, its failure
        self.stream = None  # on a GPU, the CUDA stream of the syncs sent behind
        self.closed = False
        self.last_generate_s = 0.0  # the engines' own seconds of the last request collected (slowest replica)
        self._counter = threading.Lock()  # the commands' numbers, sent from two threads (common/rollout/stream.py)
        self._start_up = threading.Lock()  # the first answer's reader learns the number of replicas
        self._turns = threading.Condition()  # whose turn it is to talk to the engines: turn()
        self._busy, self._waiting = False, 0
        _OPEN.append(self)

    @contextlib.contextmanager
    def turn(self, background=False, reserved=False):
        """The engines to this thread alone while the block runs (requests sent and answered, or a weight sync),
        so that whatever it sends runs under the weights it saw. Streaming partial rollouts' thread
        (common/rollout/stream.py) takes background turns, one chunk each: a waiting foreground turn (the loop's
        weight sync or validation) goes first. reserved: a foreground turn counted as waiting already (a sync
        sent behind: from the moment update_weights returned)."""
        with self._turns:
            self._waiting += not background and not reserved
            self._turns.wait_for(lambda: not self._busy and not (background and self._waiting))
            self._waiting -= not background
            self._busy = True
        try:
            yield
        finally:
            with self._turns:
                self._busy = False
                self._turns.notify_all()

    def _send(self, kind, link=None, **fields):
        with self._counter:
            index, self.commands = self.commands, self.commands + 1
        (link or self.link).post(f"cmd/{index}", dict(kind=kind, **fields))
        return index

    def start(self, **settings):
        """The engines' start-up settings (hf_dir, max_model_len): they build their engines on receiving them."""
        if self.leader:
            self._send("start", **settings)

    def update_weights(self, named_tensors):
        """(HF name, full tensor) pairs -> the engines, in flat byte buckets of bucket_mb: names, dtypes and shapes
        through the store, bytes through the weights' group. All trainer ranks iterate (the export's
        collectives); the first sends. behind: the first sends from a thread (class docstring), the others skip."""
        self.settle()  # (one sync at a time)
        self.sync += 1
        if not self.leader:
            if not self.behind:
                for _ in named_tensors:
                    pass
            return
        if not self.behind:
            with self.turn():  # (streaming rollouts read the engines' weights, held, in their turns)
                self._send_weights(named_tensors, self.link)
            return
        with self._turns:
            self._waiting += 1  # the streaming chunks wait from now on: this sync goes next
        ready = None  # on a GPU: (this device, the sync's stream, an event after the work queued so far)
        if torch.cuda.is_available():
            if self.stream is None:  # one stream for every sync: the allocator keeps freed blocks per stream
                self.stream = torch.cuda.Stream()
            ready = (torch.cuda.current_device(), self.stream, torch.cuda.Event())
            ready[2].record()  # (after the optimizer step's work: the parameters as it leaves them)
        self.sender = threading.Thread(
            target=self._send_behind, args=(named_tensors, ready), name="weight sync", daemon=True
        )
        self.sender.start()

    def _send_behind(self, named_tensors, ready):
        """The thread of a sync sent behind: its own store client, on the syncs' CUDA stream (the parameters are
        read beside the trainer's passes); done once the GPU has read them."""
        try:
            with self.turn(reserved=True), _side_stream(ready) as stream:  # (the reservation ends with the turn)
                self._send_weights(named_tensors, self.link.clone())
                if stream is not None:
                    stream.synchronize()
        except BaseException:
            self.sender_error = traceback.format_exc()

    def settle(self):
        """Wait for a sync sent behind (if any) to finish; its failure raised here."""
        sender, self.sender = self.sender, None
        if sender is None:
            return
        sender.join()
        error, self.sender_error = self.sender_error, None
        if error:
            raise RuntimeError(f"--rollout-gpus: the weight sync failed:\n{error}")

    def _send_weights(self, named_tensors, link):
        self.held += 1  # (in the turn: streaming rollouts read it in theirs)
        cmd, bucket, size, index = self._send("weights", link, sync=self.held), [], 0, 0
        for name, tensor in named_tensors:
            bucket.append((name, tensor.contiguous()))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                self._send_bucket(link, cmd, index, bucket)
                bucket, size, index = [], 0, index + 1
        if bucket:
            self._send_bucket(link, cmd, index, bucket)
            index += 1
        link.post(f"w/{cmd}/{index}", None)  # the end

    def _send_bucket(self, link, cmd, index, bucket):
        meta = [(name, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for name, t in bucket]
        link.post(f"w/{cmd}/{index}", meta)
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
        link.broadcast(flat)

    def submit(self, prompts, link=None, **kwargs):
        """Send a generate request (RolloutEngine.generate's arguments) -> its ticket; the trainer goes on. link:
        another thread's (Link.clone: streaming's chunks, which a sync sent behind goes before by its turn)."""
        if link is None:
            self.settle()
        return self._send("generate", link, prompts=prompts, kwargs=kwargs) if self.leader else None

    def collect(self, ticket, link=None):
        """The samples of a submitted request (waits for them): [] but on the first trainer rank. Each sample's
        age in syncs: self.sync - the sync it was generated after (ages)."""
        if not self.leader:
            return [], []
        results = self._results(ticket, f"the samples of request {ticket}", link or self.link)
        self.last_generate_s = max(res["seconds"] for res in results)
        samples = [s for res in results for s in res["samples"]]
        return samples, [self.sync - res["sync"] for res in results for _ in res["samples"]]

    def _results(self, ticket, what, link):
        """Every engine replica's answer to command `ticket`, in replica order; an engine's failure raised here
        with its traceback. The number of replicas the engines said at start-up."""
        with self._start_up:
            if not hasattr(self, "_num_replicas"):
                self._num_replicas = link.take("replicas", link.engine_ranks(), "the engines' start-up")
        results = [link.take(f"res/{ticket}/{r}", link.engine_ranks(), what) for r in range(self._num_replicas)]
        for res in results:
            if res.get("error"):
                raise RuntimeError(f"--rollout-gpus: the engine failed on command {ticket}:\n{res['error']}")
        return results

    def generate(self, prompts, n, temperature, top_p, max_tokens, seed, logprob_samples=None, **kwargs):
        kwargs.update(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
        if not self.leader:
            return []
        self.settle()  # (before the turn: the sync's thread takes one)
        with self.turn():
            return self.collect(self.submit(prompts, logprob_samples=logprob_samples, **kwargs))[0]

    def score(self, samples):
        if not self.leader:
            return []
        self.settle()
        with self.turn():
            results = self._results(self._send("score", samples=samples), "scores", self.link)
        return [row for res in results for row in res["samples"]]

    def close(self):
        """The engines stop (the trainer's last word; every way out of a run says it, common/run/cli.py)."""
        if self.leader and not self.closed:
            if self.sender is not None:  # (its failure, if any, is the run's to report: not raised here)
                self.sender.join(self.link.timeout_s)
            self._send("stop")
            self.closed = True


def close_all():
    """Every RemoteEngine of this process tells its engines to stop (the first trainer rank's last word; every way
    out of a training script calls this, common/run/cli.py)."""
    while _OPEN:
        _OPEN.pop().close()


def serve(link, make_engine, replica, num_replicas, first_of_replica):
    """An engine rank's whole life: wait for the trainer's start-up settings, build the engine
    (make_engine(**settings)), then run the trainer's commands in order until it says stop. replica,
    num_replicas: this rank's engine replica (its rollout TP group) and how many; the replica's first rank
    (first_of_replica) sends its share's samples back. A failed command is reported to the trainer (its
    traceback), then raised."""
    trainer0 = [0]
    engine, index, sync = None, 0, 0
    while True:
        cmd = link.take(f"cmd/{index}", trainer0, "the trainer's next command", delete=False)
        kind, read = cmd["kind"], []  # read: a weight sync's bucket keys, deleted with the command's
        if kind == "stop":
            return
        try:
            if kind == "start":
                engine = make_engine(**{k: v for k, v in cmd.items() if k != "kind"})
                if link.global_rank == link.trainers:
                    link.post("replicas", num_replicas)
            elif kind == "weights":
                engine.wake_weights()
                engine.update_weights(_received(link, index, read))
                engine.wake_kv_cache()
                sync = cmd["sync"]
            elif kind in ("generate", "score"):
                tick = time.time()
                if kind == "generate":
                    samples = _generate_share(engine, cmd, replica, num_replicas)
                else:
                    samples = engine.score(replica_share(cmd["samples"], replica, num_replicas))
                if first_of_replica:
                    link.post(f"res/{index}/{replica}", dict(samples=samples, sync=sync, seconds=time.time() - tick))
        except Exception:
            if first_of_replica and kind in ("generate", "score"):
                link.post(f"res/{index}/{replica}", dict(error=traceback.format_exc()))
            raise
        dist.barrier()  # every engine rank has read the command before it goes
        if link.global_rank == link.trainers:
            for key in [f"cmd/{index}", *read]:
                link.store.delete_key(key)
        index += 1


def _generate_share(engine, cmd, replica, num_replicas):
    """This replica's contiguous share of the request's prompts (replica 0 with the request's own seed, so one
    engine replica samples what a colocated world of one samples)."""
    kwargs, prompts, n = dict(cmd["kwargs"]), cmd["prompts"], cmd["kwargs"]["n"]
    rows = replica_share(list(range(len(prompts))), replica, num_replicas)
    if kwargs.get("response_lengths") is not None:
        kwargs["response_lengths"] = [kwargs["response_lengths"][i * n + j] for i in rows for j in range(n)]
    kwargs["seed"] += replica
    return engine.generate([prompts[i] for i in rows], **kwargs) if rows else []


def _received(link, cmd, read):
    """The pairs of one weight sync as they arrive, bucket by bucket (names from the store, bytes from the
    first trainer rank); each bucket's tensors are views of its buffer, which the consumer copies from. read: a
    list that gets the store key of every bucket's names read, the end's included."""
    while True:
        read.append(f"w/{cmd}/{len(read)}")
        meta = link.take(read[-1], [0], "the weights", delete=False)
        if meta is None:
            return
        flat = torch.empty(sum(m[3] for m in meta), dtype=torch.uint8, device=_device(link))
        link.broadcast(flat)
        offset = 0
        for name, dtype, shape, nbytes in meta:
            yield name, flat[offset : offset + nbytes].view(dtype).view(shape)
            offset += nbytes


def _device(link):
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def _side_stream(ready):
    """ready = (device, stream, event): the stream, after the event, current in this thread on that device; None on
    a CPU (ready None)."""
    if ready is None:
        yield None
        return
    device, stream, event = ready
    with torch.cuda.device(device):
        stream.wait_event(event)
        with torch.cuda.stream(stream):
            yield stream
