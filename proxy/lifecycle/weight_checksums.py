"""`WeightChecksums`: vLLM's own weight digests (`/weight_checker`) as evidence, and which calls zero weights.

`weight_checksums` says when they are read, always inside the transition they verify and with their own deadline:
`off`; `reloads` (the checkpoint's digests, taken from a vLLM this proxy saw start, compared after every reload);
`always` (also around a level-1 sleep and each update session). A digest that cannot be read is `unavailable`,
never a failure. vLLM's endpoint, the CPU build's empty digests and the cost: docs/verification.md, docs/design.md.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import time
from typing import Any

from ..config import Settings
from ..errors import UpstreamError
from ..observe.metrics import EngineMetrics
from ..upstream.vllm_client import VllmClient
from .verdict import Check, CheckName, CheckResult

log = logging.getLogger("lifeguard.lifecycle")

Digests = dict[str, str]

WEIGHT_CHECKER = "/weight_checker"
#: The worker method vLLM's `reset` action runs; also callable through `/collective_rpc`.
RESET_RPC = "reset_weights"
#: The digest of a tensor with no bytes: vLLM-for-CPU leaves its repacked linear layers' parameters empty.
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()
#: How many tensor names an error message lists before "and N more".
_NAMED = 8


class ChecksumMode(enum.StrEnum):
    OFF = "off"
    RELOADS = "reloads"
    ALWAYS = "always"


def _json(body: bytes) -> Any:
    try:
        return json.loads(body or b"null")
    except (ValueError, RecursionError):
        return None


def resets_weights(path: str, body: bytes) -> bool:
    """Whether a control call to `path` zeroes the weights: `/weight_checker {"action": "reset"}`. Any other action
    (`checksum`, `compare`) only reads them."""
    payload = _json(body) if path == WEIGHT_CHECKER else None
    return isinstance(payload, dict) and payload.get("action") == "reset"


def reloads_checkpoint(method: str | None, body: bytes) -> bool:
    """Whether a `/collective_rpc` reloads the checkpoint vLLM was started with: vLLM's `reload_weights` with no
    `weights_path` or `weights_iterator` (`GPUModelRunner.reload_weights`); one given a path loads other weights
    on purpose, and a trainer's own reload methods are theirs to define."""
    if method != "reload_weights":
        return False
    payload = _json(body)
    if not isinstance(payload, dict) or payload.get("args"):
        return False
    kwargs = payload.get("kwargs") or {}
    return isinstance(kwargs, dict) and not kwargs.get("weights_path") and kwargs.get("weights_iterator") is None


def mismatches(now: Digests, baseline: Digests) -> list[str]:
    """The tensors whose digest differs, or that only one side has: vLLM's own `compare`."""
    return sorted(key for key in now.keys() | baseline.keys() if now.get(key) != baseline.get(key))


def _combined(digests: Digests) -> str:
    """One digest of every tensor's: equal exactly when every tensor's is (vLLM's `compare` in one value)."""
    return hashlib.sha256(json.dumps(sorted(digests.items())).encode()).hexdigest()


def named(keys: list[str]) -> str:
    more = f" and {len(keys) - _NAMED} more" if len(keys) > _NAMED else ""
    return ", ".join(keys[:_NAMED]) + more


def parse_checksums(payload: object) -> Digests:
    """The digests in vLLM's `checksum` answer; ValueError saying what is wrong with it."""
    checksums = payload.get("checksums") if isinstance(payload, dict) else None
    if not isinstance(checksums, dict) or not checksums:
        raise ValueError(f"no 'checksums' object in the answer: {payload!r:.200}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in checksums.items()):
        raise ValueError("a checksum that is not a string")
    return dict(checksums)


class WeightChecksums:
    def __init__(self, settings: Settings, client: VllmClient, metrics: EngineMetrics) -> None:
        self.mode = ChecksumMode(settings.weight_checksums)
        self._timeout_s = settings.weight_checksum_timeout_s
        self._client = client
        self._metrics = metrics
        # The checkpoint vLLM was started with, and when its checksums were taken.
        self.checkpoint: Digests | None = None
        self.checkpoint_at: float | None = None
        # The client's count of calls nothing answered (refused or reset) when vLLM last answered healthy: one since
        # means no process served at its address for a while, and whatever answers next is a new process.
        self._unanswered_seen = client.unanswered_calls
        # The weights are known to be the checkpoint's, and its checksums are not taken yet.
        self._checkpoint_window = False
        self._before_sleep: Digests | None = None
        # The same as one digest (kept in the state file): all a restarted proxy has to check a wake with.
        self.before_sleep_digest: str | None = None
        self._before_update: Digests | None = None
        self.last: Check | None = None
        self.last_at: float | None = None
        # One digest of the last checksums read, and how many were read: the weight version binds the one read after
        # its change (weight_version.py).
        self.last_digest: str | None = None
        self.reads = 0
        self.last_seconds: float | None = None

    # ----- when the weights are the checkpoint's
    def engine_answers(self) -> None:
        """vLLM answered healthy. After a call nothing answered (refused or reset: any call's, a reconcile round's or a
        lifecycle call's that met the death first, seed 399 of make chaos-engines) it is a process started since,
        holding its checkpoint. A /health that merely answered late proves nothing of the kind (the record then
        assumes a restart for its own safety, and stale weights are safe; a wrong checkpoint would fail every later
        reload)."""
        if self._new_process():
            self._checkpoint_window = True

    def _new_process(self) -> bool:
        """Whether a call nothing answered came since the last look: whatever answers now is a process started since,
        and the last process's checksums are not its own (it may have loaded other files): they are forgotten, and a
        reload stays unchecked until this one's are read (chaos-engines seed 7: a window a weight change closed first
        left the last process's, and every later reload of the swapped engine 'did not produce the checkpoint')."""
        seen, self._unanswered_seen = self._unanswered_seen, self._client.unanswered_calls
        if seen == self._unanswered_seen:
            return False
        self.checkpoint = self.checkpoint_at = None
        return True

    async def before_weights_change(self) -> None:
        """The weights are about to change (a sleep that may discard them, a session that writes them, a reload): a new
        process's checkpoint not read yet is read now, or never (a swapped engine restarted between two busy rounds
        and its level-2 sleep closed the window, seed 399 of make chaos-engines)."""
        self.engine_answers()
        if self.checkpoint_due:
            await self.take_checkpoint()

    def weights_changed(self) -> None:
        """The weights were loaded, written, discarded or zeroed through the proxy: whatever they are now is not known
        to be the checkpoint."""
        self._checkpoint_window = False
        self._before_sleep = self.before_sleep_digest = None

    @property
    def checkpoint_due(self) -> bool:
        """Whether the checkpoint's checksums should be taken now (on an engine RUNNING with current weights)."""
        return self.mode is not ChecksumMode.OFF and self._checkpoint_window

    async def take_checkpoint(self) -> None:
        digests, problem = await self._take()
        if digests is None:
            log.warning("the checkpoint's weight checksums could not be read: %s", problem,
                        extra={"event": "weight_checksums_unavailable"})  # fmt: skip
            self._checkpoint_window = False  # not asked again each round; the next start tries again
            return
        self.checkpoint, self.checkpoint_at = digests, time.time()
        self._checkpoint_window = False
        log.info("the checkpoint's weight checksums taken: %d tensors", len(digests),
                 extra={"event": "weight_checksums_checkpoint", "tensors": len(digests)})  # fmt: skip

    # ----- the comparisons
    async def before_sleep(self, level: int | None) -> None:
        """A sleep from RUNNING with current weights: a level-1 sleep keeps them (offloaded), so take them now."""
        self._before_sleep = self.before_sleep_digest = None
        await self.before_weights_change()
        if self.mode is ChecksumMode.ALWAYS and level == 1:
            self._before_sleep, problem = await self._take()
            if self._before_sleep is None:
                log.warning("the weight checksums before the sleep could not be read: %s; its wake is not compared",
                            problem, extra={"event": "weight_checksums_unavailable"})  # fmt: skip
                return
            self.before_sleep_digest = _combined(self._before_sleep)

    @property
    def wake_check_due(self) -> bool:
        """Whether the next full wake is compared with checksums taken before the sleep."""
        return self.before_sleep_digest is not None and self.mode is ChecksumMode.ALWAYS

    def remember_before_sleep(self, digest: str) -> None:
        """A restarted proxy's state file kept the last proxy's `before_sleep_digest`."""
        self.before_sleep_digest = digest

    async def check_wake(self) -> Check | None:
        """After the full wake from a level-1 sleep: the weights are those before the sleep, bit for bit (tensor by
        tensor, or, for a restarted proxy, by the one digest its state file kept)."""
        before, self._before_sleep = self._before_sleep, None
        remembered, self.before_sleep_digest = self.before_sleep_digest, None
        if before is not None:
            return self._report(await self._compare(before, "before the sleep"))
        if remembered is None or self.mode is not ChecksumMode.ALWAYS:
            return None
        now, problem = await self._take()
        if now is None:
            return self._report(Check(CheckName.WEIGHTS, CheckResult.UNAVAILABLE, problem or "unreadable"))
        if _combined(now) != remembered:
            detail = (f"the checksums of the {len(now)} weight tensors differ from those taken before the sleep (kept "
                      "by the last proxy as one digest: which tensors differ, it does not say)")  # fmt: skip
            return self._report(Check(CheckName.WEIGHTS, CheckResult.FAIL, detail))
        return self._report(Check(CheckName.WEIGHTS, CheckResult.PASS, f"{len(now)} tensors match the checksums "
                                  "taken before the sleep (kept by the last proxy)"))  # fmt: skip

    async def unseen_wake_mismatched(self) -> bool:
        """vLLM woke with no wake this proxy verified (a proxy restart cut it, or it was sent to vLLM directly): whether
        its weights are not those before the sleep, by the checksums taken then (the state file keeps them across a
        restart). True: hold them until weights are loaded again, as after a wake the proxy made."""
        check = await self.check_wake()
        if check is None or check.result is not CheckResult.FAIL:
            return False
        log.warning("vLLM woke without a wake this proxy verified, and its weights are not those before the sleep: %s; "
                    "inference held until weights are loaded again", check.detail,
                    extra={"event": "unseen_wake_weights_mismatch"})  # fmt: skip
        return True

    async def check_reload(self) -> Check | None:
        """After a reload of the checkpoint: the weights are the checkpoint's."""
        if self.mode is ChecksumMode.OFF:
            return None
        self._new_process()  # one started since the reload was sent: not this checkpoint's to judge
        if self.checkpoint is None:
            why = "the checkpoint's checksums are not known (this proxy has not seen vLLM start with them)"
            return self._report(Check(CheckName.WEIGHTS, CheckResult.UNAVAILABLE, why))
        return self._report(await self._compare(self.checkpoint, "the checkpoint's"))

    async def session_starting(self, weights_current: bool) -> None:
        """A weight update session opens on current weights: what it must change."""
        self._before_update = None
        await self.before_weights_change()
        if self.mode is ChecksumMode.ALWAYS and weights_current:
            self._before_update, _ = await self._take()

    async def session_finished(self) -> None:
        """The session wrote the model's weights: their checksums are the new baseline; a session that changed no
        tensor is reported (a warning and `lifeguard_weight_updates_unchanged`), not failed (docs/verification.md)."""
        before, self._before_update = self._before_update, None
        if self.mode is not ChecksumMode.ALWAYS:
            return
        after, problem = await self._take()
        if after is None:
            self._report(Check(CheckName.WEIGHTS, CheckResult.UNAVAILABLE, problem or "unreadable"))
            return
        if before is not None and not mismatches(after, before):
            self._metrics.weight_update_unchanged()
            detail = f"the weight update session changed none of the {len(after)} tensors"
            log.warning(detail, extra={"event": "weight_update_unchanged", "tensors": len(after)})
            self._report(Check(CheckName.WEIGHTS, CheckResult.PASS, detail, {"changed": 0}))
            return
        changed = len(mismatches(after, before)) if before is not None else None
        self._report(Check(CheckName.WEIGHTS, CheckResult.PASS, "new baseline taken", {"changed": changed}))

    async def _compare(self, expected: Digests, what: str) -> Check:
        now, problem = await self._take()
        if now is None:
            return Check(CheckName.WEIGHTS, CheckResult.UNAVAILABLE, problem or "unreadable")
        differ = mismatches(now, expected)
        if differ:
            detail = f"{len(differ)} of {len(expected)} weight tensors differ from {what} checksums: {named(differ)}"
            return Check(CheckName.WEIGHTS, CheckResult.FAIL, detail, differ)
        empty = sum(1 for digest in now.values() if digest == EMPTY_DIGEST)
        detail = f"{len(now)} tensors match {what} checksums"
        if empty:
            detail += f" ({empty} of them empty in vLLM, as vLLM-for-CPU leaves repacked linear layers: no evidence)"
        return Check(CheckName.WEIGHTS, CheckResult.PASS, detail)

    async def _take(self) -> tuple[Digests | None, str | None]:
        """vLLM's checksums, or None and why not, within the deadline."""
        started = time.monotonic()
        try:
            reply = await self._client.call(
                "POST", WEIGHT_CHECKER, json_body={"action": "checksum"}, timeout_s=self._timeout_s
            )
            if reply.status != 200:
                return None, f"/weight_checker answered {reply.status}: {reply.message()}"
            digests = parse_checksums(reply.json())
            self.last_digest, self.reads = _combined(digests), self.reads + 1
            return digests, None
        except UpstreamError as exc:
            return None, f"/weight_checker: {exc.message}"
        except ValueError as exc:
            return None, f"/weight_checker: {exc}"
        finally:
            self.last_seconds = time.monotonic() - started

    def lie_caught(self, operation: str, check: CheckName = CheckName.WEIGHTS) -> None:
        """`operation` answered 200 and the weights' checksums (or `check`) proved it untrue."""
        self._metrics.lie_caught(operation, check)

    def _report(self, check: Check) -> Check:
        self.last, self.last_at = check, time.time()
        self._metrics.verification(CheckName.WEIGHTS, check.result)
        return check

    def snapshot(self) -> dict[str, Any]:
        last = self.last
        return {
            "mode": self.mode.value,
            "checkpoint_tensors": len(self.checkpoint) if self.checkpoint is not None else None,
            "checkpoint_at": self.checkpoint_at,
            "last_check": None if last is None else {"result": last.result, "detail": last.detail, "at": self.last_at},
            "last_read_seconds": None if self.last_seconds is None else round(self.last_seconds, 4),
        }
