"""Stateful datasets: :class:`ShuffledDataset` (an endless pass reshuffled each epoch by its own generator) and
:class:`DrawnBatches`, which lets the RL loop address a :class:`~asyncsess.rl.types.StatefulDataset` by batch
index and saves, with each checkpoint, the state from which the groups not yet trained are drawn again.

``state_dict()`` is checked when the run starts (JSON data, and ``load_state_dict`` of it gives it back) and
on every draw, so a dataset whose state cannot be saved fails with :class:`~asyncsess.errors.InvalidInputError`
before a training step, never halfway through writing a checkpoint.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from ..errors import InvalidInputError
from .types import EnvGroupBuilder, RLDataset, StatefulDataset

__all__ = ["ShuffledDataset", "CheckedBatches", "DrawnBatches", "made_datasets", "run_dataset"]

T = TypeVar("T")
_FIX_JSON = "return dicts, lists, str, int, float, bool and None (random.getstate() as lists, numpy values via int() or .tolist())"


class ShuffledDataset(Generic[T]):
    """``batch_size`` builders per batch (``build(item)``) from an endless pass over ``items``, reshuffled each epoch
    by its own generator (numpy PCG64 seeded with ``seed``). Its state is the epoch, the position in it and the
    generator's state when the epoch began, so a run over it resumes exactly."""

    def __init__(self, items: Sequence[T], batch_size: int, build: Callable[[T], EnvGroupBuilder], seed: int = 0) -> None:
        if not items:
            raise InvalidInputError("no items", field="items", fix="pass at least one item")
        if batch_size < 1:
            raise InvalidInputError(f"batch_size={batch_size}", field="batch_size", fix="use groups_per_batch (>= 1)")
        self.items, self.batch_size, self.build = list(items), batch_size, build
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.epoch = -1
        self._new_epoch()

    def _new_epoch(self) -> None:
        self.epoch += 1
        self.position = 0
        self._epoch_start = self.rng.bit_generator.state
        self.order = self.rng.permutation(len(self.items))

    def next_batch(self) -> list[EnvGroupBuilder]:
        out = []
        for _ in range(self.batch_size):
            if self.position == len(self.items):
                self._new_epoch()
            out.append(self.build(self.items[int(self.order[self.position])]))
            self.position += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"num_items": len(self.items), "epoch": self.epoch, "position": self.position, "rng": self._epoch_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; one that is not one (a position past the epoch, a negative epoch, not a
        PCG64 state) is an InvalidInputError naming the key, before anything changes."""
        n = state.get("num_items") if isinstance(state, dict) else None
        if n != len(self.items) or type(n) is not int:
            raise InvalidInputError(
                f"the state is of {n!r:.40} items, this dataset has {len(self.items)}",
                field="items",
                fix="resume with the same items, or start a new run directory",
            )
        for key, top in (("epoch", 2**53), ("position", len(self.items))):
            if type(state.get(key)) is not int or not 0 <= state[key] <= top:
                raise InvalidInputError(
                    f"{key} {state.get(key)!r:.40} is not a whole number of 0..{top}", field=f"state.{key}", fix="start a new run directory"
                )
        rng = np.random.Generator(np.random.PCG64())
        try:
            if not isinstance(saved := state.get("rng"), dict):
                raise TypeError(f"a {type(saved).__name__}")
            rng.bit_generator.state = saved
        except (TypeError, ValueError, KeyError, OverflowError) as err:
            raise InvalidInputError(f"rng is not a PCG64 state ({err})", field="state.rng", fix="start a new run directory") from None
        self.rng = rng
        self.epoch = state["epoch"] - 1
        self._new_epoch()
        self.position = state["position"]


def _type_name(dataset: object) -> str:
    """The class as written, without its module (``python train.py`` and ``python -m pkg.train`` name it alike)."""
    return type(dataset).__qualname__


def _dump(dataset: StatefulDataset) -> str:
    """``dataset.state_dict()`` as JSON text (a copy: later draws cannot change it)."""
    state = dataset.state_dict()
    if not isinstance(state, dict):
        raise InvalidInputError(f"{_type_name(dataset)}.state_dict() returned a {type(state).__name__}", field="state_dict", fix=_FIX_JSON)
    try:
        return json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise InvalidInputError(f"{_type_name(dataset)}.state_dict() is not JSON data: {err}", field="state_dict", fix=_FIX_JSON) from err


def _load(dataset: StatefulDataset, state: dict[str, Any], what: str) -> str:
    """Load ``state`` (``what`` it is, for errors) and check the dataset now reports it; its state as JSON text."""
    name = _type_name(dataset)
    try:
        dataset.load_state_dict(json.loads(json.dumps(state)))
    except InvalidInputError:
        raise
    except Exception as err:
        raise InvalidInputError(
            f"{name}.load_state_dict() failed on {what}: {err!r}",
            field="load_state_dict",
            fix="restore every key state_dict() returns, converting JSON lists back where needed (tuple(...) for random.setstate)",
        ) from err
    now = _dump(dataset)
    if json.loads(now) != state:
        raise InvalidInputError(
            f"{name} does not round-trip its state: after load_state_dict({what}) state_dict() returns {now[:200]}",
            field="load_state_dict",
            fix="make load_state_dict(state) restore exactly what state_dict() returned",
        )
    return now


_BATCH_FIX = "return a list of groups_per_batch EnvGroupBuilders (things with make_envs()), e.g. ProblemGroupBuilder"


def _check_batch(batch: object, source: str, per_batch: int | None, field: str, fix: str = _BATCH_FIX) -> list[EnvGroupBuilder]:
    """``batch`` as a list if it holds ``per_batch`` (``None``: any number of) group builders; else an
    InvalidInputError naming ``source``."""
    if not isinstance(batch, Iterable) or isinstance(batch, (str, bytes, Mapping)):
        raise InvalidInputError(f"{source} gave a {type(batch).__name__}, not a list of builders", field=field, fix=fix)
    items: list[Any] = list(batch)
    if per_batch is not None and len(items) != per_batch:
        raise InvalidInputError(f"{source} gave {len(items)} builders, the run takes {per_batch}", field=field, fix=fix)
    wrong = next((b for b in items if not callable(getattr(b, "make_envs", None))), None)
    if wrong is not None:
        raise InvalidInputError(f"{source} gave a {type(wrong).__qualname__} ({wrong!r:.60}), not a group builder", field=field, fix=fix)
    return items


class CheckedBatches:
    """An :class:`RLDataset` whose batches are checked as the loop takes them: ``groups_per_batch`` group builders
    each. The loop asks for batch after batch, past ``len()`` (which it does not read), so a finite dataset in the
    cookbook's style (a slice per index) ends the run with an InvalidInputError naming it, not an IndexError."""

    def __init__(self, dataset: RLDataset, groups_per_batch: int) -> None:
        self.dataset, self.per_batch = dataset, groups_per_batch

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        source = f"{_type_name(self.dataset)}.get_batch({index})"
        try:
            batch = self.dataset.get_batch(index)
        except IndexError as err:
            raise InvalidInputError(
                f"{source} raised IndexError ({str(err)[:80]}): the run takes batches 0, 1, 2, ... for max_steps steps",
                field="get_batch",
                fix="make get_batch endless (e.g. index % len(self) with a new shuffle per epoch, as ProblemDataset does) or lower max_steps",
            ) from err
        if isinstance(batch, Sequence) and len(batch) < self.per_batch:
            source += " (past the end of a finite dataset? the run takes batches for max_steps steps: make get_batch endless)"
        return _check_batch(batch, source, self.per_batch, "get_batch")

    def __len__(self) -> int:
        return len(self.dataset)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of the dataset (``extra["data"]``), so that a resume over another one is refused:
        its class and its ``len()`` (``None`` where that fails)."""
        try:
            batches = len(self.dataset)
        except Exception:
            batches = None
        return {"type": _type_name(self.dataset), "batches": batches if type(batches) is int else None}


class DrawnBatches:
    """A :class:`~asyncsess.rl.types.StatefulDataset` addressed by batch index (an :class:`RLDataset`): batch ``i`` is
    the ``i``-th ``next_batch()``. It keeps each drawn batch still needed, with the dataset's state before it,
    so :meth:`state` can name the state from which a resumed run draws again what was not yet trained.

    ``saved`` (from :meth:`state`, in a checkpoint) restores the dataset there. ``needed()`` (set by the loop)
    is the lowest group index still needed; batches below it are forgotten when a new one is drawn.
    """

    def __init__(self, dataset: StatefulDataset, groups_per_batch: int, saved: dict[str, Any] | None = None) -> None:
        self.dataset, self.per_batch = dataset, groups_per_batch
        self.first = 0  # the number of the first kept batch
        self.kept: deque[tuple[str, list[EnvGroupBuilder]]] = deque()  # (state before it, its builders)
        self.needed: Callable[[], int] = lambda: 0
        if saved is None:
            self._state = _load(dataset, json.loads(_dump(dataset)), "its own state_dict()")
            return
        if (
            not isinstance(saved, dict)
            or not isinstance(saved.get("state"), dict)
            or type(saved.get("batch")) is not int
            or not 0 <= saved["batch"] <= 2**53
        ):
            raise InvalidInputError(
                f"the checkpoint's dataset entry {str(saved)[:80]} is not a saved dataset state",
                field="checkpoints.jsonl.extra.dataset",
                fix="start a new run directory",
            )
        if saved.get("type") != _type_name(dataset):
            raise InvalidInputError(
                f"the checkpoint holds the state of a {saved.get('type')}, make_datasets returned a {_type_name(dataset)}",
                field="make_datasets",
                fix="resume with the same dataset class, or start a new run directory",
            )
        self.first = int(saved["batch"])
        self._state = _load(dataset, saved["state"], f"the state saved at batch {self.first}")

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        if index < self.first:
            raise RuntimeError(f"batch {index} was forgotten (kept from {self.first}); a group below needed() was asked for")
        while index >= self.first + len(self.kept):
            self._draw()
        return self.kept[index - self.first][1]

    def _draw(self) -> None:
        drop = min(self.needed() // self.per_batch, self.first + len(self.kept)) - self.first
        for _ in range(max(drop, 0)):
            self.kept.popleft()
            self.first += 1
        number = self.first + len(self.kept)
        name = _type_name(self.dataset)
        try:
            drawn = self.dataset.next_batch()
        except StopIteration as err:
            raise InvalidInputError(
                f"{name} ran out at batch {number}", field="next_batch", fix="make next_batch() endless (start a new epoch)"
            ) from err
        self.kept.append((self._state, _check_batch(drawn, f"{name}.next_batch() at batch {number}", self.per_batch, "next_batch")))
        self._state = _dump(self.dataset)

    def state(self, first_needed: int) -> dict[str, Any]:
        """What a checkpoint saves: the dataset's type, and its state before the batch of group ``first_needed``
        (the lowest index not yet trained, or the next never started)."""
        number = first_needed // self.per_batch
        if number < self.first or number > self.first + len(self.kept):
            raise RuntimeError(f"batch {number} is not kept (kept: {self.first} to {self.first + len(self.kept) - 1})")
        text = self.kept[number - self.first][0] if number < self.first + len(self.kept) else self._state
        return {"type": _type_name(self.dataset), "batch": number, "state": json.loads(text)}

    def __len__(self) -> int:
        """The batches drawn so far."""
        return self.first + len(self.kept)


def made_datasets(made: object) -> tuple[RLDataset | StatefulDataset, list[EnvGroupBuilder]]:
    """What ``make_datasets`` returned, checked: a pair of the training dataset and the held-out group builders (a
    list; ``None`` for none, as tinker-cookbook's dataset builders return). Anything else is an InvalidInputError
    naming ``make_datasets``, raised before any request."""
    fix = "return (training dataset, a list of held-out EnvGroupBuilders, or [] / None for none)"
    if not isinstance(made, tuple) or len(made) != 2:
        raise InvalidInputError(f"make_datasets returned {made!r:.80}, not a pair", field="make_datasets", fix=fix)
    train, test = made
    if test is None:
        return train, []
    if callable(getattr(test, "get_batch", None)):
        raise InvalidInputError(
            f"make_datasets returned a {_type_name(test)} (a dataset of batches) as the held-out set",
            field="make_datasets",
            fix="return its builders as a list: [b for i in range(len(ds)) for b in ds.get_batch(i)]",
        )
    return train, _check_batch(test, "make_datasets' held-out set", None, "make_datasets", fix)


def run_dataset(dataset: RLDataset | StatefulDataset, groups_per_batch: int, saved: dict[str, Any] | None) -> CheckedBatches | DrawnBatches:
    """The dataset the loop addresses by index: an :class:`RLDataset` as :class:`CheckedBatches`, a :class:`StatefulDataset` as
    :class:`DrawnBatches` restored to ``saved`` (a checkpoint's ``extra``, ``None`` for a new run)."""
    extra = saved or {}
    if isinstance(dataset, StatefulDataset):
        if saved is not None and "dataset" not in extra:
            raise InvalidInputError(
                f"the checkpoint holds no dataset state (it was written by a run over an index-addressed dataset), "
                f"make_datasets returned a {_type_name(dataset)}",
                field="make_datasets",
                fix="resume with the same dataset, or start a new run directory",
            )
        return DrawnBatches(dataset, groups_per_batch, extra.get("dataset"))
    if "dataset" in extra:
        kind = extra["dataset"].get("type") if isinstance(extra["dataset"], dict) else None
        raise InvalidInputError(
            f"the checkpoint holds the state of a {kind!r:.60}, make_datasets returned an index-addressed {_type_name(dataset)}",
            field="make_datasets",
            fix="resume with the same dataset, or start a new run directory",
        )
    if not callable(getattr(dataset, "get_batch", None)):
        raise InvalidInputError(
            f"{_type_name(dataset)} is neither an RLDataset nor a StatefulDataset",
            field="make_datasets",
            fix="give it get_batch(index) and __len__(), or next_batch(), state_dict() and load_state_dict()",
        )
    checked = CheckedBatches(dataset, groups_per_batch)
    if "data" in extra and extra["data"] != checked.identity():
        raise InvalidInputError(
            f"the checkpoint was written over {str(extra['data'])[:80]}, make_datasets returned {checked.identity()}",
            field="make_datasets",
            fix="resume with the same dataset (class and number of batches), or start a new run directory",
        )
    return checked
