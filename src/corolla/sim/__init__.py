"""Simulated swarms (issue 31): corolla's own decision code under a simulated clock (sim/simulation.py), the
scenarios it runs (sim/scenarios/*.json, sim/scenario.py) and what it reports (sim/report.py)."""
