"""A small multi-turn text game: move between rooms, pick up items, complete a quest.

The world is fixed (four rooms in a square); the item and quest room come from the sample's
index (or a `{"item": ..., "room": ...}` label), so an episode is reproducible. Actions are lines
like `move north`, `pick up lamp`, `complete quest`, `look`; anything else is an invalid action,
counted in `info["invalid_actions"]` (and answered, so the model can recover).

Every step also reports the per-step signals that `rollouts.rewards.trajectory` reads:
`info["step_reward"]` (`pickup_reward` for picking up the quest item, `complete_reward` for
completing the quest, else 0), `info["success"]` (the quest is complete) and
`info["invalid_action"]` (this step's action was invalid).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollouts.types import Sample

EXITS: dict[str, dict[str, str]] = {
    "hall": {"north": "library", "east": "garden"},
    "library": {"south": "hall", "east": "tower"},
    "garden": {"west": "hall", "north": "tower"},
    "tower": {"south": "garden", "west": "library"},
}
ITEMS = ("lamp", "key", "map")


def quest_of(sample: Sample | None) -> tuple[str, str, str]:
    """(item, item's room, quest room) for a sample: from its label, else from its index."""
    label = sample.label if sample is not None else None
    if isinstance(label, Mapping) and "item" in label and "room" in label:
        return str(label["item"]), str(label.get("item_room", "library")), str(label["room"])
    i = sample.index if sample is not None else 0
    rooms = sorted(EXITS)
    return ITEMS[i % len(ITEMS)], rooms[(i + 1) % len(rooms)], rooms[(i + 2) % len(rooms)]


class TextGameEnvironment:
    """Reach the item, pick it up, carry it to the quest room and complete the quest."""

    def __init__(
        self,
        sample: Sample | None = None,
        max_invalid: int = 3,
        pickup_reward: float = 0.5,
        complete_reward: float = 1.0,
    ) -> None:
        assert max_invalid >= 1, f"{max_invalid=} must be >= 1"
        self.item, self.item_room, self.quest_room = quest_of(sample)
        self.max_invalid = max_invalid
        self.pickup_reward = pickup_reward
        self.complete_reward = complete_reward
        self.room = "hall"
        self.inventory: set[str] = set()
        self.invalid_actions = 0
        self.completed = False

    def _describe(self) -> str:
        here = (
            f" You see a {self.item}." if self.room == self.item_room and not self.inventory else ""
        )
        exits = ", ".join(sorted(EXITS[self.room]))
        return f"You are in the {self.room}.{here} Exits: {exits}."

    def reset(self) -> str:
        self.room, self.inventory = "hall", set()
        self.invalid_actions, self.completed = 0, False
        quest = f"Quest: bring the {self.item} to the {self.quest_room} and complete the quest."
        return f"{quest} {self._describe()}"

    def _info(self, valid: bool, step_reward: float = 0.0) -> dict[str, Any]:
        return {
            "valid": valid,
            "invalid_action": not valid,
            "step_reward": step_reward,
            "success": self.completed,
            "invalid_actions": self.invalid_actions,
            "room": self.room,
            "completed": self.completed,
            "inventory": sorted(self.inventory),
        }

    def _invalid(self, why: str) -> tuple[str, bool, Mapping[str, Any]]:
        self.invalid_actions += 1
        done = self.invalid_actions >= self.max_invalid
        return f"Invalid action: {why}", done, self._info(valid=False)

    def step(self, action: str) -> tuple[str, bool, Mapping[str, Any]]:
        words = action.strip().lower().rstrip(".").split()
        if words[:1] == ["move"] and len(words) == 2:
            target = EXITS[self.room].get(words[1])
            if target is None:
                return self._invalid(f"no exit {words[1]!r} from the {self.room}")
            self.room = target
            return self._describe(), False, self._info(valid=True)
        if words[:2] == ["pick", "up"] and len(words) == 3:
            if words[2] != self.item or self.room != self.item_room or self.inventory:
                return self._invalid(f"there is no {words[2]} here")
            self.inventory.add(self.item)
            reward = self.pickup_reward
            return f"You pick up the {self.item}.", False, self._info(True, reward)
        if words == ["complete", "quest"]:
            if self.item not in self.inventory or self.room != self.quest_room:
                return self._invalid("the quest is not done yet")
            self.completed = True
            return "Quest complete!", True, self._info(True, self.complete_reward)
        if words == ["look"]:
            return self._describe(), False, self._info(valid=True)
        return self._invalid("say 'move <exit>', 'pick up <item>', 'complete quest' or 'look'")
