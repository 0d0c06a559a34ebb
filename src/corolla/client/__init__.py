"""The client, in layers: its folders, lowest first (rpc, routing, chain, checks, generation and training,
hf), then the composition root (client.py) and the facade users import (model.py). Each imports only
those before it (tools/imports.py checks); docs/architecture.md says what each holds."""
