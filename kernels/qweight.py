"""A GGML-quantized weight matrix kept in its raw block layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # annotations only: the lean one-shot path imports this without torch
    import torch


class Shaped:
    """out_features / in_features of a weight whose `shape` ends with [out, in] (torch order)."""

    shape: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return self.shape[-2]

    @property
    def in_features(self) -> int:
        return self.shape[-1]


@dataclass
class QuantWeight(Shaped):
    """Raw GGML blocks of a 2-D weight [out_features, in_features] (torch order).

    `data` is a uint8 tensor of shape [out_features, bytes_per_row], where
    bytes_per_row = in_features // block_elems * block_bytes for `ggml_type`
    (a gguf.GGMLQuantizationType value). It may be a view over a memory map.
    """

    ggml_type: int
    shape: tuple[int, int]
    data: torch.Tensor

    @property
    def type_name(self) -> str:
        import gguf

        return gguf.GGMLQuantizationType(self.ggml_type).name

    def to(self, device) -> "QuantWeight":
        return QuantWeight(self.ggml_type, self.shape, self.data.to(device))
