"""A client run inside a namespace of the NAT harness (tests/integration/test_nat.py): greedy tokens of a
prompt through the swarm, printed as JSON.

    python tests/nat_client.py MODEL_PATH HOST '[token ids]' NEW_TOKENS INITIAL_PEER...
"""

import json
import sys

import torch

from corolla.client.model import DistributedModelForCausalLM
from corolla.config import ClientConfig, SwarmConfig

path, host, prompt, new_tokens, *peers = sys.argv[1:]
swarm = SwarmConfig(initial_peers=tuple(peers), host=host, nat_port_map=False, client_mode=True)
with DistributedModelForCausalLM.from_pretrained(path, config=ClientConfig(swarm=swarm)) as model:
    out = model.generate(torch.tensor([json.loads(prompt)]), max_new_tokens=int(new_tokens))
print(json.dumps({"tokens": out[0].tolist()}))
