"""Typed metadata of every RPC message (design.md section 3).

Each message is a frozen dataclass with `to_bytes()` and `from_bytes()`. `from_bytes` checks types and
ranges that hold for every server; limits that depend on one server's configuration (its span, its
inference_max_length, its batch limit) are checked by the server against these typed values. Key names
follow Petals 2.x, so its peers and ours can read each other's metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

from corolla.errors import InvalidRequest
from corolla.wire.fields import Fields, pack, unpack

PROTOCOL_VERSION = 1
MAX_HOPS = 64
MAX_TIMEOUT = 3600.0
MAX_EPOCH = 2**62
MAX_TREE_TOKENS = 1024  # tokens of one speculative tree step, whatever a server allows (it announces less)

# hivemind registers a servicer's handlers as "{ClassName}.{method}"; Petals' servers are named so.
HANDLER_PREFIX = "TransformerConnectionHandler"
RPC_INFERENCE = f"{HANDLER_PREFIX}.rpc_inference"
RPC_FORWARD = f"{HANDLER_PREFIX}.rpc_forward"
RPC_FORWARD_STREAM = f"{HANDLER_PREFIX}.rpc_forward_stream"
RPC_BACKWARD = f"{HANDLER_PREFIX}.rpc_backward"
RPC_BACKWARD_STREAM = f"{HANDLER_PREFIX}.rpc_backward_stream"
RPC_INFO = f"{HANDLER_PREFIX}.rpc_info"
RPC_PUSH = f"{HANDLER_PREFIX}.rpc_push"


@dataclass(frozen=True, slots=True)
class NextServer:
    """A later hop of the chain, for server-to-server push: its peer, its session and its block range."""

    peer_id: str
    session_id: str
    start: int
    end: int

    @classmethod
    def parse(cls, item: object, fields: Fields, index: int) -> NextServer:
        if not isinstance(item, (list, tuple)) or len(item) != 4:
            raise fields.error(f"next_servers[{index}]", "must be [peer_id, session_id, start, end]")
        peer_id, session_id, start, end = item
        if not isinstance(peer_id, str) or not isinstance(session_id, str):
            raise fields.error(f"next_servers[{index}]", "must hold a string peer_id and session_id")
        if (
            not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, end))
            or not 0 <= start < end
        ):
            raise fields.error(f"next_servers[{index}]", f"has an invalid block range {start!r}:{end!r}")
        return cls(peer_id, session_id, start, end)


@dataclass(frozen=True, slots=True)
class InferenceStep:
    """Metadata of one `rpc_inference` message.

    The first message of a session also carries the session's parameters (`max_length` is then required);
    later messages carry only the step fields. Tensors: hidden_states [B, T, H], prompts (empty or
    [blocks, B, P, H]), hypo_ids (empty or int64 [B]).

    Speculative decoding: `tree` makes the step's T tokens a token tree (their parents, models/tree.py);
    the step after it names the path it keeps (`accepted`, indices into that tree, root first), and its
    start_from_position is the tree's start + len(accepted).
    """

    step_id: str | None = None
    start_from_position: int | None = None
    next_servers: tuple[NextServer, ...] = ()
    pushed: bool = False
    # from the client: the peer (the previous hop of its chain) that may push steps into this session
    push_from: str | None = None
    # in a push: the peer that opened the pushing server's session (the chain's client)
    origin: str | None = None
    tree: tuple[int, ...] | None = None  # parents of the step's tokens: a token tree
    accepted: tuple[int, ...] | None = None  # the path of the session's last tree step to keep
    # pipelined speculation (client/chain/frames.py): the epoch of the client's frames the step belongs to
    # (never lower than an earlier step's); a server skips steps of epochs before the latest it took, and
    # takes a push of a later epoch only if it opens that epoch (a rollback to a position it holds)
    epoch: int = 0
    opens_epoch: bool = False
    # in a push without tensors (an announcement): the previous server started the pass computing this step,
    # whose outputs it expects to push in about `due_in` seconds (engine/batching.py)
    due_in: float | None = None
    # session parameters, present on the first message only
    max_length: int | None = None
    session_id: str | None = None
    alloc_timeout: float = 0.0
    active_adapter: str | None = None
    points: float = 0.0
    output_encoding: str | None = None  # how the server encodes this session's outputs (wire/tensors.py)
    # prefix reuse (server/inference/sessions.py): start from this session of the same peer, at the first
    # step's start_from_position; and keep this session, idle and evictable, for later forks once its stream
    # ends
    fork_of: str | None = None
    keep: bool = False

    @classmethod
    def from_push_bytes(cls, raw: bytes) -> InferenceStep:
        """A step pushed by the previous server: the receiver's session_id, the session's origin (its
        client), step_id and position are required."""
        fields = unpack(raw, "rpc_push")
        fields.str("step_id", required=True)
        fields.int("start_from_position", required=True, low=0)
        step = {**cls._step_fields(fields), "pushed": True, "push_from": None}
        session_id = fields.str("session_id", required=True)
        origin = fields.str("origin", required=True)
        due_in = fields.float("due_in", low=0.0, high=MAX_TIMEOUT)
        return cls(**step, session_id=session_id, origin=origin, due_in=due_in)

    @classmethod
    def from_bytes(cls, raw: bytes, *, first: bool) -> InferenceStep:
        fields = unpack(raw, "rpc_inference")
        step = cls._step_fields(fields)
        if not first:
            return cls(**step)
        return cls(
            **step,
            max_length=fields.int("max_length", required=True, low=1),
            session_id=fields.str("session_id"),
            alloc_timeout=fields.float("alloc_timeout", default=0.0, low=0.0, high=MAX_TIMEOUT),
            active_adapter=fields.str("active_adapter") or None,
            points=fields.float("points", default=0.0, low=0.0),
            output_encoding=fields.str("output_encoding", max_chars=32),
            fork_of=fields.str("fork_of"),
            keep=fields.bool("keep"),
        )

    @staticmethod
    def step_id_of(raw: bytes) -> str | None:
        """The step_id of a later step whose other fields failed their checks, so that its refusal can
        name it; None where even that cannot be read."""
        try:
            return unpack(raw, "rpc_inference").str("step_id")
        except InvalidRequest:
            return None

    @staticmethod
    def _step_fields(fields: Fields) -> dict:
        _check_version(fields)
        hops = fields.list("next_servers", max_items=MAX_HOPS)
        return dict(
            step_id=fields.str("step_id"),
            start_from_position=fields.int("start_from_position", low=0),
            next_servers=tuple(NextServer.parse(item, fields, i) for i, item in enumerate(hops)),
            pushed=fields.bool("pushed"),
            push_from=fields.str("push_from"),
            tree=_tree_field(fields),
            accepted=_indices(fields, "accepted"),
            epoch=fields.int("epoch", default=0, low=0, high=MAX_EPOCH),
            opens_epoch=fields.bool("opens_epoch"),
        )

    def to_bytes(self) -> bytes:
        return pack(
            dict(
                version=PROTOCOL_VERSION,
                step_id=self.step_id,
                start_from_position=self.start_from_position,
                next_servers=[[h.peer_id, h.session_id, h.start, h.end] for h in self.next_servers] or None,
                pushed=self.pushed or None,
                push_from=self.push_from,
                origin=self.origin,
                tree=list(self.tree) if self.tree is not None else None,
                accepted=list(self.accepted) if self.accepted is not None else None,
                epoch=self.epoch or None,
                opens_epoch=self.opens_epoch or None,
                due_in=self.due_in,
                max_length=self.max_length,
                session_id=self.session_id,
                alloc_timeout=self.alloc_timeout or None,
                active_adapter=self.active_adapter,
                points=self.points or None,
                output_encoding=self.output_encoding,
                fork_of=self.fork_of,
                keep=self.keep or None,
            )
        )


@dataclass(frozen=True, slots=True)
class StepReply:
    """Metadata of an `rpc_inference` reply: the step whose outputs it carries.

    A server replies once per step, and replies to a pushed step as soon as it ran, possibly before the
    client's own copy of the step arrives; a reply to an abandoned step names a step the client no longer
    waits for. A step the server refuses (it failed a check, nothing ran) gets a reply with `error` and no
    tensors; the session goes on as if the step had not been sent.

    A reply with outputs names what ran: the position and the digest of the inputs (wire/digest.py, in
    hex). A step id has a second reply when a pushed copy with other inputs ran and replied before the
    client's copy arrived; the client takes the reply to what it sent (client/rpc/span_stream.py).

    A step of an epoch before the session's latest (a frame of pipelined speculation past a rejected draft)
    is `skipped`: nothing ran. A server that keeps epochs says so in its replies (`epochs`): only then may
    a client push a rollback to it.
    """

    step_id: str | None = None
    error: str | None = None
    position: int | None = None  # where the outputs' step ran
    inputs: str | None = None  # the digest of the inputs it ran, in hex
    skipped: bool = False
    epochs: bool = False

    @classmethod
    def from_bytes(cls, raw: bytes) -> StepReply:
        fields = unpack(raw, "rpc_inference reply")
        return cls(
            step_id=fields.str("step_id"),
            error=fields.str("error", max_chars=4096),
            position=fields.int("position", low=0),
            inputs=fields.str("inputs", max_chars=64),
            skipped=fields.bool("skipped"),
            epochs=fields.bool("epochs"),
        )

    def to_bytes(self) -> bytes:
        return pack(
            dict(
                step_id=self.step_id,
                error=self.error,
                position=self.position,
                inputs=self.inputs,
                skipped=self.skipped or None,
                epochs=self.epochs or None,
            )
        )


@dataclass(frozen=True, slots=True)
class ForwardRequest:
    """Metadata of `rpc_forward` / `rpc_forward_stream`. Tensors: hidden_states [B, T, H], prompts."""

    active_adapter: str | None = None
    points: float = 0.0
    output_compression: int | None = None

    @classmethod
    def from_bytes(cls, raw: bytes) -> ForwardRequest:
        fields = unpack(raw, "rpc_forward")
        _check_version(fields)
        compression = fields.list("output_compression", max_items=1)
        if compression and (not isinstance(compression[0], int) or isinstance(compression[0], bool)):
            raise fields.error("output_compression", "must hold an integer compression type")
        return cls(
            active_adapter=fields.str("active_adapter") or None,
            points=fields.float("points", default=0.0, low=0.0),
            output_compression=compression[0] if compression else None,
        )

    def to_bytes(self) -> bytes:
        compression = [self.output_compression] if self.output_compression is not None else None
        return pack(
            dict(
                version=PROTOCOL_VERSION,
                active_adapter=self.active_adapter,
                points=self.points or None,
                output_compression=compression,
            )
        )


def _indices(fields: Fields, name: str, low: int = 0) -> tuple[int, ...] | None:
    """A list of token indices; what they must point to is checked against the session
    (server/inference/step_inputs.py), so a bad one is refused as that step's error, not the whole
    session's."""
    if name not in fields:
        return None
    values = fields.list(name, max_items=MAX_TREE_TOKENS)
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise fields.error(f"{name}[{i}]", f"must be an integer >= {low}, got {value!r}")
    return tuple(values)


def _tree_field(fields: Fields) -> tuple[int, ...] | None:
    parents = _indices(fields, "tree", low=-(2**31))
    if parents is not None and not parents:
        raise fields.error("tree", "must hold one parent per token of the step")
    return parents


def _check_version(fields: Fields) -> None:
    # Absent means a Petals-style peer that does not send a version; that is accepted.
    fields.int("version", low=1, high=PROTOCOL_VERSION)
