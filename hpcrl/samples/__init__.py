"""Samples between the jobs: the shard schema, the writer (seal, commit, recover) and the reader (poll manifests,
verify, cursor), and the skipped-shard log."""
