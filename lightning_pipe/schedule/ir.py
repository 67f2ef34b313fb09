"""The schedule intermediate representation: per worker, an ordered list of actions.

One IR expresses every family of the papers, so one validator, one simulator and one runtime serve
them all (docs/design.md). An :class:`Action` is a forward ``F``, a full backward ``B``, or the two halves
of a split backward (zero bubble: ``I`` for the input gradient, ``W`` for the weight gradient) of a
(stage, micro-batch, step), with the weight version it computes with; or an ``UPDATE`` (optimizer step)
of a stage; or a transfer: ``SEND_F``/``RECV_F`` (activation), ``SEND_B``/``RECV_B`` (gradient),
``FETCH`` (weights of a stage from the worker that owns them); or a cue: ``SIGNAL`` tells worker
``peer`` that this worker has come this far, ``WAIT`` holds this worker until worker ``peer``'s
``SIGNAL`` of the same (stage, micro-batch, step) (CDP's uniform delay between replicas).

Weight versions count optimizer steps: version ``v`` of a stage is its weights after ``v`` updates;
the update of step ``t`` produces version ``t + 1``.

Text forms: JSON (:meth:`Schedule.to_dict`) and torch.distributed.pipelining's action strings
(``0F1``, ``2B0``, ``1W3``, ``1I0``, ``0SEND_F1``) for the single-step families both libraries run.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

from lightning_pipe.errors import PlanningError

__all__ = ["COMPUTE", "Action", "Kind", "Ring", "Schedule"]


class Kind(str, Enum):
    """What an action does."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - torch.distributed.pipelining's name for the input-gradient half
    W = "W"
    UPDATE = "UPDATE"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    FETCH = "FETCH"
    SIGNAL = "SIGNAL"
    WAIT = "WAIT"


COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
_TORCH_KINDS = {Kind.F, Kind.B, Kind.I, Kind.W, Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B}
_TORCH_IGNORED = re.compile(r"(UNSHARD|RESHARD|REDUCE_GRAD)")
_TORCH_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")
_TORCH_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one worker.

    Attributes:
        kind: see :class:`Kind`.
        stage: the pipeline stage acted on.
        microbatch: index within the step (``None`` for ``UPDATE`` and ``FETCH``).
        step: the optimizer step (mini-batch) the micro-batch belongs to.
        version: weight version used (compute, ``FETCH``), ``None`` when not assigned yet.
        peer: the worker at the other end of a transfer.
    """

    kind: Kind
    stage: int
    microbatch: int | None = None
    step: int = 0
    version: int | None = None
    peer: int | None = None

    @property
    def key(self) -> tuple[Kind, int, int | None, int]:
        """Identity of the action regardless of version and peer."""
        return (self.kind, self.stage, self.microbatch, self.step)

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        text = f"{self.stage}{self.kind.value}{mb}"
        if self.step:
            text += f"@{self.step}"
        if self.version is not None and self.kind in COMPUTE:
            text += f"v{self.version}"
        return text

    def to_torch(self) -> str:
        """torch.distributed.pipelining's string, e.g. ``2B0``."""
        if self.kind not in _TORCH_KINDS or self.step:
            raise PlanningError(
                f"{self} has no torch.distributed.pipelining form: only single-step F/B/I/W and SEND/RECV actions do"
            )
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def from_torch(cls, text: str) -> Action:
        """Parse ``0F1``-style strings."""
        match = _TORCH_ACTION.match(text.strip())
        if not match:
            raise PlanningError(f"{text!r} is not a torch.distributed.pipelining action such as 0F1, 2B0 or 1W3")
        return cls(Kind(match.group(2)), int(match.group(1)), int(match.group(3)))

    def to_dict(self) -> dict[str, object]:
        entry: dict[str, object] = {"kind": self.kind.value, "stage": self.stage}
        for name in ("microbatch", "version", "peer"):
            if getattr(self, name) is not None:
                entry[name] = getattr(self, name)
        if self.step:
            entry["step"] = self.step
        return entry

    @classmethod
    def from_dict(cls, entry: dict[str, object]) -> Action:
        try:
            return cls(
                kind=Kind(entry["kind"]),
                stage=int(entry["stage"]),
                microbatch=None if entry.get("microbatch") is None else int(entry["microbatch"]),
                step=int(entry.get("step", 0)),
                version=None if entry.get("version") is None else int(entry["version"]),
                peer=None if entry.get("peer") is None else int(entry["peer"]),
            )
        except (KeyError, ValueError, TypeError) as error:
            raise PlanningError(f"malformed action {entry!r}: {error}") from None


def _parse_torch(text: str | None) -> list[Action]:
    """Actions of one torch.distributed.pipelining entry (none for idle slots and FSDP bookkeeping)."""
    if text is None or _TORCH_IGNORED.search(text):
        return []
    overlap = _TORCH_OVERLAP.match(text.strip())
    if overlap:
        return [Action.from_torch(part) for part in overlap.group(1).split(";")]
    return [Action.from_torch(text)]


@dataclass(frozen=True)
class Ring:
    """How the owners of one stage reduce its gradient point to point instead of all-reducing it at
    the update (Cyclic Data Parallelism, Fournier & Oyallon 2024, §4.2).

    Attributes:
        gather: the owners in the order they add their gradient of a step: after its last gradient
            of the step, ``gather[i]`` takes the partial sum from ``gather[i - 1]``, adds its own and
            passes it to ``gather[i + 1]``; the last one (the *reducer*) then holds the step's sum.
        spread: the other owners in the order the sum reaches them: the reducer passes it to
            ``spread[0]`` as soon as it has it; at its update of the step each takes it from the
            previous one and passes it on.
    """

    gather: tuple[int, ...]
    spread: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "gather", tuple(self.gather))
        object.__setattr__(self, "spread", tuple(self.spread))

    @property
    def reducer(self) -> int:
        return self.gather[-1]

    def gathered_from(self, worker: int) -> int | None:
        """The owner ``worker`` takes the partial sum from (``None``: it starts the sum)."""
        i = self.gather.index(worker)
        return self.gather[i - 1] if i else None

    def gathers_to(self, worker: int) -> int | None:
        """The owner ``worker`` passes its partial sum to (``None``: it is the reducer)."""
        i = self.gather.index(worker)
        return self.gather[i + 1] if i + 1 < len(self.gather) else None

    def spread_from(self, worker: int) -> int | None:
        """The owner ``worker`` takes the step's sum from (``None``: the reducer has it)."""
        chain = (self.reducer, *self.spread)
        i = chain.index(worker)
        return chain[i - 1] if i else None

    def spreads_to(self, worker: int) -> int | None:
        """The owner ``worker`` passes the step's sum to at its update (``None``: the last one)."""
        chain = (self.reducer, *self.spread)
        i = chain.index(worker)
        return chain[i + 1] if i + 1 < len(chain) else None


@dataclass(frozen=True)
class Schedule:
    """Per-worker action orders plus what they are about.

    Attributes:
        family: generator name (``gpipe``, ``1f1b``, ...).
        stages: ``P``.
        microbatches: ``m`` per step.
        steps: optimizer steps covered.
        orders: ``orders[w]`` is worker ``w``'s actions in execution order (any sequences; kept as
            tuples).
        owners: ``owners[s]`` are the workers that hold the source of truth of stage ``s``'s weights
            and apply its updates (several for replicated stages, DDP).
        rule: the update rule the versions follow (``sync``, ``stash``, ``vertical``, ``2bw``,
            ``cdp_v1``, ``cdp_v2``).
        flush: whether consecutive steps are separated by a pipeline flush.
        rings: per stage, how its owners reduce its gradient point to point (:class:`Ring`); empty:
            a stage's owners all-reduce it at their update.
        relays: per stage, its compute actions and updates (versions left out) in the order the
            stage's whole state (weights, kept versions, gradients, optimizer state) visits them: one
            worker holds it at a time and passes it to the worker of the next one (CDP's ZeRO form);
            between runs it rests on its owner, which makes the updates. Empty: a stage's state stays
            on its owners.
        params: the generator's parameters, for the record.
    """

    family: str
    stages: int
    microbatches: int
    steps: int
    orders: tuple[tuple[Action, ...], ...]
    owners: tuple[tuple[int, ...], ...]
    rule: str = "sync"
    flush: bool = True
    rings: tuple[Ring, ...] = ()
    relays: tuple[tuple[Action, ...], ...] = ()
    params: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "orders", tuple(tuple(order) for order in self.orders))
        object.__setattr__(self, "owners", tuple(tuple(workers) for workers in self.owners))
        object.__setattr__(self, "rings", tuple(self.rings))
        object.__setattr__(self, "relays", tuple(tuple(relay) for relay in self.relays))
        if self.relays and (len(self.relays) != self.stages or any(len(o) != 1 for o in self.owners)):
            raise PlanningError(f"{self.family}: a relayed schedule needs a relay and one owner per stage")
        if self.rings and len(self.rings) != self.stages:
            raise PlanningError(f"{self.family}: {len(self.rings)} rings for {self.stages} stages")
        for stage, ring in enumerate(self.rings):
            if sorted(ring.gather) != sorted(self.owners[stage]) or sorted((ring.reducer, *ring.spread)) != sorted(
                self.owners[stage]
            ):
                raise PlanningError(
                    f"{self.family}: stage {stage}'s ring {ring} must gather and spread over its owners "
                    f"{list(self.owners[stage])}, each once"
                )

    @property
    def workers(self) -> int:
        return len(self.orders)

    def actions(self) -> Iterator[tuple[int, int, Action]]:
        """``(worker, position, action)`` for every action."""
        for worker, order in enumerate(self.orders):
            for position, action in enumerate(order):
                yield worker, position, action

    def first_owner(self, stage: int) -> int:
        """The first of ``stage``'s owners, which speaks for them: it lends the stage's weights to the
        workers that compute it without owning it, runs it in an evaluation, holds a relayed stage
        between runs, and gives a replicated stage's carried state and entries to a checkpoint."""
        return self.owners[stage][0]

    @property
    def first_owners(self) -> tuple[int, ...]:
        """:meth:`first_owner` of every stage, in order."""
        return tuple(self.first_owner(s) for s in range(len(self.owners)))

    def computing(self, stage: int) -> tuple[int, ...]:
        """The workers that compute ``stage`` (its forwards and backwards), in order."""
        return tuple(sorted({w for w, _, a in self.actions() if a.stage == stage and a.kind in COMPUTE}))

    def with_orders(self, orders: Sequence[Sequence[Action]], **changes: object) -> Schedule:
        return replace(self, orders=orders, **changes)

    # -- text exchange --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, object]:
        return {
            "format": "lightning_pipe.schedule",
            "version": 1,
            "family": self.family,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "steps": self.steps,
            "rule": self.rule,
            "flush": self.flush,
            "params": dict(self.params),
            "owners": [list(o) for o in self.owners],
            **({"rings": [[list(r.gather), list(r.spread)] for r in self.rings]} if self.rings else {}),
            **({"relays": [[a.to_dict() for a in relay] for relay in self.relays]} if self.relays else {}),
            "orders": [[a.to_dict() for a in order] for order in self.orders],
        }

    @classmethod
    def from_dict(cls, document: dict[str, object]) -> Schedule:
        if not isinstance(document, dict) or document.get("format") != "lightning_pipe.schedule":
            raise PlanningError('not a lightning_pipe schedule (missing "format": "lightning_pipe.schedule")')
        try:
            return cls(
                family=str(document["family"]),
                stages=int(document["stages"]),
                microbatches=int(document["microbatches"]),
                steps=int(document["steps"]),
                orders=tuple(tuple(Action.from_dict(a) for a in order) for order in document["orders"]),
                owners=tuple(tuple(int(w) for w in owner) for owner in document["owners"]),
                rule=str(document.get("rule", "sync")),
                flush=bool(document.get("flush", True)),
                rings=tuple(Ring(*ring) for ring in document.get("rings") or ()),
                relays=tuple(tuple(Action.from_dict(a) for a in relay) for relay in document.get("relays") or ()),
                params=dict(document.get("params") or {}),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise PlanningError(f"malformed schedule document: {error}") from None

    def to_torch(self) -> dict[int, list[str]]:
        """torch.distributed.pipelining's ``{rank: ["0F0", "0B0", ...]}`` (single-step families only)."""
        if self.steps != 1:
            raise PlanningError(
                f"{self.family}: torch.distributed.pipelining schedules cover one step, this has {self.steps}"
            )
        return {
            worker: [a.to_torch() for a in order if a.kind is not Kind.UPDATE]
            for worker, order in enumerate(self.orders)
        }

    @classmethod
    def from_torch(
        cls, orders: dict[int, Sequence[str | None]] | Sequence[Sequence[str | None]], family: str = "torch"
    ) -> Schedule:
        """Import a torch.distributed.pipelining ``pipeline_order`` (``None`` entries are idle slots).

        Each stage's owner is the worker that runs its forwards; updates are appended per worker.
        FSDP bookkeeping actions (``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``) are dropped and
        DualPipe's ``(a;b)OVERLAP_F_B`` becomes ``a`` then ``b``.
        """
        ranks = orders if isinstance(orders, dict) else dict(enumerate(orders))
        parsed = [[action for text in ranks[w] for action in _parse_torch(text)] for w in sorted(ranks)]
        stages = 1 + max(a.stage for order in parsed for a in order)
        microbatches = 1 + max(a.microbatch for order in parsed for a in order if a.microbatch is not None)
        owner = {a.stage: w for w, order in enumerate(parsed) for a in order if a.kind is Kind.F}
        if len(owner) != stages:
            missing = sorted(set(range(stages)) - set(owner))
            raise PlanningError(f"torch schedule has no forward for stage(s) {missing}")
        for w, order in enumerate(parsed):
            order.extend(Action(Kind.UPDATE, s, None, 0) for s in sorted(s for s, o in owner.items() if o == w))
        return cls(
            family=family,
            stages=stages,
            microbatches=microbatches,
            steps=1,
            orders=parsed,
            owners=tuple((owner[s],) for s in range(stages)),
        )
