"""What several benchmarks share: the stamped result (stamp), the environment and common flags (env), chat
prompts (prompts), timers and percentiles (timing), random checkpoints of real shapes (checkpoints), a
local swarm and its client (swarm), an emulated internet (wan), and docs/benchmarks.md (docs)."""
