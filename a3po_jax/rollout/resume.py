"""The rollout workers' pending groups in a checkpoint: the entries written and the resume
plan read back from them (rollout layer, host side; plain Python, never enters jit).

:func:`pending_entries` is the checkpoint's ``pending_groups`` list (one entry per group
admitted and neither consumed nor dropped); :func:`resume_plan` checks a checkpoint's entries
and its held groups against each other and against the task's prompts, and says for each
pending group whether it comes back complete (held) or is re-issued;
:func:`consumed_admissions` is what the staleness controller counts as consumed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from a3po_jax.core.types import RolloutGroup


@dataclasses.dataclass(frozen=True)
class PendingGroup:
    """One pending group of a checkpoint, drawn again from the prompt order."""

    group_id: int
    prompt: Any
    # The checkpoint's for a held group; the resumed version for a re-issued one.
    admitted_at_version: int
    position: dict  # the prompt iterator position it was drawn at
    held: bool  # saved complete beside the checkpoint (else re-issued)


def pending_entries(inflight: Mapping[int, tuple[Any, int, dict]]) -> list[dict]:
    """The ``pending_groups`` of a checkpoint from the workers' in-flight table (group id ->
    prompt, admitted version, iterator state before it was drawn), by group id."""
    return [
        {
            "group_id": int(group_id),
            "prompt_id": str(prompt.prompt_id),
            "position": {"epoch": int(before["epoch"]), "index": int(before["index"])},
            "admitted_at_version": int(version),
        }
        for group_id, (prompt, version, before) in sorted(inflight.items())
    ]


def resume_plan(
    state: dict, *, held: Sequence[RolloutGroup], prompts: Any, version: int
) -> list[PendingGroup]:
    """The checkpoint's pending groups, each prompt drawn again at its position; ``prompts``
    is left at the checkpoint's position (after the newest admitted prompt).

    Raises:
      ValueError: ``held`` is not the checkpoint's ``held_groups``, a held group is not
        pending, or a position now holds another prompt (the task's prompts changed).
    """
    pending = state["pending_groups"]
    held_ids = [int(g) for g in state.get("held_groups", [])]
    if sorted(int(g.group_id) for g in held) != sorted(held_ids):
        raise ValueError(
            f"the checkpoint holds groups {sorted(held_ids)} saved beside it, but "
            f"{sorted(int(g.group_id) for g in held)} were given back"
        )
    admitted_at = {int(e["group_id"]): int(e["admitted_at_version"]) for e in pending}
    unknown = sorted(set(held_ids) - set(admitted_at))
    if unknown:
        raise ValueError(f"held groups {unknown} are not pending in the checkpoint")
    plan = []
    for entry in pending:
        prompts.restore({**entry["position"], "seed": state["prompt_iterator"]["seed"]})
        (prompt,) = prompts.next_batch()
        if str(prompt.prompt_id) != entry["prompt_id"]:
            raise ValueError(
                f"pending group {entry['group_id']} of the checkpoint was prompt "
                f"{entry['prompt_id']!r} at position {entry['position']}, but that "
                f"position now holds {prompt.prompt_id!r}: the task's prompts changed"
            )
        group_id = int(entry["group_id"])
        is_held = group_id in held_ids
        # A held group was generated before the save; the resumed weights generate the rest.
        admitted = admitted_at[group_id] if is_held else int(version)
        plan.append(PendingGroup(group_id, prompt, admitted, entry["position"], is_held))
    prompts.restore(state["prompt_iterator"])
    return plan


def consumed_admissions(state: dict) -> int:
    """The admissions a checkpoint's batches used up: consumed groups and the batch slots
    left empty (dynamic sampling), less the groups discarded and given back."""
    queue = state["queue"]
    consumed = int(queue["consumed_groups"]) + int(queue.get("empty_slots", 0))
    return consumed - int(state.get("discarded_groups", 0))
