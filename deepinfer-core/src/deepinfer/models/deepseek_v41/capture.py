"""Target features for the DSpark drafter: each capture layer's output, averaged over the mHC streams, at the rows
the runner asks for (``ForwardBatch.capture_rows``).

The drafter's ``main_proj`` reads ``concat(mean_streams(layer output) for layer in dspark_target_layer_ids)``
(vLLM's ``aux_hidden_states.append(hc_post(...).mean(dim=1))``, TensorRT-LLM's ``maybe_capture_hidden_states``).
The mean is ``hc_collapse`` with uniform weights, so it runs on the op table.  With decoder prefill truncation a
layer after the cut has outputs only for the kept rows; a requested row that was not kept reads zeros (the
drafter needs only the last ``sliding_window`` prompt rows, which KEEP covers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.ops import Ops


@dataclass(slots=True)
class Capture:
    """One step's capture request and what it collected so far."""

    layer_ids: tuple[int, ...]
    rows: torch.Tensor  # [R] int64 batch rows
    num_rows: int  # rows of the step
    uniform: torch.Tensor  # [R, hc_mult] fp32, 1 / hc_mult: the stream mean as a collapse
    parts: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def request(cls, layer_ids: tuple[int, ...], rows: torch.Tensor, num_rows: int, hc_mult: int) -> Capture:
        if not layer_ids:
            raise ValueError("capture_rows was given but the model has no capture_layer_ids (no DSpark drafter)")
        uniform = torch.full((rows.shape[0], hc_mult), 1.0 / hc_mult, dtype=torch.float32, device=rows.device)
        return cls(layer_ids, rows, num_rows, uniform)

    def take(self, ops: Ops, layer: int, streams: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        """Record layer ``layer``'s output ``streams`` [T', hc, D] if it is a capture layer; ``kept``: the batch
        rows those T' rows are (None: every row of the step)."""
        if layer not in self.layer_ids:
            return
        if kept is None:
            picked = streams[self.rows]
        else:  # rows outside ``kept`` read the zero row appended at T'
            where = torch.full((self.num_rows,), kept.shape[0], dtype=torch.int64, device=kept.device)
            where[kept] = torch.arange(kept.shape[0], device=kept.device)
            picked = torch.cat([streams, streams.new_zeros(1, *streams.shape[1:])])[where[self.rows]]
        self.parts[layer] = ops.hc_collapse(picked, self.uniform)

    def result(self) -> torch.Tensor:
        """[R, len(layer_ids) * D], the layers in ``layer_ids`` order."""
        missing = [i for i in self.layer_ids if i not in self.parts]
        if missing:
            raise RuntimeError(f"capture layers {missing} were not reached in this forward")
        return torch.cat([self.parts[i] for i in self.layer_ids], dim=1)
