"""The swarm as it grows and fails: route choice, DHT traffic, failover after a SIGKILL or a SIGSTOP, and
the swarm simulator's calibration, scale and agreement with a real swarm."""
