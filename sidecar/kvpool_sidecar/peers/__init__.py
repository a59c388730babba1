"""Peer serving and fetching: one sidecar reads another's cached pages with NIXL (issue 66).

A sidecar started with ``--peer-port`` serves its pool to peers (:mod:`.server`); any sidecar with a
cluster key fetches from them (:mod:`.client`). The control channel is TCP (:mod:`.protocol`): a peer first
proves the cluster key (``--transfer-key-file``) by HMAC challenge-response, and the server proves it back;
nothing else (no agent metadata, no page) is exchanged before that. The bytes move with a NIXL agent
(:mod:`.agent`, UCX: a single kernel copy between processes of one machine, RDMA between nodes): each sidecar
registers its pool's pages once, the reader READs the source's held pages into fresh pages of its own pool and
publishes them only once the read completed. :mod:`.runs` batches contiguous pages into larger descriptors.
"""
