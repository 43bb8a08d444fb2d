"""Which layers share a block table: the KV groups of a model whose layers attend differently (vLLM's hybrid cache).

A page normally holds one page of tokens for every layer, so a model that mixes sliding-window layers with global
ones (Gemma 2 and 3) would keep every page for its global layers' sake: a long conversation holds its whole length for
the sliding layers too. Instead its layers are split into groups of (at most) one size, each group of one kind
(global, or one window), and each group has its own block table: a page of the pool then holds one page of tokens
for one group's layers, and a sliding group gives its pages back as the window moves on, as a model whose layers all
slide does (KVCacheManager.release_behind_window), while a global group keeps its own. One size lets every group
draw from one pool of equal pages: admission counts them all alike, and there is no split of memory between kinds to
guess. A group smaller than the size (the last of a kind whose count it does not divide) leaves the rest of its page
unused.

A model whose layers all attend alike is one group of every layer: one block table, as before.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroup:
    layers: tuple[int, ...]  # the model's layer indices whose K/V this group's block table places
    window: int | None  # the positions back from a query its layers read (None: the whole context)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The groups, the first of them (whose block table is Sequence.page_ids) a global one where the model has any."""

    groups: tuple[KVGroup, ...]

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> KVLayout:
        return cls((KVGroup(tuple(range(num_layers)), window),))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layers_per_group(self) -> int:
        """How many layers' K/V one page holds (the pool keeps this many page tensors, shared by the groups)."""
        return max(len(group.layers) for group in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    def group_of_layer(self) -> list[int]:
        """Each layer's group, by layer index."""
        group_of = {layer: index for index, group in enumerate(self.groups) for layer in group.layers}
        return [group_of[layer] for layer in range(len(group_of))]

    def slot_of_layer(self) -> list[int]:
        """Each layer's place in its group: the page tensor it shares with the other groups' layers at that place."""
        slot_of = {layer: slot for group in self.groups for slot, layer in enumerate(group.layers)}
        return [slot_of[layer] for layer in range(len(slot_of))]


def kv_layout(layer_windows: list[int | None], hybrid: bool = True) -> KVLayout:
    """The groups for layers attending over `layer_windows` (None: a global layer).

    Layers that all attend alike are one group (with a window when every layer slides: the widest). Mixed layers are
    split into groups the size of the rarest kind, as vLLM does (Gemma 3 270M: 3 global and 15 sliding layers, six
    groups of 3; Gemma 3 4B: 5 and 29, seven groups of 5, the last of 4): groups of one layer each would multiply the
    block tables a step builds, for a page no fuller. Where `hybrid` is off (a backend or a KV handover that reads
    one block table) they are one group without a window: every page kept, as for a global model."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if None not in kinds:
        return KVLayout.single(len(layer_windows), max(kinds, default=None))
    if len(kinds) == 1 or not hybrid:
        return KVLayout.single(len(layer_windows))
    size = min(len(layers) for layers in kinds.values())
    ordered = [None, *sorted(window for window in kinds if window is not None)]  # the global groups first
    return KVLayout(
        tuple(
            KVGroup(tuple(kinds[window][start : start + size]), window)
            for window in ordered
            for start in range(0, len(kinds[window]), size)
        )
    )
