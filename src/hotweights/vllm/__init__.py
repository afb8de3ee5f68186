"""hotweights' vLLM side: the one package that touches vLLM's internals.

- :mod:`.compat`: every difference between vLLM versions, and every patch of vLLM (recorded, reversible);
- :mod:`.liveness`: the trainer's watch on an engine's processes;
- :mod:`.expected`: what an engine serves, read from its checkpoint;
- :mod:`.worker`: what runs inside vLLM's workers (the install session, staging, the direct setter);
- :mod:`.plugin`: hotweights' vLLM plugin (mends, the ``hotweights`` weight-transfer backend).
"""
