"""The rollout job: generate groups with an engine (one file per backend, declared in ``config/registries.py``)
and an agent loop, score them, seal them into shards, and switch weight versions as the trainer publishes them."""
