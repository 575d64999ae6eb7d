"""Block swap: the last N blocks of a transformer live off the accelerator and are brought in just
before they run, forward and backward, so a base bigger than the card trains (train.blocks_to_swap).

Each swapped block's frozen weights are kept once, off the accelerator (pinned CPU memory on CUDA);
the block holds them on the accelerator only while it runs. A copy stream brings the next block in
while the current one computes (forward: the next block; backward, which runs the blocks in reverse:
the previous one), and takes a block out once the compute stream is past it. Between its uses a
swapped block's frozen weights are empty tensors (no elements), so a use the hooks did not
prepare fails at once instead of reading stale memory. Trainable parameters (the adapter) and
buffers stay on the accelerator: they are small, and the optimizer and DDP hold them.

Forward-pre hooks cover the block's own forward; backward-pre hooks cover autograd, which reads
the same parameter tensors the forward saved (their data is swapped, not the tensors), and the
re-forward of gradient checkpointing, which runs inside the block's backward. A block's backward
is not over when its inputs' gradients are (its hook fires then, while the branches to its
adapter's weights may still run); it is over when the block before it starts its backward: the
engine runs the ready node created last first, and every node of a block was created after every
node of the blocks before it. So a block leaves at the next block's backward, the last ones at the
end of the backward pass. With the swap the step computes what it computes without it,
bit for bit: only where the frozen weights wait between uses changes. (Where one block's output feeds
several later blocks, Kandinsky 5's text blocks, the full backward hooks themselves change the order
in which that output's gradients are summed, swapped or not: last-bit rounding.)

Which blocks a denoiser has is its family's (Family.block_lists). The swapped blocks' frozen
weights never reach the accelerator whole: `to_device_leaving` moves the rest of the model, the
adapter is added, then BlockSwap takes the blocks' weights from the host and moves what else they
hold (the adapter, buffers) to the accelerator. A quantised base is refused: its weights are tensor
subclasses (torchao) or parameters carrying their quantisation state (bitsandbytes), whose data
cannot be exchanged by assigning `.data` as done here. So is a PiSSA/OLoRA init, which rewrites the
base weights at every checkpoint (both refused by stages/train/launch.py, before training starts).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import torch

from lorapipe.cache.errors import UserError

if TYPE_CHECKING:
    from torch import nn


def swap_count(setting: int | float, blocks: int) -> int:
    """How many of `blocks` blocks train.blocks_to_swap means: N, or a fraction of them (at least one)."""
    count = setting if isinstance(setting, int) else max(1, round(setting * blocks))
    if count > blocks:
        raise UserError(f"train.blocks_to_swap: {count} of {blocks} blocks; give 1 to {blocks}, or a fraction")
    return count


def to_device_leaving(model: nn.Module, device: torch.device, blocks: list[nn.Module]) -> None:
    """Move the model's parameters and buffers to `device`, except those of `blocks` (for BlockSwap)."""
    staying = {id(t) for block in blocks for t in chain(block.parameters(), block.buffers())}
    with torch.no_grad():
        for tensor in chain(model.parameters(), model.buffers()):
            if id(tensor) not in staying:
                tensor.data = tensor.data.to(device)


@dataclass
class _Swapped:
    """One block's frozen weights: the kept copy off the accelerator, and its state."""

    params: list[torch.nn.Parameter]
    kept: list[torch.Tensor]  # off the accelerator (pinned on CUDA)
    loaded: bool = False
    in_backward: bool = False
    ready: torch.cuda.Event | None = field(default=None, repr=False)  # set when its copy in finished


class BlockSwap:
    def __init__(self, blocks: list[nn.Module], count: int, device: torch.device):
        self.blocks, self.device = blocks, torch.device(device)
        self.first = len(blocks) - count  # blocks [first, len) are swapped
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.swapped: dict[int, _Swapped] = {}
        self.backward_pass = False  # a checkpoint's re-forward happens in it: no block after it is needed again
        for i in range(self.first, len(blocks)):
            params = [p for p in blocks[i].parameters() if not p.requires_grad]
            kept = [p.detach().to("cpu").pin_memory() if cuda else p.detach().to("cpu") for p in params]
            self.swapped[i] = _Swapped(params, kept)
            self._unload(i)
            blocks[i].to(self.device)  # what else it holds (the adapter, buffers) lives on the accelerator
        self.handles = [hook for i, block in enumerate(blocks) for hook in self._install(i, block)]
        # the first block's inputs need no gradient: its backward-pre hook fires all the same, as wanted
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")

    def remove(self) -> None:
        """Drop the hooks and give every swapped block its frozen weights back where they were kept
        (the host: the accelerator had no room for them); the adapter stays on the accelerator."""
        for handle in self.handles:
            handle.remove()
        for s in self.swapped.values():
            for p, kept in zip(s.params, s.kept):
                p.data = kept
            s.loaded = True

    def _install(self, i: int, block: nn.Module) -> list:
        return [block.register_forward_pre_hook(lambda *_: self._enter(i, None if self.backward_pass else i + 1)),
                block.register_forward_hook(lambda *_: self._leave_forward(i)),
                block.register_full_backward_pre_hook(lambda *_: self._enter_backward(i))]

    def _enter(self, i: int, after: int | None) -> None:
        """Block i is about to run: have it loaded; start bringing in the block that runs after it."""
        if i in self.swapped:
            self._load(i)
            self._wait(i)
        if after in self.swapped:
            self._load(after)

    def _leave_forward(self, i: int) -> None:
        s = self.swapped.get(i)
        if s is not None and not s.in_backward:  # else a checkpoint's re-forward: its backward goes on
            self._unload(i)

    def _enter_backward(self, i: int) -> None:
        """Block i starts its backward: the blocks after it are done with theirs."""
        if not self.backward_pass:
            self.backward_pass = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        for j, s in self.swapped.items():
            if j > i and s.in_backward:
                s.in_backward = False
                self._unload(j)
        if i in self.swapped:
            self.swapped[i].in_backward = True
        self._enter(i, i - 1)

    def _end_backward(self) -> None:
        self.backward_pass = False
        for j, s in self.swapped.items():
            if s.in_backward:
                s.in_backward = False
                self._unload(j)

    def _load(self, i: int) -> None:
        s = self.swapped[i]
        if s.loaded:
            return
        if self.copy_stream is None:  # no copy to overlap: the block reads its kept weights where they are
            for p, kept in zip(s.params, s.kept):
                p.data = kept.to(self.device)
        else:
            with torch.cuda.stream(self.copy_stream):
                for p, kept in zip(s.params, s.kept):
                    p.data = kept.to(self.device, non_blocking=True)
                s.ready = torch.cuda.Event()
                s.ready.record(self.copy_stream)
        s.loaded = True

    def _wait(self, i: int) -> None:
        s = self.swapped[i]
        if s.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(s.ready)
            for p in s.params:  # the compute stream uses memory the copy stream allocated
                p.data.record_stream(torch.cuda.current_stream(self.device))
            s.ready = None

    def _unload(self, i: int) -> None:
        """Drop block i's weights from the accelerator (the kept copy is unchanged: they are frozen)."""
        s = self.swapped[i]
        for p in s.params:
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        s.loaded = False
