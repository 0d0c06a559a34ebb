"""The DHT view shared by clients and servers: announcements, span discovery and routing."""
