"""Which install options combine, decided in one place: :class:`InstallerOptions`.

An installer's options are checked once, when it is built (:meth:`InstallerOptions.validate`, against what its wire
and transport can do), and each install's own options once per call (:meth:`InstallerOptions.check_call`). Nothing
else in the trainer decides whether two options go together; the engine's workers check again what reaches them
from a caller they cannot trust.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hotweights.core.errors import EngineNotSupportedError
from hotweights.core.pipeline import MAX_DEPTH

__all__ = ["CommitMode", "InstallMethod", "InstallerOptions", "PathAbilities", "VerifyOption"]

InstallMethod = Literal["auto", "direct", "reload", "aside"]
"""How the workers install: ``auto`` (the direct setter where its plan proves it safe, else vLLM's layerwise
reload), ``direct``, ``reload``, or ``aside`` (vLLM's layerwise reload into a twin of the model while the engine
serves, swapped in at the commit: generation stops only for the swap; CPU engines; about one more copy of the model
in the engine until the commit; see ``docs/async-rl.md``)."""
CommitMode = Literal["atomic", "streaming"]
"""``atomic``: stage everything, then install (nothing written until then). ``streaming``: install bucket by
bucket (memory bounded by the bucket; a failed transfer leaves a partial update and the engine fails closed)."""
VerifyOption = bool | Literal["strict"] | None
"""``install(verify=...)``: True, False, ``"strict"`` (any tensor not read back fails closed) or None (the
installer's default)."""


@dataclass(frozen=True)
class PathAbilities:
    """What an install path can do, as its wire and transport allow: the facts the option rules are checked
    against."""

    #: Name used in refusals (the adapter's label).
    label: str
    #: The engine's workers can read the live parameters back after a commit (``verify``).
    reads_back: bool = False
    #: Delta installs reach a copy kept on the engine's side.
    deltas: bool = False
    #: The workers can release kept shm segments (the worker extension's ``release_segments``).
    releases_segments: bool = False


@dataclass(frozen=True)
class InstallerOptions:
    """The options of an install path that runs the install session (all checked by :meth:`validate`).

    Args:
        install_method: see :data:`InstallMethod`.
        commit: see :data:`CommitMode`.
        verify: default of ``install(verify=...)``.
        bucket_bytes: bytes per bucket (None: the transport's preferred size, capped by free memory).
        rpc_timeout: seconds each call into the workers may take (None: no limit).
        buckets_in_flight: buckets packed while earlier ones are staged (None: the transport's
            ``buckets_in_flight``, 2 for shm and bytes; 1: one bucket at a time). Each is a packed bucket in memory.
    """

    install_method: InstallMethod = "auto"
    commit: CommitMode = "atomic"
    verify: bool = False
    bucket_bytes: int | None = None
    rpc_timeout: float | None = 300.0
    buckets_in_flight: int | None = None

    def validate(self, can: PathAbilities, *, keeps_segments: bool = False) -> None:
        """Every rule on which of these options combine, on a path that can do ``can`` (``keeps_segments``: the
        transport keeps one shm segment per bucket across installs). Raises ``ValueError`` naming the rule."""
        if self.install_method not in ("auto", "reload", "direct", "aside"):
            raise ValueError(
                f"install_method must be 'auto', 'reload', 'direct' or 'aside', not {self.install_method!r}"
            )
        if self.install_method == "aside" and self.commit != "atomic":
            raise ValueError(
                "install_method='aside' builds the update aside and swaps it in at the commit: it is an atomic "
                "commit; use commit='atomic' (the default)"
            )
        if self.commit not in ("atomic", "streaming"):
            raise ValueError(f"commit must be 'atomic' or 'streaming', not {self.commit!r}")
        if self.bucket_bytes is not None and self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive (or None for the default), got {self.bucket_bytes}")
        if self.buckets_in_flight is not None and not 1 <= self.buckets_in_flight <= MAX_DEPTH:
            raise ValueError(
                f"buckets_in_flight must be between 1 and {MAX_DEPTH} (None for the transport's default), "
                f"got {self.buckets_in_flight}"
            )
        if self.verify:
            self.check_call(True, False, can)
        if keeps_segments and not can.releases_segments:
            raise ValueError(
                f"kept shm segments are released through hotweights' worker extension, which the {can.label} path "
                "cannot reach; use a plain make_transport('shm') here, or VLLMMultiprocessAdapter"
            )
        if keeps_segments and self.commit == "streaming" and self.install_method != "direct":
            raise ValueError(
                "a shm transport with keep_segments=True keeps one segment per bucket when vLLM's layerwise reload "
                "may still read a bucket after its stage, which defeats commit='streaming' (memory bounded by the "
                "bucket), and install_method='auto' may fall back to that reload: use install_method='direct' (one "
                "segment for every bucket), or a plain shm transport"
            )

    def check_call(self, verify: VerifyOption, delta: bool, can: PathAbilities) -> bool:
        """One install's ``verify`` and ``delta`` against these options: whether it reads back (``verify=None``:
        this installer's default). Raises ``ValueError`` (nothing is written yet) naming what does not combine, or
        :class:`EngineNotSupportedError` for a delta this path cannot install."""
        if verify not in (None, True, False, "strict"):
            raise ValueError(f'verify must be True, False, "strict" or None, not {verify!r}; nothing was written')
        wanted = bool(self.verify if verify is None else verify)
        if wanted and not can.reads_back:
            raise ValueError(
                f"the {can.label} adapter cannot read the engine's parameters back, so verify=True is refused; "
                "nothing was written. Read-back needs the install session in the engine: an in-process engine, or one "
                "started with the worker extension (what hotweights.install picks there)."
            )
        if wanted and self.commit == "streaming":
            raise ValueError("verify=True needs commit='atomic': a streaming install keeps no copy of what it wrote")
        if wanted and self.install_method == "aside":
            raise ValueError(
                "verify=True reads back what was staged, which install_method='aside' does not keep (it builds the "
                "model's new layers instead); nothing was written. Use install_method='reload' to verify."
            )
        if delta:
            refusal = self._delta_refusal(can)
            if refusal is not None:
                raise EngineNotSupportedError(f"{refusal}; nothing was written. Install with delta=False.")
            if wanted:
                raise ValueError(
                    "verify=True and delta=True do not combine yet (a delta install reinstalls only the "
                    "touched blocks); nothing was written. Install with one of them."
                )
        return wanted

    def _delta_refusal(self, can: PathAbilities) -> str | None:
        if not can.deltas:
            return f"the {can.label} adapter does not install deltas"
        if self.commit != "atomic":
            return (
                "delta installs need commit='atomic': a streaming install writes while it receives, so the workers "
                "keep no copy of what they serve"
            )
        if self.install_method == "aside":
            return "delta installs rebuild tensors from the workers' copy, which install_method='aside' does not keep"
        return None
