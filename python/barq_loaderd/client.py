"""Client of loaderd's control socket and ring (proto/PROTOCOL.md; the Python counterpart of
proto/client.c): attach a job, read validated batches zero-copy, report progress, detach,
re-attach transparently when loaderd restarts, and resume state.

    with LoaderdClient(job_spec) as c:          # rank / world from the environment
        for batch in c:                         # Batch: read-only int32 views into the ring
            train_on(batch.input_ids, ...)      # valid until the next batch
            c.report(step, loss, tokens_per_s)  # shown by `loaderctl status`

Threading: next()/release() (the ring) and report() (the socket) may run on two threads;
close() must not overlap another call.
"""
import errno
import hashlib
import json
import math
import operator
import os
import select
import socket
import threading
import time
import warnings

from . import gguf_meta
from . import limits
from . import layout as L
from .batch import read_batch, validate
from .dist import resolve_rank_world
from .jobfile import load_job
from .errors import (LoaderdClosed, LoaderdConnectionError, LoaderdError, LoaderdProtocolError, LoaderdRefused,
                     LoaderdTimeout)
from .ring import Ring

# Keys of a job spec that do not change which batches a rank receives (left out of the digest
# that guards resume states).
_NOT_DATA_KEYS = ("name", "ring_slots", "tokenizer_threads", "ref_base")


def _abs(p, cwd):
    return p if not isinstance(p, str) or p.startswith("/") else os.path.join(cwd, p[2:] if p.startswith("./") else p)


def absolute_job_spec(job):
    """A copy of the job spec (dict) with relative "shards" patterns (top level and in each of
    "datasets") and the "tokenizer" path made absolute against this process's working
    directory: loaderd resolves paths in its own (proto/client.c does the same)."""
    if not isinstance(job, dict):
        raise TypeError(f"job spec: expected a dict (loaderd job spec, PROTOCOL.md §1), got {type(job).__name__}")
    spec = json.loads(json.dumps(job))
    cwd = os.getcwd()
    if isinstance(spec.get("shards"), list):
        spec["shards"] = [_abs(p, cwd) for p in spec["shards"]]
    if isinstance(spec.get("tokenizer"), str):
        spec["tokenizer"] = _abs(spec["tokenizer"], cwd)
    datasets = spec.get("datasets")
    for ds in datasets if isinstance(datasets, list) else []:
        if isinstance(ds, dict) and isinstance(ds.get("shards"), list):
            ds["shards"] = [_abs(p, cwd) for p in ds["shards"]]
    return spec


def job_digest(spec):
    """sha256 hex of the keys of a job spec that decide its batches (all but name, ring_slots,
    tokenizer_threads), canonical JSON: a resume state is only valid for the same digest."""
    data = {k: v for k, v in spec.items() if k not in _NOT_DATA_KEYS}
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# The trainer's defaults (trainer/config.c parse_identity; the C trainer writes this name into
# adapter_config.json when the job does not give base_model_name_or_path).
TRAINER_BASE_MODEL_DEFAULT = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _render(v):
    s = json.dumps(v, separators=(",", ":"), ensure_ascii=False)
    return s if len(s) <= 60 else s[:57] + "..."


def _bad(path, expect, v):
    return ValueError(f"config: {path}: expected {expect}, got {_render(v)}")


def _get_obj(root, key):
    if key not in root:
        return {}
    if not isinstance(root[key], dict):
        raise _bad(key, "an object", root[key])
    return root[key]


def _get_str(o, sect, key, default):
    path = f"{sect}.{key}" if sect else key
    if key not in o:
        if default is None:
            raise ValueError(f"config: {path}: required key missing (expected a string)")
        return default
    v = o[key]
    if not isinstance(v, str) or not v:
        raise _bad(path, "a non-empty string", v)
    if "\0" in v:
        raise _bad(path, "a string without NUL bytes", v)
    return v


def _get_strv(o, sect, key, required):
    path = f"{sect}.{key}"
    if key not in o:
        if required:
            raise ValueError(f"config: {path}: required key missing (expected a non-empty array of strings)")
        return []
    v = o[key]
    if isinstance(v, str) and v:  # a single string is a 1-list
        return [v]
    if not isinstance(v, list) or (required and not v):
        raise _bad(path, "a non-empty array of strings" if required else "an array of strings", v)
    if not all(isinstance(e, str) and e for e in v):
        raise _bad(path, "an array of non-empty strings", v)
    return list(v)


def _get_int(o, sect, key, default, lo, hi):
    """trainer/config.c get_int / get_i32: an integer (or an integral real) in [lo, hi]."""
    path = f"{sect}.{key}"
    if key not in o:
        return default
    v = o[key]
    what = f"an integer >= {lo:.15g}" if hi is None else f"an integer in [{lo:.15g}, {hi:.15g}]"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(path, what, v)
    if isinstance(v, float) and not (math.isfinite(v) and v == math.floor(v)):
        raise _bad(path, what, v)
    if v < lo or (hi is not None and v > hi) or abs(v) > 9.0e15:
        raise _bad(path, what, v)
    return int(v)


def read_trainer_config(config):
    """A trainer job config as the trainer reads it: a dict as is, or the path of a job file
    (JSON, or YAML for .yaml / .yml: barq_loaderd.jobfile.load_job, the trainer's reader)."""
    if isinstance(config, (str, os.PathLike)):
        config = load_job(config)
    if not isinstance(config, dict):
        raise ValueError("trainer config: expected a JSON object (or the path of a job file)")
    return config


def trainer_socket(config):
    """The control socket our trainer uses for this job config (trainer/config.c
    parse_identity + bt_config_default_socket): config "socket" (a non-empty string), else
    $LOADERD_SOCKET when set and non-empty, else /run/loaderd/loaderd.sock."""
    config = read_trainer_config(config)
    return _get_str(config, None, "socket", None) if "socket" in config else default_socket(None)


def base_model_name_or_path(config):
    """The base model an adapter trained on this job config should record
    (adapter_config.json base_model_name_or_path) so that PEFT loads the right model:
      1. the job's base_model_name_or_path (what our trainer writes);
      2. for a .gguf model, the source its metadata names (gguf_meta.source_model:
         general.source.huggingface.repository / repo_url / url);
      3. for a model directory, that directory (absolute): its config.json is there;
      4. otherwise the trainer's own default, TRAINER_BASE_MODEL_DEFAULT, with a RuntimeWarning
         saying to set base_model_name_or_path (the C trainer writes that default silently).
    config: a dict or the path of a job file."""
    config = read_trainer_config(config)
    if "base_model_name_or_path" in config:
        return _get_str(config, None, "base_model_name_or_path", None)
    model = _get_str(config, None, "model", None)
    if os.path.isdir(model):
        return os.path.abspath(model)
    if os.path.isfile(model):
        with open(model, "rb") as f:
            is_gguf = f.read(4) == b"GGUF"
        src = gguf_meta.source_model(model) if is_gguf else None
        if src:
            return src
    warnings.warn(f"{model}: neither the job (base_model_name_or_path) nor the model's metadata "
                  f"(general.source.*) names the base model; the adapter records the trainer's default "
                  f"{TRAINER_BASE_MODEL_DEFAULT!r}: set base_model_name_or_path in the job if that is not it",
                  RuntimeWarning, stacklevel=2)
    return TRAINER_BASE_MODEL_DEFAULT


def trainer_job_spec(config, eval=False):
    """The loaderd job spec our trainer sends for a trainer job config (trainer/config.c
    bt_config_job_json, keys and defaults of trainer/config.h): config is a dict or the path of
    the job file (JSON or YAML, read as the trainer reads it: jobfile.load_job). The keys used
    are checked with the trainer's rules (types, ranges, a single string for a list of shards)
    and a violation raises ValueError naming the key as the trainer does. Returns (spec,
    socket_path), the socket found as the trainer finds it (trainer_socket). eval=True: the
    held-out stream (eval.shards, one epoch, name + "-eval")."""
    config = read_trainer_config(config)
    data, ev = _get_obj(config, "data"), _get_obj(config, "eval")
    name = _get_str(config, None, "name", "barqtrain")
    model = _get_str(config, None, "model", None)
    shards = _get_strv(data, "data", "shards", True)
    eval_shards = _get_strv(ev, "eval", "shards", False)
    fmt = data.get("format", "chat")
    if fmt not in ("chat", "text", "alpaca"):
        raise _bad("data.format", 'one of "chat", "text", "alpaca"', fmt)
    text_field = _get_str(data, "data", "text_field", "text")
    seq_len = _get_int(data, "data", "seq_len", 512, limits.JOB_MIN_SEQ_LEN, limits.JOB_MAX_SEQ_LEN)
    mbs = _get_int(data, "data", "micro_batch_size", 4, 1, 4096)
    seed = _get_int(data, "data", "seed", 1234, 0, None)
    threads = _get_int(data, "data", "tokenizer_threads", 2, 1, limits.JOB_MAX_TOKENIZER_THREADS)
    if seq_len * mbs > limits.JOB_MAX_BATCH_TOKENS:
        raise ValueError(f"config: data.seq_len x data.micro_batch_size = {seq_len * mbs} tokens per "
                         f"micro-batch exceeds {limits.JOB_MAX_BATCH_TOKENS}")
    if eval and not eval_shards:
        raise ValueError("trainer config: eval.shards is required for the held-out stream")
    spec = {"name": name + ("-eval" if eval else ""), "shards": eval_shards if eval else shards,
            "format": fmt, "tokenizer": model, "seq_len": seq_len, "micro_batch_size": mbs, "seed": seed,
            "epochs": 1 if eval else 0, "tokenizer_threads": threads}
    if fmt == "text":  # loaderd refuses text_field with other formats
        spec["text_field"] = text_field
    return absolute_job_spec(spec), trainer_socket(config)


def _no_dupes(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


REFUSAL_WAIT_S = 2.0  # a refusal is already queued when our send fails; this bounds a hung loaderd


def _parse_reply(line, op):
    """A reply line -> dict; LoaderdRefused for ok:false (loaderd's message), LoaderdProtocolError
    for anything that is not a version-1 reply object."""
    try:
        rep = json.loads(line, object_pairs_hook=_no_dupes)
    except (ValueError, UnicodeDecodeError) as e:
        raise LoaderdProtocolError(f"loaderd reply to {op} is not JSON ({e}): {line[:80]!r}") from None
    if not isinstance(rep, dict):
        raise LoaderdProtocolError(f"loaderd reply to {op} is not a JSON object: {line[:80]!r}")
    if rep.get("v") != L.PROTO_VERSION or isinstance(rep.get("v"), bool):
        raise LoaderdProtocolError(f"loaderd reply to {op} has protocol version {rep.get('v')!r} "
                                   f"(this client speaks {L.PROTO_VERSION})")
    if rep.get("ok") is not True:
        msg = rep.get("error")
        raise LoaderdRefused(op, msg if isinstance(msg, str) else "no reason given")
    return rep


class _Conn:
    """One control-socket connection: JSON lines out, JSON lines (+ SCM_RIGHTS fds) in."""

    def __init__(self, path, timeout):
        self.path = path
        self.buf = b""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError as e:
            self.sock.close()
            hint = " (is loaderd running? set the socket path or $LOADERD_SOCKET)" \
                if e.errno in (errno.ENOENT, errno.ECONNREFUSED) else ""
            raise LoaderdConnectionError(f"connect {path}: {e.strerror or e}{hint}") from None

    def send(self, obj):
        msg = dict(obj)
        msg["v"] = L.PROTO_VERSION
        try:
            self.sock.sendall(json.dumps(msg, separators=(",", ":"), allow_nan=False).encode() + b"\n")
        except OSError as e:
            why = f"loaderd socket {self.path}: send: {e.strerror or e}"
            # refused at accept and closed (allowed_users, too many connections): loaderd wrote
            # its reason first, and it waits in our receive queue (proto/PROTOCOL.md §1)
            op = msg.get("op", "?")
            try:
                line, _ = self.read_line(REFUSAL_WAIT_S, op)
            except LoaderdError:
                raise LoaderdConnectionError(why) from None
            _parse_reply(line, op)  # raises LoaderdRefused with loaderd's words
            raise LoaderdConnectionError(why) from None

    def read_line(self, timeout, op, want_fd=False):
        """One reply line (bytes) and the first fd passed with it (or None); other fds closed."""
        deadline = time.monotonic() + timeout
        fd = None
        while b"\n" not in self.buf:
            if len(self.buf) >= L.MAX_REPLY_BYTES:
                raise LoaderdProtocolError(f"loaderd reply to {op} longer than {L.MAX_REPLY_BYTES} bytes")
            left = deadline - time.monotonic()
            if left <= 0:
                raise LoaderdTimeout(f"no reply from loaderd to {op} within {timeout:.0f} s")
            self.sock.settimeout(left)
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 65536, 8, socket.MSG_CMSG_CLOEXEC)
            except socket.timeout:
                continue
            except InterruptedError:
                continue
            except OSError as e:
                raise LoaderdConnectionError(f"loaderd socket {self.path}: {e.strerror or e}") from None
            for f in fds:
                if want_fd and fd is None:
                    fd = f
                else:
                    os.close(f)
            if not data:
                if fd is not None:
                    os.close(fd)
                raise LoaderdConnectionError(f"loaderd closed the connection (waiting for the {op} reply)")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return line.rstrip(b"\r"), fd

    def request(self, obj, timeout=L.REPLY_TIMEOUT_S):
        op = obj.get("op", "?")
        self.send(obj)
        line, _ = self.read_line(timeout, op)
        return _parse_reply(line, op)

    def hung_up(self):
        """Whether loaderd hung up (checked without consuming anything)."""
        p = select.poll()
        p.register(self.sock, select.POLLRDHUP)
        ev = p.poll(0)
        return bool(ev and ev[0][1] & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL))

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def default_socket(path=None):
    return path or os.environ.get(L.SOCKET_ENV) or L.DEFAULT_SOCKET


def request(op, socket_path=None, timeout=L.REPLY_TIMEOUT_S, **fields):
    """One request on a fresh connection (hello, status, jobs, metrics, ...); the reply dict.
    Raises LoaderdRefused with loaderd's message when it says no."""
    c = _Conn(default_socket(socket_path), timeout)
    try:
        return c.request(dict(fields, op=op), timeout)
    finally:
        c.close()


class LoaderdClient:
    """An attached loaderd job (one rank's batch stream).

    job: the loaderd job spec (dict; keys in proto/PROTOCOL.md §1, attach: name, shards, format,
        tokenizer, seq_len, micro_batch_size, seed, epochs, ... or datasets); relative paths are
        made absolute against the working directory. trainer_job_spec() builds it from a
        trainer job config.
    socket_path: None = $LOADERD_SOCKET, else /run/loaderd/loaderd.sock.
    rank, world_size: None = from torch.distributed / the environment (dist.resolve_rank_world).
    resume: None (from the start), the 256-byte resume_state of the last batch consumed (bytes
        or hex), or a dict from state_dict() (checked against this job and rank; a state of
        another world size W0 must be W0's rank 0, and every rank of this world continues at the
        row of the data the W0 ranks reached, PROTOCOL.md attach "resume_world": keep
        micro_batch_size and the global batch world size x grad_accum the same).
    verify_checksum: check the batches' FNV-1a checksums: True = every batch, "first" (default)
        = the first batch after each attach (catches a producer that fills slots differently),
        False = never. It is pure Python (a few MB/s: ~7 ms for 4 x 512 tokens, ~0.1 s for
        8 x 4096); the structural checks always run and are what keeps bad ids away from an
        embedding.
    reconnect_s: how long next() keeps re-attaching after loaderd went away (None =
        $LOADERD_RECONNECT_S, default 60; 0 = off).

    Errors: LoaderdConnectionError (socket), LoaderdRefused (loaderd said no: its message),
    LoaderdProtocolError, LoaderdTimeout, LoaderdClosed; ValueError for a bad rank/world or a
    resume state of another job or rank.
    """

    def __init__(self, job, socket_path=None, rank=None, world_size=None, resume=None, verify_checksum="first",
                 reconnect_s=None, attach_timeout_s=L.ATTACH_TIMEOUT_S):
        self.spec = absolute_job_spec(job)
        self.digest = job_digest(self.spec)
        self.socket_path = default_socket(socket_path)
        if rank is None and world_size is None:
            rank, world_size, _ = resolve_rank_world()
        elif rank is None or world_size is None:
            raise ValueError("give both rank and world_size, or neither (then they come from the environment)")
        try:
            if isinstance(rank, bool) or isinstance(world_size, bool):
                raise TypeError
            rank, world_size = operator.index(rank), operator.index(world_size)  # numpy ints too
        except TypeError:
            raise ValueError(f"rank {rank!r} / world_size {world_size!r}: need integers") from None
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank!r} / world_size {world_size!r}: need 0 <= rank < world_size")
        self.rank, self.world_size = rank, world_size
        if verify_checksum not in (True, False, "first"):
            raise ValueError(f"verify_checksum: True, False or \"first\", got {verify_checksum!r}")
        self.verify_checksum = verify_checksum
        self._checked_since_attach = False
        self.attach_timeout_s = attach_timeout_s
        if reconnect_s is None:
            env = os.environ.get(L.RECONNECT_ENV, "")
            reconnect_s = L.RECONNECT_DEFAULT_S
            if env:
                try:
                    x = float(env)
                    if not 0 <= x <= 7 * 86400:
                        raise ValueError
                    reconnect_s = x
                except ValueError:
                    warnings.warn(f"{L.RECONNECT_ENV}={env} is not seconds in [0, 604800]: using {reconnect_s:.0f}")
        self.reconnect_s = reconnect_s
        self._resume_world = None  # the world size the resume state was written by, when it differs
        self._resume, self._next_step = self._resume_arg(resume)
        self._have_step = self._next_step is not None
        self._conn = None
        self._ring = None
        self._holding = False
        self._ended = False
        self._closed = False
        self._mu = threading.Lock()
        self._reconnecting = False
        self.reconnects = 0
        self.job_id = self.B = self.T = self.slots = None
        self.vocab = 0
        self.reply = {}
        self._attach()

    # ---- resume state ----
    def _resume_arg(self, resume):
        if resume is None:
            return None, None
        if isinstance(resume, dict):
            return self._check_state(resume)
        if isinstance(resume, str):
            try:
                resume = bytes.fromhex(resume)
            except ValueError:
                raise ValueError("resume: not a hex string") from None
        if not isinstance(resume, (bytes, bytearray)) or len(resume) != L.RESUME_STATE_BYTES:
            raise ValueError(f"resume: expected {L.RESUME_STATE_BYTES} bytes (a batch's resume_state), "
                             f"a hex string of them, or a state_dict()")
        return bytes(resume), None

    def _check_state(self, sd):
        if sd.get("format") != "barq-loaderd-state" or sd.get("version") != 1:
            raise ValueError("resume: not a barq_loaderd state_dict (format/version)")
        if sd.get("job_digest") != self.digest:
            raise ValueError("resume: the state belongs to another job (shards, format, tokenizer, seq_len, "
                             "micro_batch_size, seed, epochs or datasets differ)")
        w0 = sd.get("world_size")
        if not isinstance(w0, int) or isinstance(w0, bool) or not 1 <= w0 <= 65536:
            raise ValueError(f"resume: world_size {w0!r} is not an integer in [1, 65536]")
        if w0 != self.world_size:
            # another number of ranks (PROTOCOL.md attach "resume_world"): every new rank resumes from
            # the old run's rank-0 state and loaderd continues it at the row the old ranks reached
            if sd.get("rank") != 0:
                raise ValueError(f"resume: the state is rank {sd.get('rank')} of {w0}, this client is rank "
                                 f"{self.rank} of {self.world_size}: with another world size every rank "
                                 f"resumes from rank 0's state (and the global batch, world size x "
                                 f"grad_accum, must stay the same)")
            self._resume_world = w0
        elif sd.get("rank") != self.rank:
            raise ValueError(f"resume: the state is rank {sd.get('rank')} of {w0}, this client is rank "
                             f"{self.rank} of {self.world_size}; resuming with another rank is refused (each "
                             f"rank's stream is its own)")
        st = sd.get("resume")
        step = sd.get("next_step")
        if not isinstance(step, int) or step < 0:
            raise ValueError("resume: next_step missing")
        if st is None:
            if step:
                raise ValueError("resume: next_step without a resume state")
            return None, None
        return self._resume_arg(st)[0], step

    def state_dict(self):
        """Where this stream stands: after the last batch handed out by next(). A dict of JSON
        types: format, version, job_digest, rank, world_size, next_step, resume (hex or None)."""
        return {"format": "barq-loaderd-state", "version": 1, "job_digest": self.digest, "rank": self.rank,
                "world_size": self.world_size, "next_step": self._next_step or 0,
                "resume": self._resume.hex() if self._resume is not None else None}

    # ---- attach / re-attach ----
    def _attach(self):
        conn = _Conn(self.socket_path, self.attach_timeout_s)
        try:
            req = {"op": "attach", "job": self.spec, "rank": self.rank, "world_size": self.world_size}
            if self._resume is not None:
                req["resume"] = self._resume.hex()
                if self._resume_world is not None:
                    req["resume_world"] = self._resume_world
            conn.send(req)
            line, fd = conn.read_line(self.attach_timeout_s, "attach", want_fd=True)
            try:
                rep = _parse_reply(line, "attach")
                vals = {}
                for k in ("job_id", "B", "T", "slots"):
                    v = rep.get(k)
                    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 0xFFFFFFFF:
                        raise LoaderdProtocolError(f"loaderd attach reply: {k!r} missing or not a u32")
                    vals[k] = v
                if fd is None:
                    raise LoaderdProtocolError("loaderd attach reply carried no ring descriptor")
                if self.B is not None and (vals["B"], vals["T"]) != (self.B, self.T):
                    raise LoaderdProtocolError(f"re-attach got batches of {vals['B']}x{vals['T']}, was {self.B}x{self.T}")
            except BaseException:
                if fd is not None:
                    os.close(fd)
                raise
            ring = Ring(fd)  # owns fd
            if (ring.B, ring.T, ring.n_slots) != (vals["B"], vals["T"], vals["slots"]):
                ring.close(consumer_close=False)
                raise LoaderdProtocolError(f"ring geometry {ring.B}x{ring.T} x{ring.n_slots} differs from the attach "
                                           f"reply {vals['B']}x{vals['T']} x{vals['slots']}")
        except BaseException:
            conn.close()
            raise
        v = rep.get("vocab")
        self.vocab = v if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 0x7FFFFFFF else 0
        self.job_id, self.B, self.T, self.slots = vals["job_id"], vals["B"], vals["T"], vals["slots"]
        self.reply = rep
        self._conn, self._ring = conn, ring
        self._checked_since_attach = False

    def _reconnect(self):
        if self.reconnect_s <= 0:
            raise LoaderdClosed(f"loaderd closed the stream of job {self.job_id} (reconnecting disabled: "
                                f"{L.RECONNECT_ENV}=0)")
        with self._mu:
            self._reconnecting = True
            old = self.job_id
            if self._conn:
                self._conn.close()
            self._conn = None
        warnings.warn(f"loaderd went away (job {old}, next step {self._next_step or 0}): reconnecting to "
                      f"{self.socket_path} for up to {self.reconnect_s:.0f} s", RuntimeWarning)
        if self._ring:
            self._ring.close(consumer_close=False)
        self._ring = None
        deadline, nap, err = time.monotonic() + self.reconnect_s, 0.05, None
        try:
            while True:
                try:
                    self._attach()
                    self.reconnects += 1
                    return
                except (LoaderdConnectionError, LoaderdRefused, LoaderdTimeout, LoaderdProtocolError) as e:
                    err = e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LoaderdClosed(f"loaderd did not come back within {self.reconnect_s:.0f} s "
                                        f"({L.RECONNECT_ENV}): {err}") from None
                time.sleep(min(nap, left))
                nap = min(nap * 2, 1.0)
        finally:
            with self._mu:
                self._reconnecting = False

    # ---- batches ----
    def next(self, timeout=None):
        """The next batch (a Batch of zero-copy views, valid until release() or the next call),
        or None at the end of the data (finite epochs). Releases the batch held before. Waits
        up to `timeout` seconds (None: forever; a re-attach after loaderd went away is not
        bounded by it). Every batch is validated (batch.validate, against B, T and the
        vocabulary) and its job id and step checked (consecutive from the resume point)."""
        if self._closed:
            raise LoaderdClosed("next() after close(): this client is detached")
        if self._holding:
            self.release()
        if self._ended:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            slice_s = L.PEEK_SLICE_S if left is None else min(left, L.PEEK_SLICE_S)
            try:
                if self._ring is None:
                    raise LoaderdClosed("no ring")
                off = self._ring.peek(slice_s)
                break
            except LoaderdTimeout:
                if self._conn is None or self._conn.hung_up():
                    self._reconnect()
                    continue
                if deadline is not None and time.monotonic() >= deadline:
                    raise LoaderdTimeout(f"no batch from loaderd within {timeout:.3g} s") from None
            except LoaderdClosed:
                # the producer stopped early: a loaderd that is going away hangs up right after
                end = time.monotonic() + L.CLOSED_GRACE_S
                while self._conn is not None and not self._conn.hung_up() and time.monotonic() < end:
                    time.sleep(0.05)
                if self._conn is None or self._conn.hung_up():
                    self._reconnect()
                    continue
                raise LoaderdClosed(f"loaderd closed the stream of job {self.job_id} before its end: "
                                    f"{self._job_outcome()}") from None
        self._holding = True
        b = read_batch(self._ring.buffer, off, self.B, self.T)
        what = "end-of-data batch" if b.end_of_data else "batch"
        if not b.end_of_data:
            full = self.verify_checksum is True or (self.verify_checksum == "first" and not self._checked_since_attach)
            validate(b, self.vocab, full)
            self._checked_since_attach = True
        if self._have_step and b.step != self._next_step:
            raise LoaderdProtocolError(f"{what} step {b.step} out of order (want {self._next_step})")
        if b.job_id != self.job_id:
            raise LoaderdProtocolError(f"{what} carries job id {b.job_id} (want {self.job_id})")
        if b.end_of_data:
            self._ended = True
            self.release()
            return None
        self._have_step = True
        self._next_step = b.step + 1
        self._resume = b.resume_state
        self._resume_world = None  # the state is this world's from now on
        return b

    def _job_outcome(self):
        """loaderd's account of why this job's stream stopped (its state and error in `status`)."""
        try:
            for j in request("status", socket_path=self.socket_path).get("jobs") or []:
                if isinstance(j, dict) and j.get("job_id") == self.job_id:
                    err = j.get("error")
                    return f"job {j.get('state')}" + (f": {err}" if isinstance(err, str) else "")
        except LoaderdError as e:
            return f"loaderd status unavailable ({e})"
        return "the job is no longer listed (see loaderctl status)"

    def release(self):
        """Hand the batch of the last next() back to loaderd (its views must not be used
        afterwards: the slot is refilled). A no-op when none is held."""
        if self._holding:
            self._holding = False
            if self._ring is not None:
                self._ring.release()

    def __iter__(self):
        while True:
            b = self.next()
            if b is None:
                return
            yield b

    @property
    def next_step(self):
        """Index of the batch the next next() returns."""
        return self._next_step or 0

    # ---- progress ----
    def report(self, step, loss=None, tokens_per_s=None):
        """Tell loaderd the trainer's progress (shown by `loaderctl status` / metrics): step =
        optimiser steps done, loss, tokens/s (None or non-finite travel as null). Waits up to 5 s
        for the answer. Raises LoaderdClosed while next() is re-attaching to a restarted
        loaderd, LoaderdRefused / LoaderdConnectionError otherwise."""
        def num(x):
            return float(x) if x is not None and math.isfinite(float(x)) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"report: step must be an int >= 0, got {step!r}")
        with self._mu:
            if self._reconnecting:
                raise LoaderdClosed("report: loaderd went away; reconnecting")
            if self._conn is None:
                raise LoaderdConnectionError("report: not connected to loaderd")
            self._conn.request({"op": "report", "job_id": self.job_id, "step": step, "loss": num(loss),
                                "tokens_per_s": num(tokens_per_s)})

    # ---- reference log-probs (issue 25 §2; proto/PROTOCOL.md op ref_put) ----
    REF_PUT_MAX = 4096

    def ref_put(self, base, values):
        """Hand computed reference log-probs back to loaderd, which keeps them in its token cache
        for the job's ref_base (later epochs, later jobs, other ranks' batches then carry them in
        seg_ref_ok / seg_ref_logp). values: iterable of (src, line, side, logp): the segment's
        seg_src and seg_line, side 0 (chosen or kto) or 1 (rejected), logp the summed log-prob in
        nats of the segment's labelled tokens under the reference model. Sent in requests of at most
        REF_PUT_MAX values. Returns (accepted, rejected, errors): counts, and the first reasons loaderd
        gave for refused values (a refused value is not an error). Raises LoaderdRefused when loaderd
        refuses the request (the job has no ref_base, base is another), LoaderdClosed while next()
        re-attaches, LoaderdConnectionError otherwise."""
        vals = [[int(a), int(b), int(c), float(d) if math.isfinite(float(d)) else 1.0] for a, b, c, d in values]
        acc = rej = 0
        errors = []
        for i in range(0, len(vals), self.REF_PUT_MAX):
            chunk = vals[i:i + self.REF_PUT_MAX]
            with self._mu:
                if self._reconnecting:
                    raise LoaderdClosed("ref_put: loaderd went away; reconnecting")
                if self._conn is None:
                    raise LoaderdConnectionError("ref_put: not connected to loaderd")
                rep = self._conn.request({"op": "ref_put", "job_id": self.job_id, "base": str(base),
                                          "values": chunk})
            a, r = rep.get("accepted"), rep.get("rejected")
            if not isinstance(a, int) or not isinstance(r, int) or a + r != len(chunk):
                raise LoaderdProtocolError(f"ref_put: reply does not account for the {len(chunk)} values sent")
            acc, rej = acc + a, rej + r
            errors += [e for e in rep.get("errors", []) if isinstance(e, str)][:8 - len(errors)]
        return acc, rej, errors

    # ---- teardown ----
    def close(self):
        """Detach: set the ring's consumer-closed flag (loaderd stops producing at once), send
        detach (best effort), close the socket, unmap the ring. Idempotent."""
        self._closed = True
        ring, conn = self._ring, self._conn
        self._ring = self._conn = None
        self._holding = False
        if ring is not None:
            ring.close(consumer_close=True)
        if conn is not None:
            try:
                conn.request({"op": "detach", "job_id": self.job_id}, timeout=1.0)
            except LoaderdError:
                pass
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
