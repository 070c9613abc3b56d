"""One federated client: its own state (shard, c^k, sampler position) apart from the replica that trains it, and
the client face through which a plug's mechanism acts where the clients run."""
