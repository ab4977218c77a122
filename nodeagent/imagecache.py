"""The node's image cache: a disk budget over the images the agent pulled, least recently used
out first.

Pulled images cannot carry labels of ours, so what the agent knows of them lives in a small JSON
file in its state directory: each image it pulled (normalized reference) and when a run last
used it (pulled or started). Images it did not pull (the provider's own, the harness image built
on the host) are never touched; neither is the image of any container the agent manages (a
running one, or one whose exit is not collected yet), nor the images pinned in the
configuration (the platform's harness and benchmark image).

Sizes are the engine's per image: layers two images share count twice, so the budget is kept
with room to spare rather than overrun.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from agentprotocol.images import image_normalize, image_pattern_matches
from nodeagent.runtime.base import RuntimeDriverError
from nodeagent.spool import write_atomic

logger = logging.getLogger(__name__)

STATE_FILE = "images.json"


@dataclass(frozen=True, slots=True)
class HeldImage:
    """An image the engine holds: its normalized references, id and size."""

    refs: tuple[str, ...]
    image_id: str
    size_bytes: int


def prune_plan(
    *,
    pulled: Mapping[str, float],
    held: Iterable[HeldImage],
    in_use: set[str],
    pinned: Iterable[str],
    budget_bytes: int,
) -> list[str]:
    """The references to remove, least recently used first, so that the images the agent
    pulled fit the budget; images in use or matching a pinned pattern stay whatever it costs."""
    sizes = {ref: image.size_bytes for image in held for ref in image.refs if ref in pulled}
    total = sum(sizes.values())
    remove = []
    for ref in sorted(sizes, key=lambda r: (pulled[r], r)):
        if total <= budget_bytes:
            break
        if ref in in_use or any(image_pattern_matches(p, ref) for p in pinned):
            continue
        remove.append(ref)
        total -= sizes[ref]
    return remove


class ImageCache:
    """The agent's record of the images it pulled and their last use; thread-safe."""

    def __init__(
        self,
        state_dir: str,
        *,
        budget_bytes: int | None,
        pinned: Iterable[str] = (),
        clock: Callable[[], float],
    ) -> None:
        self.path = os.path.join(state_dir, STATE_FILE)
        self.budget_bytes = budget_bytes
        self.pinned = tuple(pinned)  # patterns (agentprotocol.images)
        self._clock = clock
        self._lock = threading.Lock()
        self._pulled: dict[str, float] = self._load()

    def _load(self) -> dict[str, float]:
        try:
            with open(self.path) as f:
                data = json.load(f)
            return {str(ref): float(at) for ref, at in data.get("pulled", {}).items()}
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError, AttributeError) as exc:
            # Damaged: forget it. The worst outcome is an image kept that could have gone.
            logger.warning("image cache state unreadable, starting anew", extra={"error": str(exc)})
            return {}

    def _save(self) -> None:
        write_atomic(self.path, json.dumps({"pulled": self._pulled}, sort_keys=True) + "\n")

    def pulled(self, image: str) -> None:
        """The agent pulled the image: it is the cache's to prune, used now."""
        with self._lock:
            self._pulled[image_normalize(image)] = self._clock()
            self._save()

    def used(self, image: str) -> None:
        """A run started with the image: its last use is now (if the agent pulled it)."""
        ref = image_normalize(image)
        with self._lock:
            if ref in self._pulled:
                self._pulled[ref] = self._clock()
                self._save()

    def last_used(self) -> dict[str, float]:
        with self._lock:
            return dict(self._pulled)

    def prune(
        self,
        *,
        held: list[HeldImage],
        in_use: set[str],
        remove: Callable[[str], None],
    ) -> list[str]:
        """Remove least recently used images the agent pulled until they fit the budget;
        returns what was removed. A removal the engine refuses (a container still holds the
        image) is skipped and tried again at the next pass."""
        with self._lock:
            present = {ref for image in held for ref in image.refs}
            # Removed by someone else: no longer ours to account for.
            for ref in [ref for ref in self._pulled if ref not in present]:
                del self._pulled[ref]
            if self.budget_bytes is None:
                self._save()
                return []
            plan = prune_plan(
                pulled=self._pulled,
                held=held,
                in_use={image_normalize(ref) for ref in in_use},
                pinned=self.pinned,
                budget_bytes=self.budget_bytes,
            )
            removed = []
            for ref in plan:
                try:
                    remove(ref)
                except RuntimeDriverError as exc:
                    logger.warning("image not pruned", extra={"image": ref, "error": str(exc)})
                    continue
                del self._pulled[ref]
                removed.append(ref)
            self._save()
        if removed:
            logger.info("images pruned", extra={"images": ",".join(removed)})
        return removed
