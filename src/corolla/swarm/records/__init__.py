"""What the DHT holds: servers' records in a tree of cells, models, reports, their checks."""
