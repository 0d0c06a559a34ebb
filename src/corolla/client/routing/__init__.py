"""Who serves what: the servers' records and pings, round trips and speeds, bans, and the router that picks
the cheapest chain; `SwarmAccess` holds them together."""
