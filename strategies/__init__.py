"""The algorithms: one module per strategy (server half), its site half in ``strategies.mods``.

Strategies, each a Flower Message-API strategy driven by ``flplatform.start``:
``local_sgd`` (FedAvg, FedAvgM, periodic averaging, with optional codecs), ``delayed``
(delayed compensated updates, DTS), ``fetchsgd`` and ``sketched_sgd`` (sketched
aggregation; what they share is ``sketched_common``), and ``flower_adapter`` (Flower's own
strategies under the round engine); ``sparse_sync`` sends sites only the coordinates that
changed since the version they hold.

Their maths, importing no Flower: ``aggregation`` (streamed weighted averaging),
``compensation`` (the delayed strategy's period bookkeeping), ``codecs`` (upload codecs and
error feedback), ``count_sketch``, ``sketch_feedback``, ``top_k`` (selection and wire index
types) and ``validation`` (checks on what a site sends back).
"""
