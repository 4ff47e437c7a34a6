"""The load generator: what load to offer, how it is sent, what the client saw."""
