"""Zero-bubble pipeline training with splitgrad layers, on ``torch.distributed.pipelining``.

PyTorch's pipeline engine splits a stage's backward into B (input gradients) and W (weight
gradients) for its zero-bubble schedules (``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``). Its own split (``stage_backward_input`` /
``stage_backward_weight``) runs autograd on gradient edges, which bypasses ``AccumulateGrad``: grad
hooks never fire (so DDP/FSDP reduce nothing) and a parameter used at two sites can be counted
twice. With splitgrad layers the split is the layers' own:

- **B** is an ordinary autograd backward of the stage. splitgrad layers built with
  ``delay_wgrad_compute=True`` compute only their input gradient there and queue their weight
  gradient; every other parameter (norms, embeddings, regular layers) accumulates its gradient
  through ``AccumulateGrad`` as usual, hooks included.
- **W** runs exactly the deferred work that this micro-batch's B queued for the stage's layers
  (``backward_dw`` of that backward pass, whatever else is pending).

:class:`PipelineStage` is ``torch.distributed.pipelining.PipelineStage`` with that ``dw_builder``;
use it with any schedule torch ships (with W actions or without: GPipe and 1F1B run W right after
B). :class:`TiedParameter` sums the gradient of a parameter of which several stages hold copies (an
embedding on the first stage tied to the output layer on the last), as Megatron does.
:class:`StageTimeline` records when each F, B and W ran, for bubble measurements.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining as _pipelining

from ._errors import PendingWgradError
from ._grouped_linear import GroupedLinear
from ._linear import _DeferredWgradModule
from .distributed import _divide_after_reduction

__all__ = ["PipelineStage", "TiedParameter", "StageTimeline", "Interval", "busy_time", "bubble_fraction",
           "stages_of_rank"]


def stages_of_rank(rank: int, world: int, stages_per_rank: int = 1, style: str = "loop") -> list[int]:
    """The stage indices that ``rank`` of a ``world``-rank pipeline holds, as torch's schedules
    place them: ``"loop"`` (stage ``s`` on rank ``s % world``: GPipe, 1F1B, interleaved 1F1B,
    looped BFS, interleaved zero bubble) or ``"v"`` (two stages per rank, rank ``r`` holding ``r``
    and ``2·world - 1 - r``: ZB-V, DualPipeV)."""
    if not 0 <= rank < world:
        raise ValueError(f"stages_of_rank: expected 0 <= rank < world, got rank {rank}, world {world}")
    if style == "v":
        if stages_per_rank != 2:
            raise ValueError(f"stages_of_rank: the 'v' style has 2 stages per rank, got {stages_per_rank}")
        return [rank, 2 * world - 1 - rank]
    if style != "loop":
        raise ValueError(f"stages_of_rank: expected style 'loop' or 'v', got {style!r}")
    if stages_per_rank < 1:
        raise ValueError(f"stages_of_rank: expected stages_per_rank >= 1, got {stages_per_rank}")
    return [rank + k * world for k in range(stages_per_rank)]


def _gradient_of(param: torch.Tensor) -> torch.Tensor | None:
    """``main_grad`` (fuse_wgrad_accumulation) where the parameter has one, else ``.grad``."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _gradient_dtype(param: torch.Tensor) -> str:
    """The dtype TiedParameter.sync_grads reduces a copy's gradient in, as a string."""
    main_grad = getattr(param, "main_grad", None)
    return str((main_grad if main_grad is not None else param).dtype)


def _delayed_layers(module: nn.Module) -> list[_DeferredWgradModule]:
    """The module's splitgrad layers with delay_wgrad_compute=True, each once, in module order."""
    seen: set[int] = set()
    layers = []
    for layer in module.modules():
        if isinstance(layer, (_DeferredWgradModule, GroupedLinear)) and layer.delay_wgrad_compute and id(layer) not in seen:
            seen.add(id(layer))
            layers.append(layer)
    return layers


# The live splitgrad stages of this process, to catch a Parameter shared by two of them.
_live_stages: "weakref.WeakSet[PipelineStage]" = weakref.WeakSet()


class PipelineStage(_pipelining.PipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` whose W step is splitgrad's deferred wgrad.

    Same arguments as torch's (``dw_builder`` is this class's own). ``submodule`` holds the stage's
    layers; those that are splitgrad layers (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear``) built
    with ``delay_wgrad_compute=True`` have their GEMMs' weight gradients computed in W, the rest in B.

    - A W step (``backward_weight_one_chunk(i)``) runs the deferred work queued by micro-batch
      ``i``'s B step for this stage's layers, and nothing else, in whatever order the schedule runs
      the W steps. In schedules without W actions (GPipe, 1F1B, interleaved 1F1B) it runs right
      after B, as torch does with any ``dw_builder``.
    - When the schedule finishes the stage's backward work (its ``REDUCE_GRAD`` / grad scaling
      point), and again when the next step starts, deferred work queued by this stage's B steps
      and not run by a W step is a :class:`~splitgrad.PendingWgradError` naming the layers and
      micro-batches: a gradient would otherwise be missing.
    - Gradient scaling (``scale_grads=True`` in the schedule, the default) divides ``main_grad``
      (fuse_wgrad_accumulation) as well as ``.grad``, each parameter once.
    - The stages of one process must not share a Parameter object while the schedule scales
      gradients (each stage would divide it): give each stage its own copy and tie the copies
      with :class:`TiedParameter`. Stages with the same index are not stages of one schedule: a
      second stage over the same module (for another schedule, another micro-batch count, or
      evaluation) is fine, the first alive or not.

    ``timeline`` (a :class:`StageTimeline`, or None) records the F, B and W intervals when set.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: torch.device | str, input_args=None, output_args=None,
                 group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"splitgrad.pipelining.PipelineStage: expected an nn.Module submodule, "
                            f"got {type(submodule).__name__}")
        # through a weak reference: a bound method would keep the stage (and its entry in
        # _live_stages) alive after its schedule is gone
        this = weakref.ref(self)
        super().__init__(submodule, stage_index, num_stages, torch.device(device), input_args,
                         output_args, group, dw_builder=lambda: this()._build_dw_runner())
        self._layers = _delayed_layers(submodule)
        # Passes each layer had pending before the B step now running (None outside B).
        self._before_backward: list[set[int]] | None = None
        # Micro-batch -> the (layer, pass) work its B step queued and its W step has not run yet.
        self._owed: dict[int, list[tuple[_DeferredWgradModule, int]]] = {}
        self._backward_chunk: int | None = None
        self.timeline: StageTimeline | None = None
        _live_stages.add(self)

    @property
    def delayed_layers(self) -> list[_DeferredWgradModule]:
        """This stage's splitgrad layers with delay_wgrad_compute=True."""
        return list(self._layers)

    # -- B and W ----------------------------------------------------------------------------------

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        with self._timed("F", fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        if bwd_chunk_id in self._owed:
            raise PendingWgradError(
                f"{self.log_prefix} backward for micro-batch {bwd_chunk_id} ran again before the W "
                f"step of its previous backward (layers {self._names(self._owed[bwd_chunk_id])})")
        self._before_backward = [set(layer._layer.pending_passes()) for layer in self._layers]
        self._backward_chunk = bwd_chunk_id
        try:
            with self._timed("B", bwd_chunk_id):
                return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        finally:
            self._before_backward = None
            self._backward_chunk = None

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        if self.has_backward and bwd_chunk_id not in self.dw_runner:
            raise RuntimeError(
                f"{self.log_prefix} W step for micro-batch {bwd_chunk_id} without its B step "
                "(backward_one_chunk(full_backward=False)) first")
        return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

    def _build_dw_runner(self) -> Callable[[], None]:
        """Called by torch right after a B step's backward: claims the deferred work that backward
        queued (the passes new since it started) and returns the W step that runs it."""
        if self._before_backward is None:  # pragma: no cover - torch calls it from backward only
            raise RuntimeError(f"{self.log_prefix} dw_builder called outside a backward step")
        chunk = self._backward_chunk
        work: list[tuple[_DeferredWgradModule, int]] = []
        for layer, before in zip(reversed(self._layers), reversed(self._before_backward)):
            work.extend((layer, p) for p in layer._layer.pending_passes() if p not in before)
        if work:
            self._owed[chunk] = work

        def run_dw() -> None:
            with self._timed("W", chunk):
                # work run meanwhile by backward_dw_all() / a layer's backward_dw() is done already
                work[:] = [(layer, p) for layer, p in work if p in layer._layer.pending_passes()]
                while work:
                    layer, pass_id = work[0]
                    layer._layer.backward_dw_pass(pass_id)
                    work.pop(0)  # only once it ran: after an error the rest stays owed
            self._owed.pop(chunk, None)

        return run_dw

    def _get_init_p2p_neighbors_ops(self):
        # torch warms up the links to both neighbour stages, also where a neighbour lives on this
        # rank (V schedules put stages k and k+1 on one rank, which exchange tensors in memory);
        # gloo cannot send to itself, and such a link is never used.
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    # -- the end of a step --------------------------------------------------------------------------

    def _names(self, work: Iterable[tuple[_DeferredWgradModule, int]]) -> str:
        names: list[str] = []
        for layer, _ in work:
            if layer.name not in names:
                names.append(layer.name)
        return ", ".join(repr(n) for n in names)

    def _forget_work_run_elsewhere(self) -> None:
        """Drops owed work that is no longer queued (run by backward_dw_all() or a layer's
        backward_dw() after an error, say): it is not owed any more."""
        for chunk in list(self._owed):
            work = self._owed[chunk]
            work[:] = [(layer, p) for layer, p in work if p in layer._layer.pending_passes()]
            if not work:
                del self._owed[chunk]

    def check_no_pending_work(self, when: str = "at the end of the step") -> None:
        """Raise :class:`~splitgrad.PendingWgradError` if deferred work queued by this stage's B
        steps has not been run by their W steps."""
        self._forget_work_run_elsewhere()
        if not self._owed:
            return
        chunks = sorted(self._owed)
        layers = self._names(w for chunk in chunks for w in self._owed[chunk])
        raise PendingWgradError(
            f"{self.log_prefix} {when}: the weight gradients of micro-batch(es) {chunks} were never "
            f"computed (deferred work of layer(s) {layers} is still queued). The schedule ran their "
            "B steps (backward_one_chunk(full_backward=False)) but not their W steps "
            "(backward_weight_one_chunk); a schedule with I actions needs a W action for each.")

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        self.check_no_pending_work("when the schedule reduced its gradients")
        super().perform_reduce_grad(grad_scale_factor)

    def scale_grads(self, grad_scale_factor: int) -> None:
        self.check_no_pending_work("when the schedule scaled its gradients")
        if grad_scale_factor == 1:
            return
        params = {id(p): p for p in self.submod.parameters()}
        for other in list(_live_stages):
            if other is self or other.stage_index == self.stage_index:
                continue  # the same stage of another schedule (a schedule has each index once)
            shared = [p for p in other.submod.parameters() if id(p) in params]
            if shared:
                raise RuntimeError(
                    f"{self.log_prefix} shares {len(shared)} Parameter object(s) with "
                    f"{other.log_prefix} in this process; scaling each stage's gradients would divide "
                    f"them twice. Give each stage its own copy and tie the copies with "
                    "splitgrad.pipelining.TiedParameter, or build the schedule with scale_grads=False "
                    "and scale the loss instead.")
        # A GradReducer with a step under way divides the gradients it reduces after reducing them
        # (its finish() writes back the sums taken before this call); the others are divided here.
        reduced = _divide_after_reduction(params.values(), grad_scale_factor)
        for key, param in params.items():
            main_grad = getattr(param, "main_grad", None)
            # what a reducer reduces: main_grad where the parameter has one, else .grad
            source = main_grad if main_grad is not None else param.grad
            for grad in (param.grad, main_grad):
                if grad is not None and not (key in reduced and grad is source):
                    grad.div_(grad_scale_factor)

    def clear_runtime_states(self) -> None:
        # Called when a schedule step starts: work owed by the previous step would be lost.
        self.check_no_pending_work("when the next step started")
        super().clear_runtime_states()

    # -- timing ----------------------------------------------------------------------------------

    def _timed(self, kind: str, chunk: int | None):
        if self.timeline is None:
            return _NULL_CONTEXT
        return self.timeline.record(self.stage_index, kind, chunk)


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL_CONTEXT = _NullContext()


@dataclass(frozen=True)
class Interval:
    """One action of a stage: ``kind`` is ``"F"``, ``"B"`` or ``"W"``; times in seconds on the
    process's monotonic clock (``time.perf_counter``). A W run inside a full backward (schedules
    without W actions) lies inside its B interval."""

    stage: int
    kind: str
    microbatch: int | None
    start: float
    end: float


class StageTimeline:
    """Records when each F, B and W action of the stages it is attached to ran.

    Attach it with ``stage.timeline = timeline`` (a :class:`PipelineStage`). On CUDA each interval
    is closed by a ``torch.cuda.synchronize()`` so that it measures the GPU work (this serialises
    the schedule's communication with its compute a little; use it for measurement runs).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.intervals: list[Interval] = []
        self.enabled = True

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    class _Recording:
        __slots__ = ("timeline", "stage", "kind", "chunk", "start")

        def __init__(self, timeline, stage, kind, chunk):
            self.timeline, self.stage, self.kind, self.chunk = timeline, stage, kind, chunk

        def __enter__(self):
            self.timeline._sync()
            self.start = time.perf_counter()

        def __exit__(self, *exc):
            self.timeline._sync()
            if self.timeline.enabled:
                self.timeline.intervals.append(
                    Interval(self.stage, self.kind, self.chunk, self.start, time.perf_counter()))
            return False

    def record(self, stage: int, kind: str, chunk: int | None):
        """A context manager that records one interval."""
        return StageTimeline._Recording(self, stage, kind, chunk)

    def clear(self) -> None:
        self.intervals.clear()


def busy_time(intervals: Sequence[Interval]) -> float:
    """Seconds covered by at least one interval (nested W inside B counts once)."""
    total, end = 0.0, float("-inf")
    for interval in sorted(intervals, key=lambda i: i.start):
        if interval.end <= end:
            continue
        total += interval.end - max(interval.start, end)
        end = interval.end
    return total


def bubble_fraction(per_rank: Sequence[Sequence[Interval]], window: tuple[float, float] | None = None) -> float:
    """The pipeline bubble: the share of the ranks' time in ``window`` that no F, B or W action
    used, ``1 - Σ_r busy_r / (ranks · window)``. ``window`` defaults to the first start to the
    last end over all ranks (their clocks must be comparable: one host's monotonic clock)."""
    ranks = [list(r) for r in per_rank]
    if not ranks or not any(ranks):
        raise ValueError("bubble_fraction: no intervals recorded")
    if window is None:
        window = (min(i.start for r in ranks for i in r), max(i.end for r in ranks for i in r))
    span = window[1] - window[0]
    if span <= 0:
        raise ValueError(f"bubble_fraction: expected a window of positive length, got {window}")
    busy = sum(busy_time(r) for r in ranks)
    return 1.0 - busy / (len(ranks) * span)


class TiedParameter:
    """One logical parameter of which several pipeline stages hold copies — GPT's token embedding on
    the first stage tied to the output layer on the last — kept equal by summing their gradients
    after the W steps, as Megatron does for embeddings.

    Args:
        copies: this process's copies (none, one, or several when two of its stages hold one; the
            same Parameter listed twice counts once).
        ranks: the ranks (of the default group) that hold a copy. ``TiedParameter`` creates a
            process group over them, so every rank of the world must construct it, in the same order
            as the other collectives (``torch.distributed.new_group``'s rule), copies or not.

    The constructor checks, on every rank alike, that all ranks passed the same ``ranks`` and that
    every copy on every rank has one shape and one gradient dtype (``main_grad``'s where a copy has
    one when it is built, else the parameter's), raising a ``ValueError`` naming the ranks that
    differ.

    After a step's backward work, :meth:`sync_grads` gives every copy the sum of all copies'
    gradients (``main_grad`` where a copy has one, else ``.grad``); then the same optimizer step on
    every copy keeps them equal. :meth:`broadcast_` makes the values equal to start with.
    """

    def __init__(self, copies: Sequence[torch.Tensor], ranks: Sequence[int]) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TiedParameter: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group() first")
        unique: dict[int, torch.Tensor] = {}
        for copy in copies:
            if not isinstance(copy, torch.Tensor):
                raise TypeError(f"TiedParameter: expected tensors as copies, got {type(copy).__name__}")
            unique.setdefault(id(copy), copy)
        self.copies = list(unique.values())
        self.ranks = sorted(set(int(r) for r in ranks))
        world = dist.get_world_size()
        if not self.ranks or any(r < 0 or r >= world for r in self.ranks):
            raise ValueError(f"TiedParameter: expected ranks in [0, {world}), got {list(ranks)}")
        # With several ranks this is collective (every rank builds it): every rank sees every rank's
        # copies and raises alike, rather than a mismatch summing the wrong elements or aborting in
        # the backend later. With one rank, nothing is exchanged (as for the group below).
        rank = dist.get_rank()
        mine = (self.ranks, [(tuple(c.shape), _gradient_dtype(c)) for c in self.copies])
        if len(self.ranks) > 1:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, mine)
            everyone = dict(enumerate(gathered))
        else:
            everyone = {rank: mine}
        differ = [f"rank {r} passed {theirs}" for r, (theirs, _) in everyone.items() if theirs != self.ranks]
        if differ:
            raise ValueError(f"TiedParameter: every rank must pass the same ranks; rank {rank} passed "
                             f"{self.ranks}, {'; '.join(differ)}")
        holders = [r for r, (_, held) in everyone.items() if held]
        if holders != [r for r in self.ranks if r in everyone]:
            raise ValueError(f"TiedParameter: rank(s) {holders} hold copies, but ranks is {self.ranks}: every "
                             "rank in ranks must hold a copy, and no other")
        kinds = sorted({(r, shape, dtype) for r in holders for shape, dtype in everyone[r][1]})
        if len({(shape, dtype) for _, shape, dtype in kinds}) > 1:
            described = "; ".join(f"rank {r} holds shape {shape} {dtype}" for r, shape, dtype in kinds)
            raise ValueError("TiedParameter: the copies must have one shape and one gradient dtype on "
                             f"every rank, got: {described}")
        self.group = dist.new_group(self.ranks) if len(self.ranks) > 1 else None

    def sync_grads(self) -> None:
        """Every copy's gradient becomes the sum over all copies (a no-op on ranks without one)."""
        if not self.copies:
            return
        grads = [_gradient_of(c) for c in self.copies]
        present = [g for g in grads if g is not None]
        like = present[0] if present else self.copies[0]
        total = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
        for grad in present:
            total.add_(grad.to(total.dtype))
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for copy, grad in zip(self.copies, grads):
            if grad is None:
                copy.grad = total.to(copy.dtype, copy=True)
            else:
                grad.copy_(total)

    @torch.no_grad()
    def broadcast_(self, src: int) -> None:
        """Set every copy to rank ``src``'s (its first copy's) values."""
        if src not in self.ranks:
            raise ValueError(f"TiedParameter.broadcast_: src {src} is not one of the ranks {self.ranks}")
        if not self.copies:
            return
        value = self.copies[0].detach().clone()
        if self.group is not None:
            dist.broadcast(value, src=src, group=self.group)
        for copy in self.copies:
            copy.copy_(value)
