"""An in-process network for client tests: corolla's real servers and client, without sockets.

Each `LoopbackServer` is the server stack `corolla server` runs (a span's weights, the engine, the
inference and pass services, the status board, the RPC handlers, the pusher), built in this process on a
tiny model. Clients and servers reach each other through `LoopbackTransport`, which hands each message to
the handler the server registered, as libp2p would: a copy of the message, a stream handler's error as
its text, a unary handler's as its repr, the end of a stream when the handler returns, a stream message
over its handler's cap refused as the real stream reader refuses it (swarm/p2p/stream_handlers.py; the
server lowers a session's cap after its first message). Servers can be
killed (their streams end, calls to them fail, as with a dead process), frozen (they take requests and
never answer) or made to lie (server/faults.py). Everything runs on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from google.protobuf.message import Message
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError, P2PHandlerError

from corolla.client.client import Client, ServedModel
from corolla.client.runtime import LoopThread
from corolla.config import ClientConfig, EngineConfig, ServerConfig
from corolla.errors import InvalidRequest
from corolla.models.devices import device_info
from corolla.models.model_config import ModelConfig
from corolla.server.faults import Fault
from corolla.server.handler import TransformerConnectionHandler
from corolla.server.hosting.backend import SpanLoader, adapter_names, compute_settings
from corolla.server.hosting.spans import HostedSpans
from corolla.server.inference.forward_passes import PassService
from corolla.server.inference.push import Pusher
from corolla.server.inference.service import InferenceService
from corolla.server.status import Compute, StatusBoard
from corolla.swarm.dht import RemoteSpan
from corolla.wire.messages import RPC_INFERENCE
from corolla.wire.records import ServerState

if TYPE_CHECKING:
    from corolla.client.model import DistributedModelForCausalLM

UNARY_LIMIT = 4 * 2**20  # the libp2p daemon's cap on unary messages
PREFIX = "tiny"


def _copy(message: Message) -> Message:
    return type(message).FromString(message.SerializeToString())


@dataclass
class _Context:
    remote_id: str
    max_message_bytes: int = 2**62


class LoopbackStream:
    """One stream to a server's stream handler, which runs as a task of its own."""

    def __init__(self, server: LoopbackServer, rpc: str, caller: str):
        self.server, self.rpc = server, rpc
        self._requests: asyncio.Queue = asyncio.Queue()
        self._responses: asyncio.Queue = asyncio.Queue()
        handler = server.handlers[rpc]
        self._context = _Context(caller, server.message_caps.get(rpc, 2**62))
        self._task = asyncio.ensure_future(self._serve(handler, self._context))
        server.streams.add(self)

    async def _serve(self, handler: Any, context: _Context) -> None:
        try:
            await self.server.thawed.wait()  # a frozen server takes the stream and never answers
            async for response in handler(self._incoming(), context):
                await self.server.thawed.wait()  # a frozen server computes, but its replies never leave
                await self.server.replying.wait()  # a held one's leave late (its pings are answered)
                self.server.network.log(self.rpc, "reply", self.server.peer_id, response)
                self._responses.put_nowait(_copy(response))
        except Exception as e:
            text = f"Failed to call handler `{self.rpc}` at {self.server.peer_id}: {e}"
            self._responses.put_nowait(P2PHandlerError(text))
        finally:
            self._responses.put_nowait(None)
            self.server.streams.discard(self)

    async def _incoming(self) -> Any:
        while (request := await self._requests.get()) is not None:
            if isinstance(request, InvalidRequest):
                raise request
            yield request

    async def send(self, message: Message) -> None:
        if self._task.done():
            raise ConnectionResetError(f"the stream to {self.server.peer_id} is closed")
        self.server.network.log(self.rpc, "request", self.server.peer_id, message)
        if (size := message.ByteSize()) > self._context.max_message_bytes:
            limit = self._context.max_message_bytes
            self._requests.put_nowait(
                InvalidRequest(f"a message of {size} bytes exceeds the limit of {limit}")
            )
            return
        self._requests.put_nowait(_copy(message))
        if self.rpc == RPC_INFERENCE:
            self.server.steps_received += 1
            if self.server.steps_received == self.server.dies_at_step:  # it dies with this step in hand
                asyncio.get_running_loop().call_soon(self.server.kill)

    async def receive(self, message_type: type) -> Any:
        item = await self._responses.get()
        if item is None:
            self._responses.put_nowait(None)  # ended for good
            return None
        if isinstance(item, Exception):
            raise item
        return message_type.FromString(item.SerializeToString())

    async def end(self) -> None:
        self._requests.put_nowait(None)

    def close(self) -> None:
        self._task.cancel()

    def cut(self) -> None:
        """The server's process died: its handler stops, the caller's reads end."""
        self._task.cancel()
        self._responses.put_nowait(None)


class LoopbackTransport:
    """How `caller` reaches the network's servers (swarm/p2p/transport.py's Transport)."""

    def __init__(self, network: LoopbackNetwork, caller: str):
        self.network, self.caller = network, caller

    async def open_stream(self, peer_id: str, rpc: str) -> LoopbackStream:
        return LoopbackStream(self.network.reachable(peer_id), rpc, self.caller)

    async def limit_ahead(self, peer_id: str, nbytes: int) -> str | None:
        return None  # no relays in process

    async def call(self, peer_id: str, rpc: str, request: Message, response_type: type) -> Any:
        server = self.network.reachable(peer_id)
        if request.ByteSize() > UNARY_LIMIT:
            raise P2PDaemonError(f"Message size exceeds set limit {UNARY_LIMIT}")
        await server.thawed.wait()  # a frozen server never answers
        call = asyncio.ensure_future(server.handlers[rpc](_copy(request), _Context(self.caller)))
        server.calls.add(call)
        try:
            response = await call
        except asyncio.CancelledError:
            if server.alive:
                raise
            raise ConnectionResetError(f"{peer_id} died during the call") from None
        except Exception as e:
            raise P2PHandlerError(repr(e)) from None
        finally:
            server.calls.discard(call)
        return response_type.FromString(response.SerializeToString())


class _Handlers:
    """What a server's handler registers, by RPC name (swarm/p2p/stream_handlers.py's ProtobufHandlers)."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}
        self.message_caps: dict[str, int] = {}

    async def add_unary_handler(self, name: str, handler: Any, input_type: Any) -> None:
        self.handlers[name] = handler

    async def add_stream_handler(
        self, name: str, handler: Any, input_type: Any, max_message_bytes: int
    ) -> None:
        self.handlers[name] = handler
        self.message_caps[name] = max_message_bytes


class LoopbackServer:
    def __init__(
        self, network: LoopbackNetwork, peer_id: str, config: ServerConfig, spans: HostedSpans, pusher: Pusher
    ):
        self.network, self.peer_id, self.config, self.spans, self.pusher = (
            network,
            peer_id,
            config,
            spans,
            pusher,
        )
        self.handlers: dict[str, Any] = {}
        self.message_caps: dict[str, int] = {}
        self.streams: set[LoopbackStream] = set()
        self.calls: set[asyncio.Future] = set()
        self.alive = True
        self.steps_received = 0  # inference steps sent here by clients
        self.dies_at_step: int | None = None  # set to kill it when that step arrives
        self.thawed = asyncio.Event()
        self.thawed.set()
        self.replying = asyncio.Event()
        self.replying.set()
        self.inference: InferenceService | None = None
        self.status: StatusBoard | None = None

    @property
    def blocks(self) -> tuple[int, int]:
        return self.spans.primary.blocks

    def record(self) -> RemoteSpan:
        return RemoteSpan(self.peer_id, *self.blocks, self.status.snapshot())

    def freeze(self) -> None:
        """Takes requests and never answers (a hung process), until thawed."""
        self.thawed.clear()

    def hold_replies(self) -> None:
        """Computes, and holds its steps' replies back until `replying` is set, but answers pings (a busy
        machine, or a slow link, not a hung one)."""
        self.replying.clear()

    def kill(self) -> None:
        self.alive = False
        for stream in list(self.streams):
            stream.cut()
        for call in list(self.calls):
            call.cancel()
        self.thawed.set()

    async def stop(self) -> None:
        if self.alive:
            self.kill()
        await self.pusher.close()
        await self.spans.stop()


class LoopbackNetwork:
    """Servers of one tiny model, and the transports that reach them."""

    def __init__(self, folder: Path, engine: EngineConfig | None = None):
        self.folder = Path(folder)
        self.model = ModelConfig.from_folder(self.folder)
        # 4096 tokens: 8 sessions of a recurrent family, each charged its states (engine/states.py), fit
        self.engine = engine or EngineConfig(max_cache_tokens=4096, page_size=4, max_batch_wait_ms=0)
        self.servers: dict[str, LoopbackServer] = {}
        self.reports: dict[str, dict[str, str]] = {}  # client -> the faulty servers it reported
        # with `recording` on, every stream message: (rpc, "request" or "reply", the server, a copy)
        self.recording = False
        self.wire: list[tuple[str, str, str, Message]] = []
        self._names = itertools.count()

    async def add_server(
        self, blocks: tuple[int, int], fault: str | None = None, name: str | None = None, **config: Any
    ) -> LoopbackServer:
        """A server of `blocks`, built as `corolla server` builds one; `config`: ServerConfig fields (its
        `engine` defaults to the network's)."""
        peer_id = name or f"server{next(self._names)}-{blocks[0]}-{blocks[1]}"
        engine = config.pop("engine", self.engine)
        config = ServerConfig(
            model=str(self.folder), blocks=blocks, engine=engine, step_timeout=30.0, **config
        )
        adapters = adapter_names(config.adapters)
        device, dtype = compute_settings(config, self.model)
        loader = SpanLoader(
            self.folder,
            self.model,
            dtype,
            engine,
            config.session_timeout,
            pass_delay=config.simulate_slow_ms / 1000,
            adapters=adapters,
            quantize=config.quantize,
            fault=Fault.parse(fault) if fault else None,
            device=device,
        )
        spans = HostedSpans(PREFIX, loader.load, frozenset(name for name, _ in adapters))
        await spans.start(blocks)
        server = LoopbackServer(self, peer_id, config, spans, Pusher(self.transport(peer_id), PREFIX))
        wire, num_blocks = self.model.wire, self.model.num_hidden_layers
        server.inference = InferenceService(
            spans, config, wire.width, server.pusher, num_blocks, wire.hidden_size, wire
        )
        passes = PassService(spans, config, wire.width, wire.hidden_size, wire)
        fingerprint = self.model.fingerprint()
        compute = Compute("float32", 1e3, device_info(device))
        server.status = StatusBoard(spans, server.inference, config, "test", compute, None, fingerprint)
        server.status.state = ServerState.ONLINE
        registry = _Handlers()
        await TransformerConnectionHandler(server.inference, passes, server.status).register(registry)
        server.handlers = registry.handlers
        server.message_caps = registry.message_caps
        self.servers[peer_id] = server
        return server

    def log(self, rpc: str, direction: str, server: str, message: Message) -> None:
        if self.recording:
            self.wire.append((rpc, direction, server, _copy(message)))

    def reachable(self, peer_id: str) -> LoopbackServer:
        server = self.servers.get(peer_id)
        if server is None or not server.alive:
            raise P2PDaemonError(f"failed to connect to {peer_id}: no such peer is listening")
        return server

    def transport(self, caller: str) -> LoopbackTransport:
        return LoopbackTransport(self, caller)

    async def read_spans(self, tally: Counter) -> list[RemoteSpan]:
        """What the DHT would hold: every server's record, the dead ones' until they expire."""
        return [server.record() for server in self.servers.values()]

    def client(self, name: str = "client", **config: Any) -> Client:
        """A client of this network (not started: no background refresh); `config`: ClientConfig fields.
        What it would report to the DHT (servers caught lying) lands in `reports[name]`."""
        settings = ClientConfig(**{"routing_timeout": 5.0, "ban_time": 60.0, **config})

        async def report(faulty: dict[str, str]) -> bool:
            self.reports[name] = faulty
            return True

        transport = self.transport(name)
        return Client(settings, PREFIX, ServedModel.of(self.model), transport, self.read_spans, report)

    async def close(self) -> None:
        await asyncio.gather(*(server.stop() for server in self.servers.values()))


class LoopbackSwarm:
    """Servers of a network on a loop thread of their own, and models (clients) of them on that loop:
    a local swarm in one process, for synchronous tests (`model.generate`)."""

    def __init__(self, folder: Path, spans: list[tuple[int, int]], engine: EngineConfig | None = None):
        self.runtime = LoopThread("loopback")
        self.network = LoopbackNetwork(folder, engine)
        self.servers = [self.runtime.run(self.network.add_server(span)) for span in spans]
        self._models: list[DistributedModelForCausalLM] = []

    def add_server(self, blocks: tuple[int, int], **kwargs: Any) -> LoopbackServer:
        server = self.runtime.run(self.network.add_server(blocks, **kwargs))
        self.servers.append(server)
        return server

    def model(
        self, name: str | None = None, tuning_mode: str | None = None, pre_seq_len: int = 0, **config: Any
    ) -> DistributedModelForCausalLM:
        """A model of this swarm (`config`: ClientConfig fields), closed with the swarm."""
        from corolla.client.model import DistributedModelForCausalLM
        from corolla.client.training.ptune import PromptTuning
        from corolla.decoding.speculator import Speculator
        from corolla.models.head import ModelHead
        from corolla.models.source import resolve_model

        source = resolve_model(str(self.network.folder))
        client = self.network.client(name or f"client{len(self._models)}", **config)
        speculation = client.config.speculation
        head = ModelHead.load(source.path, torch.float32)
        speculator = (
            None
            if speculation is None
            else Speculator.create(speculation, self.network.model, source.path, head)
        )
        ptune = None
        if tuning_mode is not None:
            blocks = self.network.model.num_hidden_layers
            ptune = PromptTuning(tuning_mode, pre_seq_len, blocks, head.embed_tokens)
        runtime = self.runtime
        model = DistributedModelForCausalLM(
            source, self.network.model, head, client, runtime, ptune, speculator
        )
        self._models.append(model)
        return model

    def close(self) -> None:
        for model in self._models:
            model.head_batcher.shutdown()
            if model.speculator is not None:
                model.speculator.shutdown()
            self.runtime.run(model.client.shutdown())
        self.runtime.run(self.network.close())
        self.runtime.stop()

    def __enter__(self) -> LoopbackSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def generate_together(
    model: Any, servers: list[LoopbackServer], prompts: list[torch.Tensor], new_tokens: int
):
    """Every prompt's greedy generation at once, each in a session of its own; also how many sessions each
    of `servers` held once every generation had its first token (all of them, if they really overlapped,
    so that the servers batched their steps)."""
    everyone_started = asyncio.Barrier(len(prompts))
    held: list[int] = []

    async def one(ids: torch.Tensor) -> torch.Tensor:
        new = []
        async for tokens in model.agenerate(ids, max_new_tokens=new_tokens):
            new.append(tokens[:, None])
            if len(new) == 1 and await asyncio.wait_for(everyone_started.wait(), 60) == 0:
                held.extend(server.status.snapshot().num_sessions for server in servers)
        return torch.cat([ids, *new], dim=1)

    return await asyncio.gather(*(one(ids) for ids in prompts)), held
