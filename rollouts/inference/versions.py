"""Which weight version produced a completion: the server's report, else the sync bracket.

Recent servers report per request the versions that produced its tokens (spans, when a weight
update happened mid-request: SGLang 0.5.21 and 0.5.23 in `meta_info.weight_versions`, vLLM 0.33
in `choices[].weight_versions`). Older ones do not: SGLang 0.5.8 reports only the version served
when the request finished, and vLLM < 0.33 ignores `return_weight_versions`. A client knows
when it began and finished each weight sync of its engine (pause -> reload -> resume): a request
that saw no sync begin while it ran used one version, and one that did may have used any version
from the one served at its submission on.
Staleness counts from the oldest version that may have produced a token, so that is what a
Completion reports: exact when a request saw no sync, the bracket's lower end when it did.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(kw_only=True, slots=True)
class SyncBracket:
    """One client's view of its engine's weight version, kept by its own sync calls."""

    version: str | None = None  # served now, as of this client's last sync (None: not known)
    syncs_begun: int = 0  # weight reloads this client has begun

    def at_submit(self) -> tuple[str | None, int]:
        """What to remember when a request is sent: (version, syncs begun)."""
        return self.version, self.syncs_begun

    def begin_sync(self) -> None:
        """A reload starts: requests in flight may now see two versions."""
        self.syncs_begun += 1

    def served(self, version: str) -> None:
        """The engine serves `version` now (a sync ended, or the server said so)."""
        self.version = str(version)


def span_versions(spans: Any) -> list[str]:
    """The versions of a `weight_versions` span list ([{version, start, end}, ...]), in order."""
    if not isinstance(spans, list):
        return []
    return [str(s["version"]) for s in spans if isinstance(s, dict) and "version" in s]


def completion_version(
    *,
    spans: list[str],
    reported: str | None,
    submitted: tuple[str | None, int],
    bracket: SyncBracket,
) -> str:
    """The oldest weight version that may have produced a completion's tokens.

    `spans`: versions the server reported for the request (oldest first); `reported`: the one
    version the server reported (at finish), if any; `submitted`: `bracket.at_submit()` taken
    when the request was sent.
    """
    if spans:
        return spans[0]
    version_then, syncs_then = submitted
    synced_during = bracket.syncs_begun != syncs_then
    if synced_during and version_then is not None:
        return version_then  # the bracket's lower end
    if reported is not None:
        return reported
    assert bracket.version is not None, "no reported version and none known to the client"
    return version_then if version_then is not None else bracket.version
