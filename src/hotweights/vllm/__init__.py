"""hotweights' vLLM side: the one package that touches vLLM's internals.

- :mod:`.compat`: the version gate (the vLLM lines supported, the installed version and device);
- :mod:`.introspect`: what is read of an engine object; :mod:`.patches`: its patches, undone by ``detach``;
- :mod:`.rpc`: worker methods by name; :mod:`.fixes`: the mends of vLLM's reload; :mod:`.nccl_gloo`: NCCL over gloo;
- :mod:`.liveness`: the trainer's watch on an engine's processes;
- :mod:`.expected`: what an engine serves, read from its checkpoint;
- :mod:`.worker`: what runs inside vLLM's workers (the install session, staging, the direct setter);
- :mod:`.plugin`: hotweights' vLLM plugin (mends, the ``hotweights`` weight-transfer backend).
"""
