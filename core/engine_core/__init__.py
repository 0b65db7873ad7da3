"""The engine-core process, its client and the per-step messages between them.

``openinfer serve`` runs the scheduler, KV manager and model runner in an engine-core process
(``process``) and HTTP/gRPC in API-server processes whose engine is an ``EngineCoreClient``
(``client``) — an ``EngineHandle`` like any other. One message per engine step crosses the
process boundary (``protocol``); on each side, entries merge into per-request ``RequestSlot``s
(``slots``). ``worker`` defines the per-GPU worker interface the core drives. Submodules are
imported on use (``import openinfer`` does not pull in ZMQ).
"""
