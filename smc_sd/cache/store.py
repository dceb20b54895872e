"""The KV bytes of one model's pool: per layer, keys and values at flat slots.

Layer l's keys are one tensor [H, P · block_size, D] (H key-value heads, D head size): block k
holds slots k · block_size .. (k + 1) · block_size - 1 of every head. Reads gather (head, slot)
pairs in [B, H, S] order straight into the contiguous [B, H, S, D] layout attention takes, so no
transposed copy follows. The store is indexed only by the slots the manager hands out; it knows
nothing of rows, counts or tokens.

Invariant: every layer's tensors have P · block_size slots per head, P = `capacity`.
"""

from __future__ import annotations

import torch


class KVStore:
    """Keys and values of every layer at every slot of a pool.

    Args:
        layers: decoder layers holding a KV cache.
        heads: H, key-value heads per layer.
        head_dim: D.
        block_size: slots per block.
        dtype, device: of the KV tensors.
    """

    def __init__(self, layers: int, heads: int, head_dim: int, block_size: int, dtype, device):
        self.block_size = block_size
        self.capacity = 0
        self._shape = (heads, head_dim)
        self._dtype, self._device = dtype, device
        # per layer: [H, P · block_size, D]
        self.keys = [self._empty(0) for _ in range(layers)]
        self.values = [self._empty(0) for _ in range(layers)]

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block over all layers, keys and values."""
        heads, head_dim = self._shape
        element = torch.empty((), dtype=self._dtype).element_size()
        return 2 * len(self.keys) * self.block_size * heads * head_dim * element

    def ensure_capacity(self, blocks: int) -> None:
        """Grow every tensor to hold `blocks` blocks, keeping what is stored."""
        if blocks <= self.capacity:
            return
        extra = (blocks - self.capacity) * self.block_size
        self.keys = [torch.cat([k, self._empty(extra)], 1) for k in self.keys]
        self.values = [torch.cat([v, self._empty(extra)], 1) for v in self.values]
        self.capacity = blocks

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """Copy whole blocks, every layer: block pairs[c, 1] becomes a copy of block pairs[c, 0].

        Args:
            pairs: [C, 2] int64 (source, destination) block ids; destinations distinct.
        """
        if pairs.numel() == 0:
            return
        offsets = torch.arange(self.block_size)
        # [C · block_size] slots of the sources and of the destinations
        source = (pairs[:, 0, None] * self.block_size + offsets).reshape(-1).to(self._device)
        target = (pairs[:, 1, None] * self.block_size + offsets).reshape(-1).to(self._device)
        for tensors in (self.keys, self.values):
            for layer in tensors:
                layer.index_copy_(1, target, layer.index_select(1, source))

    def head_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Where slots live in a layer's [H · P · block_size, D] view, for every head.

        Valid until the capacity next grows; compute once per forward and reuse for every layer.

        Args:
            slots: [B, S] int64 flat slots on the store's device.

        Returns:
            [B, H, S] int64, entry (b, h, s) = h · P · block_size + slots[b, s].
        """
        heads = torch.arange(self._shape[0], device=slots.device) * (self.capacity * self.block_size)
        # [B, 1, S] + [1, H, 1] -> [B, H, S]
        return slots[:, None, :] + heads[None, :, None]

    def write(self, layer: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store new positions' KV.

        Args:
            rows: [B, H, L] int64 `head_rows` of the new positions' (distinct) slots.
            keys, values: [B, H, L, D], as a transformers attention layer produces them.
        """
        index, head_dim = rows.reshape(-1), self._shape[1]
        self.keys[layer].view(-1, head_dim).index_copy_(0, index, keys.reshape(-1, head_dim))
        self.values[layer].view(-1, head_dim).index_copy_(0, index, values.reshape(-1, head_dim))

    def read(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather the KV of every row's positions into contiguous rows.

        Args:
            rows: [B, H, S] int64 `head_rows` of every position's slot.

        Returns:
            keys, values: [B, H, S, D] contiguous.
        """
        index, head_dim = rows.reshape(-1), self._shape[1]
        # [B · H · S, D] -> [B, H, S, D]
        keys = self.keys[layer].view(-1, head_dim).index_select(0, index).view(*rows.shape, head_dim)
        values = self.values[layer].view(-1, head_dim).index_select(0, index).view(*rows.shape, head_dim)
        return keys, values

    def _empty(self, slots: int) -> torch.Tensor:
        return torch.zeros(self._shape[0], slots, self._shape[1], dtype=self._dtype, device=self._device)
