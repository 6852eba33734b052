"""Every Redis call, grouped by what it serves (no module imports one that imports it).

* the request log and its reads: ``log`` (create, claim, append, end, cancel, park,
  read), ``batcher`` (a worker's writes), ``commit`` (committed reads), ``outbox`` (the
  endings, for the recorder);
* readers: ``readers`` (their leases, presence and stream tokens), the tail: ``tail``
  (``LogTailer``), ``shard`` (one shard's reads), ``mailbox`` (what a reader is handed:
  ``Subscription``), ``local`` (the node's in-memory feed);
* a running request's owner: ``owner`` (its verdicts and its control channel);
* the workers' queue and liveness: ``queue``, ``groups``, ``heartbeats``, ``liveness``,
  ``registry`` (the models workers declare);
* admission and idempotency: ``admission``;
* the edge: ``keys`` (every key), ``scripts`` (every Lua script, each with its typed
  face), ``replies`` (reply decoding), ``pool`` (clients, error names, the retry policy).
"""
