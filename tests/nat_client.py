"""A client run inside a namespace of the NAT harness (tests/integration/test_nat.py, bench/wan/nat.py):
greedy tokens of a prompt through the swarm, when they came, and how it was connected to each peer at the
end (directly, or only through a relay), printed as JSON.

    python tests/nat_client.py MODEL_PATH HOST '[token ids]' NEW_TOKENS INITIAL_PEER...

With NAT_CLIENT_PAUSE_AT=N and NAT_CLIENT_RESUME=PATH set, it prints "paused" after N new tokens and waits,
its session open, until PATH exists (the test meanwhile kills a relay, or lets a router forget the flows).
NAT_CLIENT_PUSH=0: servers do not push their outputs to the next; every step goes to each server from here.
NAT_CLIENT_DHT_PREFIX: the servers' --dht-prefix (default: the model's).
"""

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from corolla.client.model import DistributedModelForCausalLM
from corolla.launch.local import client_config

logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
logging.getLogger("corolla").setLevel(os.environ.get("NAT_CLIENT_LOG_LEVEL", "INFO"))  # failovers, moves
path, host, prompt, new_tokens, *peers = sys.argv[1:]
pause_at = int(os.environ.get("NAT_CLIENT_PAUSE_AT", "0"))
use_push = os.environ.get("NAT_CLIENT_PUSH", "1") == "1"
arrivals: list[float] = []
resumed: list[float] = []
# wall-clock time of the first token (bench/wan/nat.py compares it with server logs)
first_at: list[float] = []


def arrived(_token) -> None:
    arrivals.append(time.perf_counter())
    if not first_at:
        first_at.append(time.time())
    if len(arrivals) == pause_at:
        print("paused", flush=True)
        while not Path(os.environ["NAT_CLIENT_RESUME"]).exists():
            time.sleep(0.1)
        resumed.append(time.perf_counter())


launched = time.time()
with DistributedModelForCausalLM.from_pretrained(
    path,
    config=client_config(host, peers, use_push=use_push, dht_prefix=os.environ.get("NAT_CLIENT_DHT_PREFIX")),
) as model:
    ready_at = time.time()
    started = time.perf_counter()
    out = model.generate(torch.tensor([json.loads(prompt)]), max_new_tokens=int(new_tokens), streamer=arrived)
    peers = model.runtime.run(model.client.p2p.list_peers())
decode = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else None
# the addresses of this client's connections to each peer: a relayed one has "/p2p-circuit"
connections = {str(peer.peer_id): [str(address) for address in peer.addrs] for peer in peers}
result = {
    "tokens": out[0].tolist(),
    "launched_at": launched,
    "ready_at": ready_at,  # the model's local part loaded and the swarm joined
    "first_token_s": arrivals[0] - started,
    "first_token_at": first_at[0],
    "decode_tokens_per_s": decode,
    "connections": connections,
    # after a pause: from resuming to the next token (a failover's replay, when a path broke meanwhile)
    "resumed_to_next_token_s": arrivals[pause_at] - resumed[0]
    if resumed and len(arrivals) > pause_at
    else None,
}
print(json.dumps(result))
