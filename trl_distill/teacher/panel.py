"""Several teachers at once (`DistillationConfig.teachers`): a `TeacherPanel` is one `base.TeacherSource` made of
several, each of any kind (a live model with its own ZeRO-3 plugin, a cache, a server), that the trainer asks like
any other.

Each member does what it does alone: a live teacher is loaded partitioned under its own plugin ("teacher:NAME"), runs
its once-per-step pass (one gather of it per optimizer step) and hands its rows; a cache or a server adds its signal
to the batch under its own key. The panel combines their signals for the fused loss (`loss.combined`): routed (each
row learns from the teacher the dataset's `teacher_column` names; a row naming none, from the first listed), or
mixed with `teacher_weights` (the mixture of distributions, or the weighted sum of divergences). It counts each
teacher's part of the KD sum, its share of the loss tokens and its own diagnostics, which the trainer logs as
``kd_loss/NAME``, ``teacher_tokens/NAME`` and e.g. ``top1_agreement/NAME``.
"""

from __future__ import annotations

import torch

from ..data.batch import SIGNAL, add_extras, drop_extras, extras_of, loss_tokens, pop_extra, put_signal, take_signal
from ..loss.combined import MixtureSignal, RoutedSignal, SumSignal, routed_order
from .base import TeacherBatch, TeacherSource
from .cached import ROW, CachedTeacher
from .capabilities import (
    ChecksArgs,
    LogitChecked,
    OwnBatch,
    OwnEngine,
    OwnMetrics,
    OwnRows,
    OwnVocabulary,
    PreparesDataset,
    RoutesRows,
    Samples,
    SamplingServer,
    ScoresSamples,
    StepHooks,
    StudentTokenizer,
    TrainRows,
    WritesCache,
    columns_of,
    plugins_of,
    popped,
    vocab_config_of,
)
from .live import LiveTeacher
from .served import ServedTeacher

ROUTE = "teacher_route"  # the prepared column (the batch's `route`): each row's teacher, by its index in the panel
DEFAULT_COLUMN, TRL_COLUMN = "teacher", "teacher_id"  # the routing column's default name, and TRL's name for it
LABEL_KEYS = ("labels", "shift_labels")


class TeacherPanel(TeacherSource, OwnEngine, RoutesRows, PreparesDataset, TrainRows, OwnBatch, OwnVocabulary,
                   StepHooks, LogitChecked, ScoresSamples, OwnMetrics):
    """The teachers `members` (name -> source, in the order listed), combined as `combine` says ("route",
    "mixture", "sum") with `weights` (mixing) and the routing `column`.

    Its capabilities combine its members': each one it declares it has whatever its members have (asking each member
    that has it), but those it has only when `every` member has them; it `withholds` the rest."""

    refused = {WritesCache: "`trl-distill cache-teacher` writes one teacher's cache: run it once per teacher, with "
                            "that teacher's --teacher_model_name_or_path or --teacher_server."}
    every = (ScoresSamples,)  # on-policy: every teacher scores the student's samples (a cache cannot)
    withholds = (WritesCache, Samples, SamplingServer, StudentTokenizer, OwnRows, ChecksArgs)  # one teacher's each
    # (a cache, seq_kd's sampler: refused with several; a member's own tokenizer, rows and checks are its own)

    def __init__(self, members: dict[str, TeacherSource], combine: str = "route", weights: list[float] | None = None,
                 column: str = "teacher"):
        self.members, self.combine, self.weights, self.column = members, combine, weights, column
        self.names = list(members)
        for name, member in members.items():  # one plugin, column and batch key each
            if isinstance(member, LiveTeacher):
                member.plugin_name, member.label = f"teacher:{name}", f"teacher {name}"
            if isinstance(member, CachedTeacher):
                member.row_column, member.signal_key = f"{ROW}:{name}", f"{SIGNAL}:{name}"
            if isinstance(member, ServedTeacher):
                member.signal_key = f"{SIGNAL}:{name}"
        self.last: RoutedSignal | SumSignal | MixtureSignal | None = None  # the signal of the last micro-batch

    @property
    def routed(self) -> bool:
        return self.combine == "route"

    def capability(self, capability):
        if capability in self.every and any(m.capability(capability) is None for m in self.members.values()):
            return None
        return super().capability(capability)

    def having(self, capability) -> list:
        """Each member as `capability`, of those that have it, in the order listed."""
        return [own for member in self.members.values() if (own := member.capability(capability)) is not None]

    def column_of(self, dataset) -> str:
        """The routing column of `dataset`: `column`, else TRL's ``teacher_id`` when `column` is left at its default
        and the dataset has that one instead."""
        names = getattr(dataset, "column_names", None) or []
        if self.column not in names and self.column == DEFAULT_COLUMN and TRL_COLUMN in names:
            return TRL_COLUMN
        return self.column

    @property
    def columns(self) -> tuple[str, ...]:
        own = (ROUTE,) if self.routed else ()
        return tuple(c for member in self.members.values() for c in columns_of(member)) + own

    @property
    def name(self) -> str:
        """Every teacher as NAME=SOURCE, and how they combine (what a checkpoint's run record holds)."""
        listed = ",".join(f"{name}={member.name or member.describe()}" for name, member in self.members.items())
        return f"{listed} ({self.combine}{'' if self.weights is None else ' ' + str(self.weights)})"

    @property
    def config_notes(self) -> list[str]:
        engines = {name: m.capability(OwnEngine) for name, m in self.members.items()}
        return [f"{name}: {note}" for name, engine in engines.items() if engine for note in engine.config_notes]

    def describe(self) -> str:
        return f"the teachers {', '.join(self.names)} ({self.combine})"

    # ---- Before the data is prepared ----

    def plugins(self, engine, student_plugin) -> dict:
        out = {}
        for member in self.members.values():
            out.update(plugins_of(member, engine, student_plugin))
        return out

    def route_rows(self, train_dataset, eval_dataset):
        """Every row's teacher is one of the panel's (routing), checked on the raw datasets before anything loads. A
        dict of train datasets named after teachers is routed as a whole: one dataset, each row naming its own."""
        if isinstance(train_dataset, dict):
            train_dataset = self.concatenated(train_dataset)
        evaluation = eval_dataset if isinstance(eval_dataset, dict) else {"eval": eval_dataset}
        for split, dataset in {"train": train_dataset, **evaluation}.items():
            self._check_split(dataset, split)
        return train_dataset

    def concatenated(self, named: dict):
        """``{teacher name: dataset}`` as one dataset whose `column` names each row's teacher."""
        from datasets import concatenate_datasets

        from ..data.prepare import dataset_format

        if not self.routed:
            raise ValueError("A dict of train datasets routes each one to its teacher: set teacher_combine='route', "
                             "or pass one dataset to mix the teachers on.")
        unknown = [name for name in named if name not in self.members]
        if unknown:
            raise ValueError(f"A dict of train datasets routes each one to the teacher of its name; {unknown} name no "
                             f"teacher of {self.names}.")
        formats = {name: dataset_format(dataset) for name, dataset in named.items()}
        if len(set(formats.values())) > 1:  # concatenated, each row would hold the other format's fields as None
            raise ValueError("The teachers' datasets are of different formats (" + ", ".join(
                f"{name}: {fmt or 'columns ' + str(named[name].column_names)}" for name, fmt in formats.items())
                + "); they train as one dataset, so convert them to one format (e.g. prompt-completion rows to "
                "`messages`).")
        parts = [dataset.remove_columns([self.column]) if self.column in dataset.column_names else dataset
                 for dataset in named.values()]
        return concatenate_datasets([part.add_column(self.column, [name] * len(part))
                                     for name, part in zip(named, parts, strict=True)])

    def _check_split(self, dataset, split: str) -> None:
        if not self.routed or dataset is None or not hasattr(dataset, "column_names"):
            return
        column = self.column_of(dataset)
        if column not in dataset.column_names:
            if len(self.members) > 1:
                raise ValueError(f"Routing rows to the teachers {self.names} needs the {split} dataset's column "
                                 f"{self.column!r} naming each row's teacher (--teacher_column), and the dataset has "
                                 f"{dataset.column_names}. Add it, or mix the teachers (--teacher_combine sum).")
            return
        known = set(self.names)
        for i, value in enumerate(dataset[column]):
            if value not in (None, "") and value not in known:
                raise ValueError(f"Row {i} of the {split} dataset names the teacher {value!r} in {column!r}; the "
                                 f"teachers are {self.names} (a row naming none learns from {self.names[0]!r}).")

    def prepare_dataset(self, dataset, name: str):
        for member in self.having(PreparesDataset):
            dataset = member.prepare_dataset(dataset, name)
        if not self.routed or not hasattr(dataset, "add_column"):
            return dataset
        index = {teacher: i for i, teacher in enumerate(self.names)}
        column = self.column_of(dataset)
        values = dataset[column] if column in dataset.column_names else [None] * len(dataset)
        return dataset.add_column(ROUTE, [index.get(v, 0) if v not in (None, "") else 0 for v in values])

    def vocab_config(self, student_config):
        """The smallest vocabulary of the teachers (the loss compares that many logits; each is checked as the panel
        attaches)."""
        configs = [vocab_config_of(member, student_config) for member in self.members.values()]
        return min(configs, key=lambda config: config.vocab_size)

    # ---- Once the trainer exists ----

    def attach(self, context) -> None:
        from ..runtime.validation import shared_vocab_size

        super().attach(context)
        for member in self.members.values():
            shared_vocab_size(context.student.config, vocab_config_of(member, context.student.config),
                              context.processing_class)
            member.attach(context)

    def train_rows(self, dataset):
        for member in self.having(TrainRows):
            dataset = member.train_rows(dataset)
        return dataset

    def collator(self, base):
        """Each member's collator around the last, in the order listed; routing outermost (it reads the rows'
        teacher index), and then, routed, each server asked for its own rows only."""
        asking = [(i, member) for i, member in enumerate(self.members.values()) if self._asks_own_rows(member)]
        for member in self.having(OwnBatch):
            if not self._asks_own_rows(member):
                base = member.collator(base)
        return RouteCollator(base, asking, self._ask) if self.routed else base

    def _asks_own_rows(self, member) -> bool:
        """A routed member that asks for its rows' signal as they are collated (a server): only for its own."""
        return self.routed and runs_on_own_rows(member) and getattr(member, "signal_key", None) is not None

    @staticmethod
    def _ask(batch: dict, asking: list, score=None) -> None:
        """Each member of `asking` (``(index, member)``) asked for the signal of its own rows of `batch` only
        (`score`: how, by default its `request`); a member with no rows there gets an empty signal."""
        for i, member in asking:
            picked = extras_of(batch).route == i
            if not picked.any():
                put_signal(batch, member.signal_key, member.no_rows())
            elif score is None:
                put_signal(batch, member.signal_key, member.request(own_rows(batch, picked)))
            else:
                rows = own_rows(batch, picked)
                score(member, rows)
                put_signal(batch, member.signal_key, take_signal(rows, member.signal_key))

    def prepare(self, accelerator, device: torch.device) -> None:
        for member in self.members.values():
            member.prepare(accelerator, device)

    def logit_candidates(self, model_inputs: dict, extras) -> list:
        extras = extras or (None, [None] * len(self.members))
        return [c for member, own in zip(self.members.values(), extras[1], strict=True)
                if (checked := member.capability(LogitChecked)) is not None
                for c in checked.logit_candidates(model_inputs, own)]

    def before_step(self, batch_samples: list[dict]) -> None:
        if not self.context.logit_paths.settled and batch_samples:  # settled on the whole first batch, each member's
            self._settle_logit_paths(batch_samples[0])  # own inputs there (its own tokens), before any pass runs
        # Each live teacher's once-per-step pass sees the model inputs only (not the others' signals, not the route)
        plain = [drop_extras(batch, "route", "signals", "cross_tokenizer") for batch in batch_samples]
        for i, member in enumerate(self.members.values()):
            hooks = member.capability(StepHooks)
            if hooks is not None and self.routed and runs_on_own_rows(member):  # routed: a live teacher runs on
                hooks.before_step([own_rows(batch, self._route(full) == i)  # its own rows only
                                   for batch, full in zip(plain, batch_samples, strict=True)])
            elif hooks is not None:
                hooks.before_step(plain)

    @staticmethod
    def _route(batch: dict) -> torch.Tensor:
        """A batch's rows' teacher indices (every row the first teacher's when no column routes them)."""
        route = extras_of(batch).route
        return route if route is not None else torch.zeros(len(batch["input_ids"]), dtype=torch.long)

    def _settle_logit_paths(self, batch: dict) -> None:
        run = self.context
        first = run.prepare_inputs(dict(batch))
        extras = self.pop_batch(first)  # from this copy: the batch itself keeps them for its loss
        mask = loss_tokens(first)[1]
        model_inputs = {k: v for k, v in first.items() if k not in ("labels", "shift_labels")}
        run.logit_paths.settle(run.wrapped, model_inputs, mask[:, mask.any(0)], extras)

    def pop_batch(self, inputs: dict):
        route = pop_extra(inputs, "route")  # (on the batch's device, as its model inputs)
        route = None if route is None else route.to(inputs["input_ids"].device)
        return route, [popped(member, inputs) for member in self.members.values()]

    def for_batch(self, model_inputs: dict, extras, mask: torch.Tensor, keep: torch.Tensor) -> PanelBatch:
        route, own = extras
        if self.routed and route is None:  # one teacher listed and no column: every row is the first teacher's
            route = torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
        batches, masks = [], []
        for i, (member, e) in enumerate(zip(self.members.values(), own, strict=True)):
            if self.routed and runs_on_own_rows(member):  # its forward on its own rows only (an idle row if none)
                picked = route.to(mask.device) == i
                masks.append(mask[picked] if picked.any() else mask[:1] & False)
                batches.append(member.for_batch(own_rows(model_inputs, picked), e, masks[-1], keep))
            else:  # its signal over every row, of which the routed loss picks its own
                masks.append(None)
                batches.append(member.for_batch(model_inputs, e, mask, keep))
        return PanelBatch(self, batches, route, mask, masks)

    def score_sampled(self, batch: dict, source: dict | None = None) -> None:
        """The student's samples (`batch`) of the prompts of `source`: each row keeps its teacher; each teacher adds
        what it scores them with (a server its top-k, a teacher of another tokenizer its own ids)."""
        if self.routed and source is not None and extras_of(source).route is not None:
            add_extras(batch, route=extras_of(source).route.to(batch["input_ids"].device))
        asking = [(i, member) for i, member in enumerate(self.members.values()) if self._asks_own_rows(member)]
        for member in self.members.values():
            if not (self._asks_own_rows(member) and extras_of(batch).route is not None):
                member.capability(ScoresSamples).score_sampled(batch, source)
        if extras_of(batch).route is not None:
            self._ask(batch, asking, lambda member, rows: member.capability(ScoresSamples).score_sampled(rows, source))

    def after_loss(self) -> None:
        for member in self.having(StepHooks):
            member.after_loss()

    def kd_parts(self) -> dict[str, tuple[torch.Tensor, int | None]] | None:
        """The last micro-batch's KD sum of each teacher (and, routed, its loss tokens), or None when mixed by
        distribution (one teacher, the mixture)."""
        signal = self.last
        if signal is None or isinstance(signal, MixtureSignal):
            return None
        tokens = [None] * len(self.names)
        if isinstance(signal, RoutedSignal):
            tokens = [b - a for a, b in zip(signal.bounds, signal.bounds[1:])]
        return {name: (torch.as_tensor(part, dtype=torch.float32), count)
                for name, part, count in zip(self.names, signal.parts, tokens, strict=True)}

    def own_metrics(self) -> dict | None:
        """Each teacher's diagnostics of the last micro-batch (`loss.diagnostics`), when it was measured and the
        teachers were routed or summed; else None."""
        own = getattr(self.last, "own", None)
        return None if own is None else dict(zip(self.names, own, strict=True))

    def release(self) -> None:
        for member in self.members.values():
            member.release()


def runs_on_own_rows(member: TeacherSource) -> bool:
    """Routed among several, whether `member` runs on its own rows only (`capabilities.OwnRows`)."""
    own = member.capability(OwnRows)
    return own is not None and own.routes_own_rows


class PanelBatch(TeacherBatch):
    """The panel's teachers over one micro-batch: each member's own batch, combined into one signal."""

    def __init__(self, panel: TeacherPanel, batches: list, route: torch.Tensor | None, mask: torch.Tensor,
                 masks: list[torch.Tensor | None]):
        self.panel, self.batches, self.route, self.mask = panel, batches, route, mask
        self.masks = masks  # a teacher run on its own rows: their loss tokens; None: it covers every row

    @property
    def heads(self) -> tuple:
        return tuple(batch.head for batch in self.batches)  # gathered around the loss

    def signal(self, rows: torch.Tensor | None, n: int, settings):
        panel = self.panel
        if panel.routed:
            per_row = self.route.to(self.mask.device)[:, None].expand_as(self.mask)[self.mask]  # the loss rows' order
            order, bounds = routed_order(per_row, len(self.batches))
            signals = []
            for i, (batch, own) in enumerate(zip(self.batches, self.masks, strict=True)):
                if own is None:  # over every row: its own are picked
                    signals.append(batch.signal(rows, n, settings, picks=order[bounds[i]:bounds[i + 1]]))
                else:  # over its own rows, in the loss's order (the stable order keeps the rows' own)
                    signals.append(batch.signal(own.reshape(-1).nonzero().squeeze(1), bounds[i + 1] - bounds[i],
                                                settings))
            panel.last = RoutedSignal(signals, order, bounds)
        else:
            signals = [batch.signal(rows, n, settings) for batch in self.batches]
            kind = MixtureSignal if panel.combine == "mixture" else SumSignal
            panel.last = kind(signals, panel.weights)
        return panel.last


class RouteCollator:
    """Wraps the trainer's collator: pops each example's teacher index and adds the rows' ``[B]`` to the batch; then
    `ask` (the panel's) asks each member of `asking` for its own rows' signal."""

    def __init__(self, collator, asking: list = (), ask=None):
        self.collator, self.asking, self.ask = collator, list(asking), ask

    def __call__(self, examples: list[dict]) -> dict:
        route = torch.tensor([int(example[ROUTE]) for example in examples], dtype=torch.long)
        batch = self.collator([{k: v for k, v in example.items() if k != ROUTE} for example in examples])
        add_extras(batch, route=route)
        if self.asking:
            self.ask(batch, self.asking)
        return batch


def own_rows(batch: dict, picked: torch.Tensor) -> dict:
    """The rows of `batch` that `picked` ``[B]`` selects (each tensor whose first dimension is B); with none picked,
    its first row with no loss token: an idle row (a partitioned teacher's forwards are collective, so it still runs
    one)."""
    rows = len(picked)

    def per_row(value) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows

    if bool(picked.any()):
        return {k: v[picked.to(v.device)] if per_row(v) else v for k, v in batch.items()}
    idle = {k: v[:1].clone() if per_row(v) else v for k, v in batch.items()}
    for key in LABEL_KEYS:
        if key in idle:
            idle[key].fill_(-100)
    return idle
