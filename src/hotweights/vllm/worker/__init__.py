"""What runs inside vLLM's worker processes: the install session (:mod:`.session`), staging, the direct
setter (:mod:`.setter`), read-back, streaming, the workers' delta copy (:mod:`.kept_base`), worker
operations (:mod:`.ops`), the worker extension and the weight-transfer backend."""
