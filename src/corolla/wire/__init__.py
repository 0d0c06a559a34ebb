"""What crosses the network: typed request metadata, tensors and DHT records (design.md section 3)."""
