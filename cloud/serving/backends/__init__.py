"""Model servers behind the gateway: served models backed by an OpenAI-compatible server (``openai`` backends).

``config``: the static backends file (``TIERLINE_CLOUD_BACKENDS``); ``pool``: a replica pool per backend (least
outstanding requests, a breaker per endpoint, active re-admission probes, per-endpoint metrics); ``upstream``: the
gateway's side of a request to one (admission, billing from the upstream's usage, SSE relay, failover before the
first byte); ``http1``: the lean HTTP/1.1 client the requests to the upstream servers go through. See
docs/backends.md.
"""
