"""NATS plumbing every service shares: connecting and provisioning JetStream (``nats_util``),
reading and writing a request's stream (``stream_reader``, ``stream_writer``), the prefix-cache service's
client (``kv_cache_client``) and the JetStream pull consumer loop (``pull``)."""
