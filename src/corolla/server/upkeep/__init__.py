"""What a server keeps doing while it serves: announcing, measuring links, rebalancing, its reachability."""
