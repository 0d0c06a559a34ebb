"""corolla's benchmarks, run from the repository root as modules: `python -m bench.GROUP.NAME`.

Each group (decode, models, swarm, trust, wan) holds the scripts that measure one side of corolla; lib/
holds what several of them share. Importing this package sets the environment every benchmark runs
under (lib/env.py's DEFAULTS, the Hugging Face hub offline: the models are local) before a script
imports torch or transformers; a value already set wins.
"""

from bench.lib import env

env.apply(env.DEFAULTS)
